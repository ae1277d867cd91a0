#include "kernels/cpu/gated_activation.h"

#include "kernels/activation.h"

namespace moe::cpu {

void GatedActivation(const void* ctx, const float* gate, const float* up, int n, float* out) {
  const ActivationParams& params = *static_cast<const ActivationParams*>(ctx);
  for (int i = 0; i < n; ++i) out[i] = ApplyActivation(params, gate[i], up[i]);
}

}  // namespace moe::cpu
