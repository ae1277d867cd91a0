// LoadBook: the coordinator's expert-load ledger. It turns the shards' per-slot counts into
// per-(layer, logical expert) and per-(layer, shard) load, cumulative and over a sliding window,
// and keeps a bounded history of per-layer balancedness.
//
// Every count is attributed through the placement of the map version it was recorded under
// (VersionPlacement), so counts from before and after a placement switch aggregate correctly.
// The window is a queue of buckets (the heartbeat interval or longer, at most kMaxBuckets of
// them); time comes from the caller (ClusterState's injectable clock).
//
// Called by ClusterState under its mutex. Thread-safety: not thread-safe (the caller locks).
// Ownership: owns its counters.
#ifndef MOE_SERVER_COORDINATOR_LOAD_BOOK_H_
#define MOE_SERVER_COORDINATOR_LOAD_BOOK_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

// The placement of one map version, as load attribution needs it.
struct VersionPlacement {
  std::vector<uint32_t> slot_to_rank;        // [P]
  std::vector<int32_t> physical_to_logical;  // [L * P], layer-major; -1 = vacant
};

struct LoadBookOptions {
  int num_layers = 1;
  int num_logical = 1;   // E
  int num_physical = 1;  // P
  int num_shards = 1;
  // Window granularity and length; the bucket is stretched so that the window needs at most
  // kMaxBuckets of them.
  absl::Duration bucket = absl::Milliseconds(500);
  absl::Duration window = absl::Seconds(60);
  // Balancedness samples kept (oldest dropped first).
  int max_history = 720;
};

// Per-layer load over a window.
struct WindowLoad {
  std::vector<int64_t> expert;  // [L * E]
  std::vector<int64_t> shard;   // [L * S]
  absl::Duration length;        // what the sums cover
};

class LoadBook {
 public:
  static constexpr int kMaxBuckets = 64;

  // REQUIRES: every count in options >= 1; bucket and window > 0.
  LoadBook(LoadBookOptions options, absl::Time now);

  // Adds counts [L * P] that shard `rank` recorded under `placement`. Counts of slots the rank
  // does not host in that placement, or of vacant slots, are dropped; returns whether any were.
  // REQUIRES: counts.size() == L * P; counts >= 0; placement sized [P] and [L * P].
  bool Add(int rank, const VersionPlacement& placement, absl::Span<const int64_t> counts,
           absl::Time now);

  // Closes the buckets that ended before `now`; when any closed, appends one balancedness sample
  // (window balancedness over `live_ranks`, stamped with `map_version`).
  void Advance(absl::Time now, uint64_t map_version, const std::vector<bool>& live_ranks);

  // Sums over the buckets of the last `length` before `now` (0 or more than the configured
  // window: the whole window), the open bucket included.
  WindowLoad Window(absl::Time now, absl::Duration length) const;

  // Fills `stats` (layers, totals, window fields, history). `live_ranks` [S] selects the shards
  // the window balancedness is taken over.
  void Summarize(absl::Time now, absl::Duration window, const std::vector<bool>& live_ranks,
                 v1::LoadStats* stats) const;

  absl::Duration window_length() const { return bucket_ * num_buckets_; }

  // The cumulative totals (per slot [L * P], expert [L * E], shard [L * S]), for persistence.
  void Totals(std::vector<int64_t>* slot, std::vector<int64_t>* expert,
              std::vector<int64_t>* shard) const;
  // Replaces the cumulative totals with persisted ones (a restarted coordinator); the window
  // and history start empty. False, changing nothing, when a size does not match.
  bool RestoreTotals(std::vector<int64_t> slot, std::vector<int64_t> expert,
                     std::vector<int64_t> shard);

 private:
  struct Bucket {
    int64_t index = 0;  // bucket number since the epoch
    std::vector<int64_t> expert;
    std::vector<int64_t> shard;
  };

  int64_t BucketIndex(absl::Time now) const;
  Bucket& OpenBucket(absl::Time now);
  std::vector<double> LayerBalancedness(const std::vector<int64_t>& shard,
                                        const std::vector<bool>& live_ranks) const;

  const LoadBookOptions options_;
  absl::Duration bucket_;
  int num_buckets_ = 1;
  absl::Time epoch_;
  std::deque<Bucket> buckets_;   // oldest first; the back is open
  std::vector<int64_t> slot_;    // [L * P] cumulative, per slot index over all versions
  std::vector<int64_t> expert_;  // [L * E] cumulative
  std::vector<int64_t> shard_;   // [L * S] cumulative
  std::deque<v1::BalancednessSample> history_;
  int64_t last_sample_index_ = 0;  // bucket of the latest history sample
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_LOAD_BOOK_H_
