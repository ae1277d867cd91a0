// Pure placement arithmetic of the coordinator: the default rank-major slot layout, the initial
// replica placement of redundant slots, balancedness, and the placements of a shard's removal
// (vacated slots) and of moving slots off removed or draining shards.
//
// Called by ClusterState (under its lock) and by tests. Stateless: thread-safe.
#ifndef MOE_SERVER_COORDINATOR_PLACEMENT_H_
#define MOE_SERVER_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

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

// The placement right after shard `rank` is removed (it failed): in every layer, a slot of `rank`
// whose expert still has a slot on a serving rank (serving[r], `rank` excluded) becomes vacant
// (-1); a slot whose expert has no other serving replica keeps it, so the map still names the
// expert (clients fail calls touching it fast until a survivor has loaded it).
// physical_to_logical: [L * P] layer-major. REQUIRES: slot_to_rank.size() == P divides the
// placement's size; serving.size() > every slot_to_rank entry.
std::vector<int32_t> VacateRank(absl::Span<const int32_t> physical_to_logical,
                                absl::Span<const uint32_t> slot_to_rank, uint32_t rank,
                                const std::vector<bool>& serving);

// A slot layout over the `eligible` ranks: every slot of a non-eligible rank moves to an eligible
// one, then slots move from the fullest eligible rank to the emptiest until their counts differ
// by at most one. Each move takes the highest slot of the giving rank (or of the ineligible rank)
// and goes to the rank with the fewest slots (ties: lower rank). Slots that need not move stay.
// REQUIRES: at least one eligible rank; every slot_to_rank entry < eligible.size().
std::vector<uint32_t> BalanceSlotLayout(absl::Span<const uint32_t> slot_to_rank,
                                        const std::vector<bool>& eligible);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_PLACEMENT_H_
