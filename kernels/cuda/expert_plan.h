// Host-side plan of one CUDA expert batch: tokens per expert slot (from the host copy of the
// routes), the token tile of the GEMMs and the number of work items. The prologue kernel derives
// the same items on the device; the host needs the counts to size scratch and grids.
//
// Called by expert_runner.cc and the kernel benchmark. Pure: thread-safe.
#ifndef MOE_KERNELS_CUDA_EXPERT_PLAN_H_
#define MOE_KERNELS_CUDA_EXPERT_PLAN_H_

#include <cstdint>
#include <vector>

namespace moe::cuda {

struct RoutePlan {
  int64_t tokens = 0;
  int64_t top_k = 0;
  int num_experts = 0;           // routed slots
  int num_shared = 0;            // shared-expert slots that run (0 without a mask)
  std::vector<int32_t> counts;   // tokens per slot, num_experts + num_shared entries
  int64_t slotted_routes = 0;    // sum of counts: rows of the grouped activations
  int64_t y_rows = 0;            // T*K + num_shared*T: rows of the per-route GEMM2 output
  int32_t max_count = 0;
  int active_slots = 0;          // slots with at least one token
  int token_groups = 1;          // groups of 8 tokens per GEMM item
  int64_t num_items = 0;         // sum over slots of ceil(count / (8 * token_groups))
};

// 1, 2, 4 or 8 groups of 8 tokens: the smallest tile that holds the busiest slot, at most 64.
int ChooseTokenGroups(int64_t max_count);

// ids: [tokens, top_k] local slots or -1 (validated by the caller); shared_mask: [tokens] or
// null. Shared slots count only when the mask is given and num_shared > 0. The token tile is
// ChooseTokenGroups(max_count), except that 1 replaces 2 when 8-token items are at most 1/8 more
// items than 16-token ones.
RoutePlan PlanRoutes(const int32_t* ids, int64_t tokens, int64_t top_k,
                     const uint8_t* shared_mask, int num_experts, int num_shared);

// The same plan with another token tile (1, 2, 4 or 8 groups; benchmarks): items recounted.
RoutePlan WithTokenGroups(RoutePlan plan, int token_groups);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_EXPERT_PLAN_H_
