// Expert execution of one MoE layer (numerics.md section 6): for each token's routes to local
// slots, w13 GEMM (+b13) -> gated activation -> w2 GEMM (+b2) -> top-k-weighted sum, fp32
// accumulation, BF16 or F32 output. Shared experts (weight 1) for tokens the sender marks.
//
// ExpertLayer describes the weights a shard hosts for one layer (views into the weight store);
// ExpertsRequest is one staged batch. RunExpertsReference is the scalar CPU oracle every other
// backend is tested against. Thread-safety: the layer is read-only; the call writes only `out`.
#ifndef MOE_KERNELS_EXPERTS_H_
#define MOE_KERNELS_EXPERTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/activation.h"
#include "kernels/formats.h"
#include "kernels/tensor.h"

namespace moe {

// One expert's weights. NVFP4 global scales multiply the GEMM results (gate rows and up rows of
// w13 separately); they must be 1 for other formats. Biases are optional F32 views.
struct ExpertWeights {
  WeightMatrix w13;  // [2I, H]
  WeightMatrix w2;   // [H, I]
  float w13_gate_global_scale = 1.f;
  float w13_up_global_scale = 1.f;
  float w2_global_scale = 1.f;
  TensorView b13;  // optional F32 [2I], same row layout as w13
  TensorView b2;   // optional F32 [H]
};

struct ExpertLayer {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  WeightFormat format = WeightFormat::kBf16;
  GateUpLayout layout = GateUpLayout::kConcatenated;
  ActivationParams activation;
  std::vector<ExpertWeights> experts;  // indexed by local slot
  // Always-on shared experts (may be empty); applied with weight 1 to tokens marked in
  // ExpertsRequest::shared_mask.
  std::vector<ExpertWeights> shared_experts;
};

struct ExpertsRequest {
  TensorView hidden_states;  // F32 or BF16 [T, H] (quantized inputs are dequantized first)
  TensorView local_ids;      // I32 [T, K]: local slot index or -1 (not routed here)
  TensorView topk_weights;   // F32 [T, K]
  TensorView shared_mask;    // optional BOOL [T]: this shard adds the shared-expert output
  TensorView out;            // F32 or BF16 [T, H], fully overwritten
  // hidden_states / out are memory of the CUDA device the backend runs on (ExpertBackend::
  // DeviceForTensors), not host memory: only such a backend accepts them; the rest is host memory.
  bool hidden_on_device = false;
  bool out_on_device = false;
};

// FAILED_PRECONDITION naming `backend` when `request` holds device tensors (hidden_on_device,
// out_on_device): for backends that read and write host memory only.
[[nodiscard]] absl::Status RequireHostTensors(const ExpertsRequest& request,
                                              absl::string_view backend);

// INVALID_ARGUMENT unless every expert's matrices match [2I, H] / [H, I] in `format`, biases
// (when present) are F32 of the right length, global scales are finite (and 1 unless NVFP4) and
// the activation parameters are valid.
[[nodiscard]] absl::Status ValidateExpertLayer(const ExpertLayer& layer);

// INVALID_ARGUMENT for wrong dtypes/shapes, K mismatch between ids and weights, local ids outside
// [-1, experts.size()), NaN/Inf weights.
[[nodiscard]] absl::Status ValidateExpertsRequest(const ExpertLayer& layer,
                                                  const ExpertsRequest& request);

// The CPU reference. Validates the request (not the layer: validate it once at load).
[[nodiscard]] absl::Status RunExpertsReference(const ExpertLayer& layer,
                                               const ExpertsRequest& request);

}  // namespace moe

#endif  // MOE_KERNELS_EXPERTS_H_
