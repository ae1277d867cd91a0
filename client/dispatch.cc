#include "client/dispatch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<DispatchPlan> PlanDispatch(const LayerPlacement& placement,
                                          absl::Span<const uint32_t> slot_to_rank, int num_ranks,
                                          const TensorView& topk_ids, const TensorView& is_padding,
                                          bool shared_experts, int shared_fallback_rank) {
  if (absl::Status s = CheckTensor(topk_ids, "topk_ids", DType::kI32, {kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t t_count = topk_ids.dim(0), k_count = topk_ids.dim(1);
  if (is_padding.present()) {
    if (absl::Status s = CheckTensor(is_padding, "is_padding", DType::kBool, {t_count}); !s.ok()) {
      return s;
    }
  }
  if (static_cast<int32_t>(slot_to_rank.size()) != placement.num_physical()) {
    return absl::InvalidArgumentError(absl::StrCat("slot_to_rank has ", slot_to_rank.size(),
                                                   " entries for ", placement.num_physical(),
                                                   " slots"));
  }
  DispatchPlan plan;
  plan.tokens_by_rank.resize(num_ranks);
  plan.shared_rank.assign(t_count, -1);
  const int32_t* ids = topk_ids.As<const int32_t>();
  for (int64_t t = 0; t < t_count; ++t) {
    if (is_padding.present() && is_padding.As<const uint8_t>()[t] != 0) continue;
    const uint32_t h = ReplicaHash(t);
    int32_t first_rank = -1;
    for (int64_t k = 0; k < k_count; ++k) {
      const int32_t p = placement.MapToPhysical(ids[t * k_count + k], h);
      if (p < 0) continue;
      const uint32_t rank = slot_to_rank[p];
      if (rank >= static_cast<uint32_t>(num_ranks)) {
        return absl::InvalidArgumentError(absl::StrCat("slot ", p, " maps to rank ", rank));
      }
      if (first_rank < 0) first_rank = static_cast<int32_t>(rank);
      std::vector<int64_t>& rows = plan.tokens_by_rank[rank];
      if (rows.empty() || rows.back() != t) rows.push_back(t);
    }
    if (shared_experts && num_ranks > 0) {
      const int32_t r = first_rank >= 0 ? first_rank : shared_fallback_rank;
      plan.shared_rank[t] = r;
      std::vector<int64_t>& rows = plan.tokens_by_rank[r];
      if (rows.empty() || rows.back() != t) rows.push_back(t);
    }
  }
  return plan;
}

std::vector<int32_t> ExpertsOnLostRanks(const LayerPlacement& placement,
                                        absl::Span<const uint32_t> slot_to_rank,
                                        const std::vector<bool>& serving, const DispatchPlan& plan,
                                        const TensorView& topk_ids) {
  std::vector<int32_t> lost;
  const int64_t k_count = topk_ids.dim(1);
  const int32_t* ids = topk_ids.As<const int32_t>();
  for (size_t rank = 0; rank < plan.tokens_by_rank.size(); ++rank) {
    if (rank < serving.size() && serving[rank]) continue;
    for (int64_t t : plan.tokens_by_rank[rank]) {
      const uint32_t h = ReplicaHash(t);
      for (int64_t k = 0; k < k_count; ++k) {
        const int32_t p = placement.MapToPhysical(ids[t * k_count + k], h);
        if (p >= 0 && slot_to_rank[p] == rank) lost.push_back(ids[t * k_count + k]);
      }
    }
  }
  std::sort(lost.begin(), lost.end());
  lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
  return lost;
}

}  // namespace moe
