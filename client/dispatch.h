// Dispatch planning: which shard (rank) receives which tokens of a batch, using the same EPLB
// replica choice (LayerPlacement::MapToPhysical with the token's batch index) as the shards, so a
// token whose routes all land on one shard crosses the wire once. Pure: thread-safe.
#ifndef MOE_CLIENT_DISPATCH_H_
#define MOE_CLIENT_DISPATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/eplb.h"
#include "kernels/tensor.h"

namespace moe {

struct DispatchPlan {
  // Ascending token rows sent to each rank (a token appears under every rank hosting one of its
  // routes, and under its shared-expert rank).
  std::vector<std::vector<int64_t>> tokens_by_rank;
  // [T]: the one rank that adds the shared-expert output for each token (-1 when not requested
  // or padded): the rank of the token's first valid route, else `shared_fallback_rank`.
  std::vector<int32_t> shared_rank;
};

// topk_ids I32 [T, K] logical ids; is_padding optional BOOL [T]; slot_to_rank [P].
// REQUIRES: 0 <= shared_fallback_rank < num_ranks.
absl::StatusOr<DispatchPlan> PlanDispatch(const LayerPlacement& placement,
                                          absl::Span<const uint32_t> slot_to_rank, int num_ranks,
                                          const TensorView& topk_ids, const TensorView& is_padding,
                                          bool shared_experts, int shared_fallback_rank = 0);

// The logical experts (ascending, distinct) that `plan` routes to a rank that is not serving
// (serving[rank] false: its shard was removed and the expert had no other replica).
// REQUIRES: `plan` came from PlanDispatch with the same placement, slot_to_rank and ids.
std::vector<int32_t> ExpertsOnLostRanks(const LayerPlacement& placement,
                                        absl::Span<const uint32_t> slot_to_rank,
                                        const std::vector<bool>& serving, const DispatchPlan& plan,
                                        const TensorView& topk_ids);

}  // namespace moe

#endif  // MOE_CLIENT_DISPATCH_H_
