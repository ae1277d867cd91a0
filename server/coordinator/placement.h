// Pure placement and load arithmetic of the coordinator: the default rank-major slot layout, the
// initial replica placement of redundant slots, and per-layer load summaries with balancedness.
//
// Called by ClusterState (under its lock) and by tests. Stateless: thread-safe.
#ifndef MOE_SERVER_COORDINATOR_PLACEMENT_H_
#define MOE_SERVER_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

// Rank-major layout: slot p lives on rank p / ceil(P / num_shards). With ceil (rather than the
// floor of numerics.md section 4, which is the same when num_shards divides P) no slot can land on
// a rank >= num_shards; when num_shards does not divide P, the last ranks may host fewer slots,
// possibly none (P = 5, 4 shards: ranks 0 0 1 1 2).
// REQUIRES: num_physical >= 1, num_shards >= 1.
std::vector<uint32_t> RankMajorSlotToRank(int num_physical, int num_shards);

// True when every rank in [0, num_shards) hosts at least one slot of `slot_to_rank`.
bool EveryRankHostsASlot(absl::Span<const uint32_t> slot_to_rank, int num_shards);

// Initial placement of one layer, P = E + R slots: slot p < E holds expert p; redundant slot E + r
// holds expert (r * E / R) mod E, which spreads the R extra replicas evenly over the expert ids
// (R = E/2 replicates every other expert) until load statistics drive a real rebalance.
// REQUIRES: num_logical >= 1, num_redundant >= 0.
std::vector<int32_t> InitialPhysicalToLogical(int num_logical, int num_redundant);

// Mean shard load / max shard load; 1.0 when every shard is idle (nothing to balance) or when
// there are no shards.
double Balancedness(absl::Span<const int64_t> shard_load);

// Summarizes one layer's cumulative slot counts [P]: expert_load[e] sums the replicas of e through
// physical_to_logical, shard_load[r] sums the slots of rank r through slot_to_rank.
// REQUIRES: slot_load, physical_to_logical and slot_to_rank have the same size P; every
// physical_to_logical entry is in [0, num_logical); every slot_to_rank entry is < num_shards.
v1::LayerLoad SummarizeLayerLoad(uint32_t layer, absl::Span<const int64_t> slot_load,
                                 absl::Span<const int32_t> physical_to_logical,
                                 absl::Span<const uint32_t> slot_to_rank, int num_logical,
                                 int num_shards);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_PLACEMENT_H_
