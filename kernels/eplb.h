// EPLB placement of one MoE layer and the pure functions that use it (numerics.md section 4 and
// the helpers of section 8): logical -> physical replica choice, load recording, local-slot
// filtering, token counts per local expert and the masked per-tensor amax.
//
// Called by the client (dispatch plan), by the shard's staging and by tests; the client and the
// server run the same MapToPhysical so a shared map version yields the same placement.
// Thread-safety: LayerPlacement is immutable after construction; functions are pure except for
// the output buffers they are given.
#ifndef MOE_KERNELS_EPLB_H_
#define MOE_KERNELS_EPLB_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"

namespace moe {

// Placement of one layer: which physical slot holds which logical expert.
class LayerPlacement {
 public:
  // physical_to_logical [P]: every entry in [-1, num_logical), every logical expert present at
  // least once. -1 marks a vacant slot (its shard was removed from the cluster): it holds no
  // expert and no route maps to it. INVALID_ARGUMENT otherwise.
  static absl::StatusOr<LayerPlacement> Create(absl::Span<const int32_t> physical_to_logical,
                                               int32_t num_logical);
  // The identity placement: P = E, slot e holds expert e.
  static LayerPlacement Identity(int32_t num_logical);

  int32_t num_logical() const { return num_logical_; }
  int32_t num_physical() const { return static_cast<int32_t>(physical_to_logical_.size()); }
  int32_t max_replicas() const { return max_replicas_; }
  // [E, max_replicas], row e = the slots of expert e in ascending order, -1 padded.
  const std::vector<int32_t>& logical_to_physical() const { return logical_to_physical_; }
  const std::vector<int32_t>& replica_count() const { return replica_count_; }
  const std::vector<int32_t>& physical_to_logical() const { return physical_to_logical_; }

  // The replica of `logical` for a token with hash `h`; -1 for ids outside [0, E).
  int32_t MapToPhysical(int32_t logical, uint32_t h) const;

 private:
  int32_t num_logical_ = 0;
  int32_t max_replicas_ = 0;
  std::vector<int32_t> logical_to_physical_;
  std::vector<int32_t> replica_count_;
  std::vector<int32_t> physical_to_logical_;
};

// h = (token_index * 2654435769) mod 2^32.
inline uint32_t ReplicaHash(int64_t token_index) {
  return static_cast<uint32_t>(static_cast<uint64_t>(token_index) * 2654435769ull);
}

// topk_ids I32 or I64 [T, K] (logical ids; -1 = no route) -> physical_ids I32 [T, K].
// token_indices: optional I64 [T], the tokens' indices in the sender's batch (absent: row index).
// Ids of -1 or outside [0, E) map to -1.
[[nodiscard]] absl::Status MapLogicalToPhysical(const LayerPlacement& placement,
                                                const TensorView& topk_ids,
                                                const TensorView& token_indices,
                                                TensorView physical_ids);

// Adds 1 to load[p] for every (t, k) with t < num_unpadded, 0 <= p < load.size() and, when
// `hosted` is non-empty, hosted[p]. physical_ids: I32 [T, K]. num_unpadded in [0, T].
[[nodiscard]] absl::Status RecordLoad(const TensorView& physical_ids, int64_t num_unpadded,
                                      absl::Span<const bool> hosted, absl::Span<int64_t> load);

// physical_ids I32 [T, K] -> local_ids I32 [T, K]: expert_map[p] (a local index or -1); -1 and
// out-of-range ids become -1. The input is never modified.
[[nodiscard]] absl::Status GlobalToLocal(const TensorView& physical_ids,
                                         absl::Span<const int32_t> expert_map,
                                         TensorView local_ids);

// counts[j] = number of (t, k) with local_ids[t, k] == j; -1 and ids >= counts.size() are skipped.
[[nodiscard]] absl::Status CountTokensPerExpert(const TensorView& local_ids,
                                                absl::Span<int32_t> counts);

// max |x[t, h]| over rows t that have at least one id != -1 (x F32 or BF16 [T, H],
// topk_ids I32 [T, K]); 0 when no row qualifies.
[[nodiscard]] absl::StatusOr<float> MaskedAmax(const TensorView& x, const TensorView& topk_ids);
// Batched-buffer form: x [E_local, capacity, H]; rows r >= counts[e] of expert e are skipped.
[[nodiscard]] absl::StatusOr<float> MaskedAmaxBatched(const TensorView& x,
                                                      absl::Span<const int32_t> counts);

}  // namespace moe

#endif  // MOE_KERNELS_EPLB_H_
