#include "kernels/cuda/expert_plan.h"

#include <algorithm>
#include <utility>

namespace moe::cuda {

int ChooseTokenGroups(int64_t max_count) {
  if (max_count <= 8) return 1;
  if (max_count <= 16) return 2;
  if (max_count <= 32) return 4;
  return 8;
}

RoutePlan PlanRoutes(const int32_t* ids, int64_t tokens, int64_t top_k,
                     const uint8_t* shared_mask, int num_experts, int num_shared) {
  RoutePlan plan;
  plan.tokens = tokens;
  plan.top_k = top_k;
  plan.num_experts = num_experts;
  plan.num_shared = shared_mask != nullptr ? num_shared : 0;
  plan.counts.assign(static_cast<size_t>(num_experts + plan.num_shared), 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (ids[i] >= 0) ++plan.counts[ids[i]];
  }
  if (plan.num_shared > 0) {
    int32_t marked = 0;
    for (int64_t t = 0; t < tokens; ++t) marked += shared_mask[t] != 0 ? 1 : 0;
    for (int s = 0; s < plan.num_shared; ++s) plan.counts[num_experts + s] = marked;
  }
  for (int32_t c : plan.counts) {
    plan.slotted_routes += c;
    plan.max_count = std::max(plan.max_count, c);
    plan.active_slots += c > 0 ? 1 : 0;
  }
  plan.y_rows = tokens * top_k + static_cast<int64_t>(plan.num_shared) * tokens;
  const int groups = ChooseTokenGroups(plan.max_count);
  if (groups == 2) {
    // 8-token items when they add at most 1/8 more items than 16-token ones: the one-group
    // kernel streams faster (H200, problem C at 64 tokens: 115.9 us vs 125.8), and the few slots
    // it splits read their weights twice, mostly from L2 (their items run side by side).
    RoutePlan one = WithTokenGroups(plan, 1);
    const int64_t items2 = WithTokenGroups(plan, 2).num_items;
    if (8 * one.num_items <= 9 * items2) return one;
  }
  return WithTokenGroups(std::move(plan), groups);
}

RoutePlan WithTokenGroups(RoutePlan plan, int token_groups) {
  plan.token_groups = token_groups;
  const int64_t tile = 8 * token_groups;
  plan.num_items = 0;
  for (int32_t c : plan.counts) plan.num_items += (c + tile - 1) / tile;
  return plan;
}

}  // namespace moe::cuda
