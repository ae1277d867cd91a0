// EPLB placement and the pure per-batch helpers, numerics.md sections 4 and 8.
//
// Every entry point validates its views first and writes its output only after validation
// succeeded, so a rejected call leaves the output buffers untouched.
#include "kernels/eplb.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "kernels/formats.h"

namespace moe {
namespace {

// Reads element i of an I32 or I64 id tensor as int64.
int64_t IdAt(const TensorView& ids, int64_t i) {
  return ids.dtype == DType::kI64 ? ids.As<const int64_t>()[i] : ids.As<const int32_t>()[i];
}

float AbsAt(const TensorView& x, int64_t i) {
  return x.dtype == DType::kBF16 ? std::abs(Bf16ToFloat(x.As<const uint16_t>()[i]))
                                 : std::abs(x.As<const float>()[i]);
}

// Max |x[i]| over [begin, end). NaN elements lose every comparison and are thereby ignored.
float RangeAmax(const TensorView& x, int64_t begin, int64_t end, float amax) {
  for (int64_t i = begin; i < end; ++i) amax = std::max(amax, AbsAt(x, i));
  return amax;
}

absl::Status CheckIdMatrix(const TensorView& ids, absl::string_view name) {
  return CheckTensor(ids, name, DType::kI32, {kAnyDim, kAnyDim});
}

// True when the byte ranges of two views overlap (one would be written while reading the other).
bool Overlaps(const TensorView& a, const TensorView& b) {
  if (a.NumBytes() == 0 || b.NumBytes() == 0) return false;
  const auto* a0 = static_cast<const std::byte*>(a.data);
  const auto* b0 = static_cast<const std::byte*>(b.data);
  return a0 < b0 + b.NumBytes() && b0 < a0 + a.NumBytes();
}

absl::Status CheckMapArguments(const TensorView& topk_ids, const TensorView& token_indices,
                               const TensorView& physical_ids) {
  if (absl::Status s =
          CheckTensorOneOf(topk_ids, "topk_ids", {DType::kI32, DType::kI64}, {kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t tokens = topk_ids.dim(0), top_k = topk_ids.dim(1);
  if (absl::Status s = CheckTensor(physical_ids, "physical_ids", DType::kI32, {tokens, top_k});
      !s.ok()) {
    return s;
  }
  if (!token_indices.present()) return absl::OkStatus();
  if (absl::Status s = CheckTensor(token_indices, "token_indices", DType::kI64, {tokens});
      !s.ok()) {
    return s;
  }
  const int64_t* index = token_indices.As<const int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (index[t] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_indices[", t, "] = ", index[t], " is negative"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LayerPlacement> LayerPlacement::Create(absl::Span<const int32_t> physical_to_logical,
                                                      int32_t num_logical) {
  if (num_logical < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_logical ", num_logical, " < 1"));
  }
  if (physical_to_logical.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError("physical_to_logical has more than 2^31 - 1 slots");
  }
  LayerPlacement placement;
  placement.num_logical_ = num_logical;
  placement.replica_count_.assign(num_logical, 0);
  for (size_t p = 0; p < physical_to_logical.size(); ++p) {
    const int32_t e = physical_to_logical[p];
    if (e < -1 || e >= num_logical) {
      return absl::InvalidArgumentError(
          absl::StrCat("physical_to_logical[", p, "] = ", e, " outside [-1, ", num_logical, ")"));
    }
    if (e >= 0) ++placement.replica_count_[e];
  }
  for (int32_t e = 0; e < num_logical; ++e) {
    if (placement.replica_count_[e] == 0) {
      return absl::InvalidArgumentError(absl::StrCat("logical expert ", e, " has no slot"));
    }
  }
  const int32_t max_replicas =
      *std::max_element(placement.replica_count_.begin(), placement.replica_count_.end());
  placement.max_replicas_ = max_replicas;
  placement.physical_to_logical_.assign(physical_to_logical.begin(), physical_to_logical.end());
  placement.logical_to_physical_.assign(static_cast<size_t>(num_logical) * max_replicas, -1);
  // Scanning slots in ascending order fills each row in ascending slot order.
  std::vector<int32_t> filled(num_logical, 0);
  for (int32_t p = 0; p < placement.num_physical(); ++p) {
    const int32_t e = physical_to_logical[p];
    if (e < 0) continue;  // vacant
    placement.logical_to_physical_[static_cast<size_t>(e) * max_replicas + filled[e]++] = p;
  }
  return placement;
}

LayerPlacement LayerPlacement::Identity(int32_t num_logical) {
  CHECK_GE(num_logical, 0) << "identity placement of a negative expert count";
  LayerPlacement placement;
  placement.num_logical_ = num_logical;
  placement.max_replicas_ = num_logical > 0 ? 1 : 0;
  placement.replica_count_.assign(num_logical, 1);
  placement.physical_to_logical_.resize(num_logical);
  for (int32_t e = 0; e < num_logical; ++e) placement.physical_to_logical_[e] = e;
  placement.logical_to_physical_ = placement.physical_to_logical_;
  return placement;
}

int32_t LayerPlacement::MapToPhysical(int32_t logical, uint32_t h) const {
  if (logical < 0 || logical >= num_logical_) return -1;
  const uint32_t replicas = static_cast<uint32_t>(std::max(replica_count_[logical], 1));
  return logical_to_physical_[static_cast<size_t>(logical) * max_replicas_ + h % replicas];
}

absl::Status MapLogicalToPhysical(const LayerPlacement& placement, const TensorView& topk_ids,
                                  const TensorView& token_indices, TensorView physical_ids) {
  if (absl::Status s = CheckMapArguments(topk_ids, token_indices, physical_ids); !s.ok()) {
    return s;
  }
  const int64_t tokens = topk_ids.dim(0), top_k = topk_ids.dim(1);
  const int64_t* index = token_indices.present() ? token_indices.As<const int64_t>() : nullptr;
  int32_t* out = physical_ids.As<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const uint32_t h = ReplicaHash(index != nullptr ? index[t] : t);
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t logical = IdAt(topk_ids, t * top_k + k);
      // Ids beyond int32 are out of range too; MapToPhysical handles the rest.
      const bool fits = logical >= 0 && logical <= std::numeric_limits<int32_t>::max();
      out[t * top_k + k] = fits ? placement.MapToPhysical(static_cast<int32_t>(logical), h) : -1;
    }
  }
  return absl::OkStatus();
}

absl::Status RecordLoad(const TensorView& physical_ids, int64_t num_unpadded,
                        absl::Span<const bool> hosted, absl::Span<int64_t> load) {
  if (absl::Status s = CheckIdMatrix(physical_ids, "physical_ids"); !s.ok()) return s;
  const int64_t tokens = physical_ids.dim(0), top_k = physical_ids.dim(1);
  if (num_unpadded < 0 || num_unpadded > tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_unpadded ", num_unpadded, " outside [0, ", tokens, "]"));
  }
  if (!hosted.empty() && hosted.size() != load.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hosted has ", hosted.size(), " entries, load has ", load.size()));
  }
  const int32_t* ids = physical_ids.As<const int32_t>();
  const int64_t slots = static_cast<int64_t>(load.size());
  for (int64_t i = 0; i < num_unpadded * top_k; ++i) {
    const int32_t p = ids[i];
    if (p < 0 || p >= slots || (!hosted.empty() && !hosted[p])) continue;
    ++load[p];
  }
  return absl::OkStatus();
}

absl::Status GlobalToLocal(const TensorView& physical_ids, absl::Span<const int32_t> expert_map,
                           TensorView local_ids) {
  if (absl::Status s = CheckIdMatrix(physical_ids, "physical_ids"); !s.ok()) return s;
  if (absl::Status s = CheckTensor(local_ids, "local_ids", DType::kI32,
                                   {physical_ids.dim(0), physical_ids.dim(1)});
      !s.ok()) {
    return s;
  }
  if (Overlaps(physical_ids, local_ids)) {
    return absl::InvalidArgumentError("local_ids overlaps physical_ids; the input is read-only");
  }
  for (size_t p = 0; p < expert_map.size(); ++p) {
    if (expert_map[p] < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert_map[", p, "] = ", expert_map[p], " is neither -1 nor an index"));
    }
  }
  const int32_t* in = physical_ids.As<const int32_t>();
  int32_t* out = local_ids.As<int32_t>();
  const int64_t slots = static_cast<int64_t>(expert_map.size());
  for (int64_t i = 0; i < physical_ids.NumElements(); ++i) {
    out[i] = in[i] >= 0 && in[i] < slots ? expert_map[in[i]] : -1;
  }
  return absl::OkStatus();
}

absl::Status CountTokensPerExpert(const TensorView& local_ids, absl::Span<int32_t> counts) {
  if (absl::Status s = CheckIdMatrix(local_ids, "local_ids"); !s.ok()) return s;
  std::fill(counts.begin(), counts.end(), 0);
  const int32_t* ids = local_ids.As<const int32_t>();
  const int64_t experts = static_cast<int64_t>(counts.size());
  for (int64_t i = 0; i < local_ids.NumElements(); ++i) {
    if (ids[i] >= 0 && ids[i] < experts) ++counts[ids[i]];
  }
  return absl::OkStatus();
}

absl::StatusOr<float> MaskedAmax(const TensorView& x, const TensorView& topk_ids) {
  if (absl::Status s = CheckTensorOneOf(x, "x", {DType::kF32, DType::kBF16}, {kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  if (absl::Status s = CheckTensor(topk_ids, "topk_ids", DType::kI32, {tokens, kAnyDim}); !s.ok()) {
    return s;
  }
  const int64_t top_k = topk_ids.dim(1);
  const int32_t* ids = topk_ids.As<const int32_t>();
  float amax = 0.f;
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* row = ids + t * top_k;
    if (std::all_of(row, row + top_k, [](int32_t id) { return id == -1; })) continue;
    amax = RangeAmax(x, t * hidden, (t + 1) * hidden, amax);
  }
  return amax;
}

absl::StatusOr<float> MaskedAmaxBatched(const TensorView& x, absl::Span<const int32_t> counts) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  if (absl::Status s =
          CheckTensorOneOf(x, "x", {DType::kF32, DType::kBF16}, {experts, kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t capacity = x.dim(1), hidden = x.dim(2);
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] < 0 || counts[e] > capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("counts[", e, "] = ", counts[e], " outside [0, capacity = ", capacity, "]"));
    }
  }
  float amax = 0.f;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = e * capacity * hidden;
    amax = RangeAmax(x, begin, begin + counts[e] * hidden, amax);
  }
  return amax;
}

}  // namespace moe
