// A fixed pool of worker threads for the CPU kernels: ParallelFor(n, fn) runs fn(thread_index,
// thread_count) once for every thread_index in [0, thread_count) and returns when all have
// finished. Kernels split their own work from (thread_index, thread_count) (STYLE habit 6), so the
// pool never sees work items and never allocates per call.
//
// Called by the CPU backend (one batch at a time) and by benchmarks. Thread-safety: ParallelFor
// must not be called concurrently or from inside `fn`; construction and destruction happen on one
// thread. Ownership: the pool owns its threads; `fn` is borrowed for the duration of the call.
//
// Waiting workers spin briefly (phases of one expert batch follow each other within
// microseconds), then sleep on a futex so that an idle shard costs no CPU.
#ifndef MOE_KERNELS_CPU_THREAD_POOL_H_
#define MOE_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace moe::cpu {

class ThreadPool {
 public:
  // REQUIRES: num_threads >= 1. Starts num_threads - 1 workers: the caller of ParallelFor is
  // thread 0.
  explicit ThreadPool(int num_threads);  // REQUIRES: num_threads < 65535
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i, n) for every i in [0, n) with n = clamp(max_threads, 1, num_threads()); i = 0 runs
  // on the calling thread. Returns after every call has returned.
  void ParallelFor(int max_threads, absl::FunctionRef<void(int, int)> fn);

 private:
  void WorkerLoop(int index);
  // Spins, then sleeps, until `value` differs from `seen`; returns the new value.
  template <typename T>
  static T WaitForChange(const std::atomic<T>& value, T seen);

  std::vector<std::thread> workers_;
  // The job of the current epoch: valid while pending_ > 0.
  const absl::FunctionRef<void(int, int)>* job_ = nullptr;
  // (publication counter << 16) | thread count of the job: one word, so that a worker never
  // pairs one job's thread count with another's epoch.
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
};

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_THREAD_POOL_H_
