// The coordinator's state: shard registry (ranks, heartbeats, liveness, readiness), the cluster
// map (model shape, rank-major slot layout, per-layer placement, version) and cumulative expert
// load merged from the shards' LoadDeltas.
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
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

struct ClusterOptions {
  // Shards the first map waits for; also the number of ranks.
  int num_shards = 1;
  // Redundant physical slots per layer (P = E + redundant_slots).
  int redundant_slots = 0;
  // The interval shards are told to heartbeat at.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // A shard silent for this many intervals is reported not alive.
  int missed_heartbeats_until_dead = 3;
  // Time source; tests substitute a fake clock.
  std::function<absl::Time()> now = [] { return absl::Now(); };
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

  // Cumulative load per layer (empty before the model is known) and per shard.
  v1::LoadStats GetLoadStats() const;

  // Registered shards whose heartbeats are current.
  std::vector<ShardTarget> AliveShards() const;

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
  v1::ClusterMap BuildMapLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void MapChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClusterOptions options_;

  mutable absl::Mutex mu_;
  mutable absl::CondVar map_changed_;
  // Set by the first registration; the slot layout and placement below are sized from it.
  std::optional<v1::ModelShape> model_ ABSL_GUARDED_BY(mu_);
  int num_physical_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint32_t> slot_to_rank_ ABSL_GUARDED_BY(mu_);        // [P]
  std::vector<int32_t> physical_to_logical_ ABSL_GUARDED_BY(mu_);  // [L * P], layer-major
  std::vector<int64_t> slot_load_ ABSL_GUARDED_BY(mu_);            // [L * P], cumulative
  // Indexed by rank; nullopt for a rank nobody holds.
  std::vector<std::optional<ShardRecord>> shards_ ABSL_GUARDED_BY(mu_);
  uint64_t next_shard_serial_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until the first map is published
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_CLUSTER_STATE_H_
