// LoadHistory: recent expert load for the dashboard and the windowed metrics, built from periodic
// snapshots of the coordinator's cumulative load (ClusterState::GetLoadStats). It keeps the last
// few snapshots, enough to difference a sliding window of load per (layer, logical expert), and a
// bounded series of per-layer balancedness (mean shard load / max shard load) between consecutive
// snapshots.
//
// Balancedness of an interval with no load on a layer is NaN for that layer (a gap in the chart,
// null in JSON), not 1: an idle layer is not a balanced one. A snapshot whose counts went down
// (or whose shape changed) restarts the history: the cumulative counts were reset. A snapshot
// without layers (no model registered yet) counts as zero load of any shape.
//
// Called by CoordinatorObservability's sampler thread (Add) and by scrapes and dashboard requests
// (Window, Balancedness). Thread-safety: thread-safe (one mutex).
// Ownership: owns copies of what it keeps; memory is O((window_samples + 1) * layers *
// (experts + shards) + history_points * layers).
#ifndef MOE_SERVER_COORDINATOR_LOAD_HISTORY_H_
#define MOE_SERVER_COORDINATOR_LOAD_HISTORY_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

struct LoadHistoryOptions {
  // Snapshots differenced for the window: the window spans this many sampling intervals.
  int window_samples = 10;
  // Balancedness points kept (one per interval between snapshots).
  int history_points = 300;
};

// Load of one window: the counts between the oldest kept snapshot and `current`.
struct LoadWindow {
  absl::Duration span;  // zero when there is no earlier snapshot (then the window is empty)
  int num_layers = 0;
  int num_experts = 0;
  std::vector<int64_t> expert_load;  // [num_layers * num_experts], routes in the window
  std::vector<double> balancedness;  // [num_layers]; NaN for a layer idle in the window
  int64_t routes = 0;                // sum of expert_load
};

struct BalancednessPoint {
  absl::Time time;                // end of the interval
  std::vector<double> per_layer;  // [num_layers]; NaN where the layer was idle
  double mean = 0;                // over the layers with load; NaN if none had any
  double min = 0;                 // likewise
};

// Mean / max of `shard_load` (NaN when every entry is zero or the vector is empty).
double ShardBalancedness(const std::vector<int64_t>& shard_load);

class LoadHistory {
 public:
  // REQUIRES: options.window_samples >= 1, options.history_points >= 1.
  explicit LoadHistory(LoadHistoryOptions options);

  LoadHistory(const LoadHistory&) = delete;
  LoadHistory& operator=(const LoadHistory&) = delete;

  // Records the cumulative load `stats` observed at `time` (times must not go backwards; a
  // snapshot older than the newest one is ignored).
  void Add(absl::Time time, const v1::LoadStats& stats) ABSL_LOCKS_EXCLUDED(mu_);

  // The window ending at `current` (cumulative load observed at `now`), starting at the oldest
  // kept snapshot. Empty (span zero, no routes) before the first snapshot or when `current`'s
  // shape differs from the kept snapshots.
  LoadWindow Window(absl::Time now, const v1::LoadStats& current) const ABSL_LOCKS_EXCLUDED(mu_);

  // The kept balancedness points, oldest first.
  std::vector<BalancednessPoint> Balancedness() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The part of a LoadStats a window needs, flattened.
  struct Snapshot {
    absl::Time time;
    int num_layers = 0;
    int num_experts = 0;
    int num_shards = 0;
    std::vector<int64_t> expert_load;  // [L * E]
    std::vector<int64_t> shard_load;   // [L * S]
  };

  static Snapshot Flatten(absl::Time time, const v1::LoadStats& stats);
  // `later` minus `earlier`, or false when shapes differ or a count went down.
  static bool Difference(const Snapshot& later, const Snapshot& earlier, Snapshot* delta);
  static BalancednessPoint PointFromDelta(const Snapshot& delta);

  const LoadHistoryOptions options_;
  mutable absl::Mutex mu_;
  std::deque<Snapshot> snapshots_ ABSL_GUARDED_BY(mu_);  // oldest first, <= window_samples + 1
  std::deque<BalancednessPoint> points_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_LOAD_HISTORY_H_
