// The pool publishes a job by writing job_ and then storing a new epoch_ (release); workers
// observe it (acquire), run their share and count pending_ down; the caller waits
// for pending_ to reach zero (acquire), which orders the workers' writes before its return.
#include "kernels/cpu/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

#include "glog/logging.h"

namespace moe::cpu {
namespace {

// How long a waiting thread spins before it sleeps. Long enough to cover the gap between the
// phases of one batch, short enough that an idle pool stops competing for the cores quickly
// (shard processes often share them).
constexpr auto kSpinBudget = std::chrono::microseconds(30);

constexpr uint64_t kThreadsMask = 0xFFFF;
constexpr uint64_t kStopThreads = kThreadsMask;  // thread count that tells workers to exit

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  CHECK_GE(num_threads, 1);
  CHECK_LT(static_cast<uint64_t>(num_threads), kStopThreads);
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  const uint64_t next = ((epoch_.load(std::memory_order_relaxed) >> 16) + 1) << 16;
  epoch_.store(next | kStopThreads, std::memory_order_release);
  epoch_.notify_all();
  for (std::thread& t : workers_) t.join();
}

template <typename T>
T ThreadPool::WaitForChange(const std::atomic<T>& value, T seen) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBudget;
  for (int spins = 0;; ++spins) {
    const T now = value.load(std::memory_order_acquire);
    if (now != seen) return now;
    _mm_pause();
    if (spins % 64 == 63 && std::chrono::steady_clock::now() > deadline) break;
  }
  for (;;) {
    value.wait(seen, std::memory_order_acquire);
    const T now = value.load(std::memory_order_acquire);
    if (now != seen) return now;
  }
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    seen = WaitForChange(epoch_, seen);
    const int threads = static_cast<int>(seen & kThreadsMask);
    if (threads == static_cast<int>(kStopThreads)) return;
    if (index >= threads) continue;
    (*job_)(index, threads);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void ThreadPool::ParallelFor(int max_threads, absl::FunctionRef<void(int, int)> fn) {
  const int n = std::clamp(max_threads, 1, num_threads());
  if (n == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n - 1, std::memory_order_relaxed);
  const uint64_t next = ((epoch_.load(std::memory_order_relaxed) >> 16) + 1) << 16;
  epoch_.store(next | static_cast<uint64_t>(n), std::memory_order_release);
  epoch_.notify_all();
  fn(0, n);
  for (int left = pending_.load(std::memory_order_acquire); left != 0;) {
    left = WaitForChange(pending_, left);
  }
  job_ = nullptr;
}

}  // namespace moe::cpu
