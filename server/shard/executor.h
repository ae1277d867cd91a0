// The shard's batch executor: requests of the same layer (and the same weight snapshot) that are
// queued together are merged into one batch, bounded by a token budget and an optional wait, and
// run through the backend by worker threads, as many batches at once as the backend runs
// concurrently (ExpertBackend::MaxConcurrentRuns: a CUDA backend's lanes); each caller gets its
// own rows back.
//
// Merge before overlap: a free lane does not start a second batch of a layer whose batch is
// running, unless that layer's queued requests already hold overlap_min_tokens (or fill a batch,
// max_batch_tokens); they wait and become one larger batch when it ends. Two concurrent batches
// of one layer would read its weights twice, where a decode batch's time is mostly that read;
// batches of different layers (or large ones) run at once.
//
// Called by the service's RPC threads (Run blocks until the caller's batch has run).
// Thread-safety: Run may be called from any number of threads. Ownership: the executor borrows the
// backend; each WorkItem's tensors belong to the caller and must stay alive until Run returns.
#ifndef MOE_SERVER_SHARD_EXECUTOR_H_
#define MOE_SERVER_SHARD_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "server/shard/observer.h"

namespace moe {

// ExecutorOptions::overlap_min_tokens by default. On the H200 (two CUDA lanes, 16-token requests,
// bench/results/rpc_bench_h200_20261202b_overlap_A_C.json) 128 against 32: problem A's shape
// +15-20% at 8 clients (two of its batches at once read its 1.7 GB of weights twice) and +5-7% at
// 64; problem C's shape +6-9% at 64 clients, even over the shared-memory channel at 8 and -13%
// over TCP at 8 (there overlapping the host work of small batches paid).
inline constexpr int64_t kDefaultOverlapMinTokens = 128;

struct ExecutorOptions {
  // Upper bound on tokens merged into one batch (a single larger request still runs alone).
  int64_t max_batch_tokens = 8192;
  // How long the worker may wait for more requests of the same layer before running a batch
  // that is under budget. 0: merge only what is already queued (no added latency).
  absl::Duration max_batch_wait = absl::ZeroDuration();
  // With a backend that runs several batches at once: a free lane starts another batch of a
  // layer whose batch is running only once that layer's queued requests hold this many tokens
  // (or max_batch_tokens, when smaller); fewer wait and merge into its next batch. 0: any queued
  // request starts on a free lane at once.
  int64_t overlap_min_tokens = kDefaultOverlapMinTokens;
  // Told about every batch (metrics); borrowed, may be null. The shard service also reports its
  // requests to it.
  ShardObserver* observer = nullptr;
};

struct ExecutorStats {
  uint64_t requests = 0;
  uint64_t tokens = 0;
  uint64_t batches = 0;
  uint64_t merged_batches = 0;
  uint64_t max_batch_tokens = 0;
  uint64_t errors = 0;
  double compute_seconds = 0;
  // Requests whose deadline had passed when their batch was formed: answered DEADLINE_EXCEEDED
  // and not run (not counted in requests/tokens/batches).
  uint64_t expired = 0;
};

// One caller's staged work: F32 hidden [T, H], I32 local ids [T, K], F32 weights [T, K], optional
// BOOL shared mask [T]; the result goes to `out` (F32 [T, H]).
struct WorkItem {
  int layer_index = 0;
  const ExpertLayer* layer = nullptr;
  TensorView hidden;
  TensorView local_ids;
  TensorView topk_weights;
  TensorView shared_mask;
  TensorView out;
  // `hidden` / `out` are device memory of the backend's CUDA device (ExpertsRequest's flags):
  // such an item runs alone, never merged with others.
  bool hidden_on_device = false;
  bool out_on_device = false;
  // The caller's deadline (the gRPC call's): the item is dropped, not run, once it has passed.
  absl::Time deadline = absl::InfiniteFuture();
};

class Executor {
 public:
  Executor(ExpertBackend* backend, ExecutorOptions options);
  ~Executor();  // finishes queued work, then stops the worker
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs `item` (possibly merged with others) and returns its status.
  [[nodiscard]] absl::Status Run(const WorkItem& item);

  ExecutorStats stats() const;
  // Requests waiting for the worker (queue depth, for metrics and tests).
  size_t queued_requests() const;
  // Stats since the previous call (for load deltas).
  ExecutorStats TakeStatsDelta();

 private:
  struct Pending {
    const WorkItem* item;
    absl::Status status;
    bool done = false;
  };

  void WorkerLoop();
  // Whether a batch led by `item` may start now, as far as batches running go: none of its kind
  // (SameBatch) runs, or `queued_tokens` of its kind reach overlap_min_tokens or fill a batch.
  bool MayStart(const WorkItem& item, int64_t queued_tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first queued request that may lead a batch now (MayStart), or queue_.end().
  std::deque<Pending*>::iterator NextStartable() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pops `lead` and every queued request that can share its batch.
  std::vector<Pending*> TakeBatch(std::deque<Pending*>::iterator lead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the items of `batch` whose deadline has passed and removes them from it.
  void DropExpired(std::vector<Pending*>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct MergeBuffers;
  absl::Status RunBatch(const std::vector<Pending*>& batch, MergeBuffers& merge);
  // Drops the expired items of `batch`, runs the rest with the lock released (counted in
  // running_ meanwhile, so that at most lanes_ batches run on the backend), then answers them
  // and counts them.
  void RunLocked(std::vector<Pending*>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers `batch` with `status` and adds it to the stats.
  void Account(const std::vector<Pending*>& batch, const absl::Status& status,
               absl::Duration compute) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Page-aligned host memory registered with the backend (ExpertBackend::RegisterHostMemory).
  struct MergeBuffer {
    void* data = nullptr;
    size_t bytes = 0;
  };
  // `buffer` with room for `bytes` (grown, re-registered, when smaller).
  void* Reserve(MergeBuffer& buffer, size_t bytes);
  void Release(MergeBuffer& buffer);

  ExpertBackend* const backend_;
  const ExecutorOptions options_;
  // A merged batch's hidden states and output, kept from batch to batch and registered with the
  // backend, so that a CUDA backend moves them without its staging copies. One set per batch
  // that may run at once (lanes_), handed to a running batch from merge_free_.
  struct MergeBuffers {
    MergeBuffer hidden, out;
  };
  // Batches run at once: the backend's MaxConcurrentRuns (at least 1).
  const int lanes_;
  std::vector<MergeBuffers> merges_;
  mutable absl::Mutex mu_;
  std::vector<MergeBuffers*> merge_free_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Batches running (on the workers, or inline on callers' threads): at most lanes_; and the
  // first item of each (alive until its batch is answered).
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<const WorkItem*> running_leads_ ABSL_GUARDED_BY(mu_);
  ExecutorStats stats_ ABSL_GUARDED_BY(mu_);
  ExecutorStats taken_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_EXECUTOR_H_
