// The coordinator's state: shard registry (ranks, heartbeats, liveness, readiness, health), the
// cluster map (model shape, slot layout, per-layer placement, version), expert load merged from
// the shards' LoadDeltas (cumulative and windowed, LoadBook), and placement changes: EPLB
// rebalancing, shard drains and shard failures.
//
// Placement changes (cluster_state_switch.cc) follow DESIGN.md section 5. A rebalance or a drain
// prepares the next version as `pending` in the published map; shards load its slots while serving
// the current one and report it in their heartbeats; once every serving shard that hosts a slot of
// it is ready, it becomes the map (commit). Shards keep accepting older versions until
// `switch_drain` after the commit (min_accepted_version). A shard that misses its heartbeats
// (Tick) or fails a health check (ReportUnhealthy) is removed at once: a new version is committed
// immediately in which its slots are vacant where another replica serves the expert, and a pending
// version moves its slots to the survivors (restoring every expert and the capacity).
//
// Called by CoordinatorService for every RPC and by tests directly (no gRPC inside; the clock is
// injectable). Request contents are validated here, once, and errors come back as absl::Status
// with the codes of DESIGN.md section 8.
// Thread-safety: every method is thread-safe; all state sits under one absl::Mutex, and
// AwaitMapChange blocks on a CondVar that every map-visible change signals.
// Ownership: owns its state; returns copies (protos), never references into it.
#ifndef MOE_SERVER_COORDINATOR_CLUSTER_STATE_H_
#define MOE_SERVER_COORDINATOR_CLUSTER_STATE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/v1/coordinator.pb.h"
#include "server/coordinator/journal.h"
#include "server/coordinator/load_book.h"

namespace moe {

struct ClusterOptions {
  // Shards the first map waits for; also the number of ranks.
  int num_shards = 1;
  // Redundant physical slots per layer (P = E + redundant_slots).
  int redundant_slots = 0;
  // The interval shards are told to heartbeat at.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // A shard silent for this many intervals is reported not alive, and removed by Tick.
  int missed_heartbeats_until_dead = 3;
  // Load window (what rebalancing plans with) and balancedness samples kept.
  absl::Duration load_window = absl::Seconds(60);
  int balancedness_history = 720;
  // After a commit, older map versions stay accepted this long (in-flight calls drain).
  absl::Duration switch_drain = absl::Seconds(2);
  // A pending version whose shards are not all ready by then is abandoned.
  absl::Duration switch_timeout = absl::Seconds(60);
  // After a removal, move the removed shard's slots to the survivors at once (they load its
  // experts). Off, its experts without another replica stay unavailable until a rebalance (or a
  // drain) moves them, e.g. while waiting for a replacement shard when survivors lack memory.
  bool restore_after_failure = true;
  // Hierarchical EPLB: nodes (ranks are node-major) and expert groups; 1 and 1 is the global
  // policy.
  int eplb_nodes = 1;
  int eplb_groups = 1;
  // Time source; tests substitute a fake clock.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Durable state (not owned; must outlive the ClusterState); null keeps state in memory only.
  // Committed/pending map versions and registrations are appended as they happen, load totals
  // every `load_snapshot_ticks` Tick() calls.
  Journal* journal = nullptr;
  int load_snapshot_ticks = 10;
};

// A shard the coordinator can pull load from (see GetLoadStats with refresh).
struct ShardTarget {
  std::string shard_id;
  std::string address;
  uint32_t rank = 0;
};

// The published map together with the change counter it was read at (see AwaitMapChange).
struct MapUpdate {
  v1::ClusterMap map;
  uint64_t generation = 0;
};

class ClusterState {
 public:
  // REQUIRES: options.num_shards >= 1, options.redundant_slots >= 0,
  // options.heartbeat_interval > 0, options.missed_heartbeats_until_dead >= 1.
  explicit ClusterState(ClusterOptions options);

  // Resumes from a replayed journal (cluster_state_journal.cc): the committed map version
  // (new versions continue above it and any pending one), the known shards (each keeps its rank
  // for its address but must re-register: their old shard ids get NOT_FOUND) and the load
  // totals. REQUIRES: called before any registration.
  absl::Status Restore(const JournalState& state);

  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  // Assigns a rank: the rank this address held before, else requested_rank when it is free and
  // < num_shards, else the lowest free rank (RESOURCE_EXHAUSTED when none is free). The first
  // registration fixes the model shape; a later different shape or fingerprint is
  // FAILED_PRECONDITION. Every registration issues a fresh shard_id, so heartbeats from an earlier
  // incarnation of the same address get NOT_FOUND.
  absl::StatusOr<v1::RegisterShardResponse> RegisterShard(const v1::RegisterShardRequest& request);

  // Records liveness and readiness (ready_map_version), then merges the load delta if present.
  // NOT_FOUND for an unknown shard_id (the shard must re-register); INVALID_ARGUMENT for a
  // malformed delta (liveness and readiness are recorded regardless).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);

  // Merges a delta collected from `shard_id` (same rules as a heartbeat's delta): counts must have
  // the model's [num_layers, P] dimensions and be non-negative (INVALID_ARGUMENT otherwise);
  // counts for slots the shard does not host are dropped (logged once per shard).
  absl::Status MergeLoadDelta(const std::string& shard_id, const v1::LoadDelta& delta);

  // The current map; UNAVAILABLE "waiting for N more shards" before publication.
  absl::StatusOr<v1::ClusterMap> GetClusterMap() const;

  // Counter bumped by every change a map reader can see (publication, readiness, shard entries).
  uint64_t generation() const;

  // Blocks until the map is published and either its version > known_version or
  // generation() > known_generation; returns it. nullopt when `deadline` passes first;
  // UNAVAILABLE once Shutdown was called.
  absl::StatusOr<std::optional<MapUpdate>> AwaitMapChange(uint64_t known_version,
                                                          uint64_t known_generation,
                                                          absl::Time deadline) const;

  // Load per layer (empty before the model is known): cumulative and over the last `window`
  // (0: the configured load window), balancedness history, per shard totals.
  v1::LoadStats GetLoadStats() const { return GetLoadStats(absl::ZeroDuration()); }
  v1::LoadStats GetLoadStats(absl::Duration window) const;

  // Registered shards whose heartbeats are current.
  std::vector<ShardTarget> AliveShards() const;

  // ---- Placement changes (cluster_state_switch.cc) ----

  // Plans an EPLB placement from the load window (eplb_planner.h) over the serving shards; unless
  // dry_run, makes it the pending version when any layer changes. UNAVAILABLE before the map is
  // published; FAILED_PRECONDITION while another switch is pending or when no shard can take
  // slots; ABORTED when the map changed while planning.
  absl::StatusOr<v1::RebalancePlan> Rebalance(const v1::RebalanceRequest& request);

  // Marks the shard DRAINING and makes pending a version that moves its slots to the other active
  // shards; once that is committed and older versions have drained (Tick), the shard becomes
  // DRAINED. NOT_FOUND for an unknown id; FAILED_PRECONDITION when it is not active, is the last
  // active shard, or another switch is pending.
  absl::StatusOr<v1::DrainResponse> Drain(const v1::DrainRequest& request);

  // Removes a serving shard at once (see the header comment); `why` goes to the log. NOT_FOUND
  // for an unknown id; a shard already removed is left alone.
  absl::Status ReportUnhealthy(const std::string& shard_id, const std::string& why);

  // Periodic upkeep (the coordinator calls it a few times per heartbeat interval): removes shards
  // that missed their heartbeats, abandons a pending version past switch_timeout, commits one
  // whose shards are ready, ends the drain period, samples balancedness.
  void Tick();

  // Shards to health-check: serving, heartbeating, and past their first weight load.
  std::vector<ShardTarget> ProbeTargets() const;

  // Blocks until map version >= `version` is committed (true), the version can no longer commit
  // (it is not pending and the map is older: false), `deadline` passes (false) or Shutdown
  // (UNAVAILABLE).
  absl::StatusOr<bool> AwaitCommit(uint64_t version, absl::Time deadline) const;

  // The pending version, 0 when none.
  uint64_t pending_version() const;

  // Wakes every AwaitMapChange caller, which then returns UNAVAILABLE, as do later calls.
  void Shutdown();

 private:
  struct ShardRecord {
    std::string shard_id;
    std::string address;
    std::string device;
    std::string backend;
    absl::Time last_seen;
    uint64_t ready_map_version = 0;
    uint64_t requests = 0;
    uint64_t tokens = 0;
    uint64_t batches = 0;
    uint64_t merged_batches = 0;
    bool warned_foreign_slots = false;
    v1::ShardState state = v1::SHARD_ACTIVE;
  };

  // The next map version while a placement switch is under way.
  struct PendingSwitch {
    uint64_t version = 0;
    std::string reason;
    absl::Time started;
  };

  absl::Status FixModelLocked(const v1::ModelShape& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int> ChooseRankLocked(const v1::RegisterShardRequest& request) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int FindShardLocked(const std::string& shard_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int RegisteredCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsAliveLocked(const ShardRecord& shard, absl::Time now) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsReadyLocked(const ShardRecord& shard) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status MergeLoadDeltaLocked(int rank, const v1::LoadDelta& delta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckDeltaLocked(const v1::LoadDelta& delta) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool AddCountsLocked(int rank, const v1::LoadDelta& delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ClusterMap BuildMapLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FillPlacementLocked(uint64_t version, v1::ClusterMap* map) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void MapChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // cluster_state_journal.cc: no-ops without options_.journal; failures are logged.
  void JournalMapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JournalShardLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JournalLoadLocked(bool force) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // cluster_state_switch.cc
  static bool Serving(const ShardRecord& shard);
  bool HostsSlotLocked(int rank, uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::vector<bool> RanksLocked(bool active_only) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t NewVersionLocked(VersionPlacement placement) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartSwitchLocked(VersionPlacement placement, std::string reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeCommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveShardLocked(int rank, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartRestorationLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishDrainLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const VersionPlacement& CommittedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return placements_.at(version_);
  }

  const ClusterOptions options_;

  mutable absl::Mutex mu_;
  mutable absl::CondVar map_changed_;
  // Set by the first registration; the slot layout and placement below are sized from it.
  std::optional<v1::ModelShape> model_ ABSL_GUARDED_BY(mu_);
  int num_physical_ ABSL_GUARDED_BY(mu_) = 0;
  // Placement of every version a load delta may still name: the committed one (version_), the
  // pending one, and recent older ones. The first registration creates the initial layout.
  std::map<uint64_t, VersionPlacement> placements_ ABSL_GUARDED_BY(mu_);
  // The latest committed placement without vacant slots: what a restoration or drain keeps.
  std::vector<int32_t> intended_ ABSL_GUARDED_BY(mu_);
  std::optional<PendingSwitch> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;  // newest version handed out
  uint64_t min_accepted_version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time committed_at_ ABSL_GUARDED_BY(mu_);
  std::optional<LoadBook> book_ ABSL_GUARDED_BY(mu_);
  // Indexed by rank; nullopt for a rank nobody holds.
  std::vector<std::optional<ShardRecord>> shards_ ABSL_GUARDED_BY(mu_);
  uint64_t next_shard_serial_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until the first map is published
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // What the journal holds last: committed and pending versions; Tick()s since a load snapshot.
  uint64_t journaled_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t journaled_pending_ ABSL_GUARDED_BY(mu_) = 0;
  int ticks_since_snapshot_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_CLUSTER_STATE_H_
