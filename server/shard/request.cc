#include "server/shard/request.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/eplb.h"
#include "kernels/formats.h"
#include "kernels/routing.h"
#include "kernels/staging.h"
#include "server/common/wire.h"

namespace moe {
namespace {

#define MOE_ASSIGN_OR_RETURN_VIEW(lhs, expr)    \
  absl::StatusOr<TensorView> lhs##_or = (expr); \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const TensorView lhs = *lhs##_or

absl::Status Prefix(absl::Status s, absl::string_view prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Hidden states in any accepted form -> staged.hidden: F32 / BF16 payloads as they are, quantized
// ones dequantized into staged.decoded_hidden (F32 [T, H]).
absl::Status StageHidden(const v1::HiddenStates& hs, int64_t hidden,
                         std::optional<absl::string_view> payload, StagedRequest& staged) {
  if (payload.has_value() && !hs.data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty when the payload travels outside the message");
  }
  MOE_ASSIGN_OR_RETURN_VIEW(data, payload.has_value()
                                      ? ViewOf(hs.data(), "hidden_states.data", *payload)
                                      : ViewOf(hs.data(), "hidden_states.data"));
  MOE_ASSIGN_OR_RETURN_VIEW(scales, ViewOf(hs.scales(), "hidden_states.scales"));
  MOE_ASSIGN_OR_RETURN_VIEW(token_scale, ViewOf(hs.token_scale(), "hidden_states.token_scale"));
  if (data.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states.data: expected [T, H], got ", ShapeString(data.shape)));
  }
  const int64_t t = data.dim(0);
  // [T, H] is allocated only after the payload's width matches H: a zero-width payload carries
  // no bytes, so until then nothing bounds T.
  HostTensor& out = staged.decoded_hidden;
  switch (hs.format()) {
    case v1::ACTIVATION_F32:
    case v1::ACTIVATION_BF16: {
      const DType want = hs.format() == v1::ACTIVATION_F32 ? DType::kF32 : DType::kBF16;
      if (absl::Status s = CheckTensor(data, "hidden_states.data", want, {t, hidden}); !s.ok()) {
        return s;
      }
      // In place unless the bytes sit at an address their element type may not be read from (a
      // raw frame's payload can start anywhere): then one aligned copy.
      if (reinterpret_cast<uintptr_t>(data.data) % DTypeSize(want) != 0) {
        out = HostTensor::Uninitialized(want, {t, hidden});
        if (t * hidden > 0) std::memcpy(out.data<std::byte>(), data.data, data.NumBytes());
        staged.hidden = out.view();
      } else {
        staged.hidden = data;
      }
      return absl::OkStatus();
    }
    case v1::ACTIVATION_MXFP8:
      if (data.dim(1) != hidden) {
        return absl::InvalidArgumentError(
            absl::StrCat("hidden_states.data: H = ", data.dim(1), ", model has ", hidden));
      }
      out = HostTensor::Uninitialized(DType::kF32, {t, hidden});
      if (absl::Status s = Prefix(DequantizeMxfp8(data, scales, out.view()), "hidden_states: ");
          !s.ok()) {
        return s;
      }
      staged.hidden = out.view();
      return absl::OkStatus();
    case v1::ACTIVATION_NVFP4:
      if (data.dim(1) * 2 != hidden) {
        return absl::InvalidArgumentError(absl::StrCat("hidden_states.data: NVFP4 payload has ",
                                                       data.dim(1),
                                                       " bytes per token, model H = ", hidden));
      }
      out = HostTensor::Uninitialized(DType::kF32, {t, hidden});
      if (absl::Status s = Prefix(DequantizeNvfp4PerToken(data, scales, token_scale, out.view()),
                                  "hidden_states: ");
          !s.ok()) {
        return s;
      }
      staged.hidden = out.view();
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("hidden_states.format: unknown format ", static_cast<int>(hs.format())));
  }
}

absl::StatusOr<RoutingParams> RoutingFromSpec(const v1::RoutingSpec& spec, int32_t num_experts,
                                              int32_t default_k) {
  absl::StatusOr<RoutingMethod> method =
      ParseRoutingMethod(spec.method().empty() ? "renormalize" : spec.method());
  if (!method.ok()) return Prefix(method.status(), "routing.method: ");
  RoutingParams p;
  p.method = *method;
  p.top_k = spec.top_k() > 0 ? spec.top_k() : default_k;
  // Checked here, not only in Route: the caller sizes [T, top_k] buffers from it first.
  if (p.top_k > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("routing.top_k: ", p.top_k, " outside [1, ", num_experts, "]"));
  }
  p.n_group = spec.n_group() > 0 ? spec.n_group() : 1;
  p.topk_group = spec.topk_group() > 0 ? spec.topk_group() : 1;
  p.routed_scaling_factor = spec.routed_scaling_factor() != 0 ? spec.routed_scaling_factor() : 1.f;
  p.renormalize = spec.renormalize();
  return p;
}

// Top-k ids and weights from the request (modular) or from routing its logits (monolithic), then
// padding and repack into I32 / F32 [T, K].
absl::Status StageTopk(const v1::ForwardRequest& req, const ServedModel& model, int64_t t,
                       StagedRequest& staged, HostTensor& ids, HostTensor& weights) {
  MOE_ASSIGN_OR_RETURN_VIEW(padding, ViewOf(req.is_padding(), "is_padding"));
  TensorView raw_ids, raw_weights;
  if (!IsUnset(req.router_logits())) {
    MOE_ASSIGN_OR_RETURN_VIEW(logits, ViewOf(req.router_logits(), "router_logits"));
    if (absl::Status s = CheckTensor(logits, "router_logits", DType::kF32, {t, model.num_experts});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<RoutingParams> params =
        RoutingFromSpec(req.routing(), model.num_experts, model.top_k);
    if (!params.ok()) return params.status();
    staged.routed_ids = HostTensor(DType::kI32, {t, params->top_k});
    staged.routed_weights = HostTensor(DType::kF32, {t, params->top_k});
    if (absl::Status s =
            Prefix(Route(*params, logits, staged.routed_ids.view(), staged.routed_weights.view()),
                   "routing: ");
        !s.ok()) {
      return s;
    }
    raw_ids = staged.routed_ids.view();
    raw_weights = staged.routed_weights.view();
  } else {
    MOE_ASSIGN_OR_RETURN_VIEW(i, ViewOf(req.topk_ids(), "topk_ids"));
    MOE_ASSIGN_OR_RETURN_VIEW(w, ViewOf(req.topk_weights(), "topk_weights"));
    if (!i.present() || i.rank() != 2 || i.dim(0) != t) {
      return absl::InvalidArgumentError(
          absl::StrCat("topk_ids: expected [", t, ", K], got ", ShapeString(i.shape)));
    }
    raw_ids = i;
    raw_weights = w;
  }
  const int64_t k = raw_ids.dim(1);
  if (k < 1 || k > model.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: K = ", k, " outside [1, ", model.num_experts, "]"));
  }
  ids = HostTensor(DType::kI32, {t, k});
  weights = HostTensor(DType::kF32, {t, k});
  return RepackTopk(raw_ids, raw_weights, padding, model.num_experts, ids.view(), weights.view());
}

}  // namespace

absl::StatusOr<StagedRequest> StageForwardRequest(const v1::ForwardRequest& req,
                                                  const ServedModel& model,
                                                  const ShardPlacement& placement,
                                                  std::optional<absl::string_view> hidden_payload) {
  if (req.layer() >= static_cast<uint32_t>(model.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", req.layer(), " unknown: the model has ", model.num_layers, " MoE layers"));
  }
  StagedRequest staged;
  staged.layer = static_cast<int32_t>(req.layer());
  switch (req.output_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::BF16:
      staged.out_dtype = DType::kBF16;
      break;
    case v1::F32:
      staged.out_dtype = DType::kF32;
      break;
    default:
      return absl::InvalidArgumentError("output_dtype: must be F32 or BF16");
  }
  if (absl::Status s = StageHidden(req.hidden_states(), model.hidden, hidden_payload, staged);
      !s.ok()) {
    return s;
  }
  const int64_t t = staged.hidden.dim(0);
  staged.num_tokens = t;
  HostTensor ids, weights;
  if (absl::Status s = StageTopk(req, model, t, staged, ids, weights); !s.ok()) return s;
  const int64_t k = ids.shape()[1];
  MOE_ASSIGN_OR_RETURN_VIEW(token_indices, ViewOf(req.token_indices(), "token_indices"));
  if (token_indices.present()) {
    if (absl::Status s = CheckTensor(token_indices, "token_indices", DType::kI64, {t}); !s.ok()) {
      return s;
    }
  }
  MOE_ASSIGN_OR_RETURN_VIEW(shared, ViewOf(req.shared_mask(), "shared_mask"));
  if (shared.present()) {
    if (absl::Status s = CheckTensor(shared, "shared_mask", DType::kBool, {t}); !s.ok()) return s;
    staged.shared_mask = HostTensor(DType::kBool, {t});
    for (int64_t i = 0; i < t; ++i) {
      staged.shared_mask.data<bool>()[i] = shared.As<const uint8_t>()[i] != 0;
    }
  }
  staged.physical_ids = HostTensor(DType::kI32, {t, k});
  staged.local_ids = HostTensor(DType::kI32, {t, k});
  if (absl::Status s = MapLogicalToPhysical(placement.layer(staged.layer), ids.view(),
                                            token_indices, staged.physical_ids.view());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = GlobalToLocal(staged.physical_ids.view(), placement.expert_map(),
                                     staged.local_ids.view());
      !s.ok()) {
    return s;
  }
  staged.weights = std::move(weights);
  return staged;
}

}  // namespace moe
