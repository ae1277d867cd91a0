// Routing from router logits to top-k expert ids and weights (numerics.md section 7): Default,
// Renormalize(Naive), DeepSeekV3 grouped top-k, Sigmoid, SigmoidRenorm. Ties go to the lower id.
//
// Called by the client library (frontends route before dispatch), by the monolithic shard path and
// by tests. Pure: thread-safe.
#ifndef MOE_KERNELS_ROUTING_H_
#define MOE_KERNELS_ROUTING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"

namespace moe {

enum class RoutingMethod : uint8_t {
  kDefault,           // softmax, top-k, weights not renormalized
  kRenormalize,       // top-k, weights renormalized to sum 1
  kRenormalizeNaive,  // same result as kRenormalize
  kDeepSeekV3,        // sigmoid, grouped top-k with correction bias, scaling factor
  kSigmoid,           // sigmoid scores, top-k
  kSigmoidRenorm,     // sigmoid scores, top-k, renormalized
};
absl::string_view RoutingMethodName(RoutingMethod m);
absl::StatusOr<RoutingMethod> ParseRoutingMethod(absl::string_view name);

struct RoutingParams {
  RoutingMethod method = RoutingMethod::kRenormalize;
  int32_t top_k = 1;
  // DeepSeekV3 only.
  int32_t n_group = 1;
  int32_t topk_group = 1;
  float routed_scaling_factor = 1.f;
  bool renormalize = true;
  TensorView correction_bias;  // optional F32 [E], added to the scores for selection only
  // All methods: optional F32 [E] added to the logits before anything else.
  TensorView router_bias;
};

// logits F32 [T, E] -> topk_ids I32 [T, K], topk_weights F32 [T, K].
// INVALID_ARGUMENT for wrong dtypes/shapes, K outside [1, E], non-finite logits or biases,
// DeepSeekV3 group counts that do not divide E or select fewer than K experts.
[[nodiscard]] absl::Status Route(const RoutingParams& params, const TensorView& logits,
                                 TensorView topk_ids, TensorView topk_weights);

}  // namespace moe

#endif  // MOE_KERNELS_ROUTING_H_
