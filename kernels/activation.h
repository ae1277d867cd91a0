// Gated activations of the expert MLP (numerics.md section 6): act(gate, up) for SILU, SWIGLUOAI,
// SITU, GELU and GELU-tanh, with interleaved or concatenated gate/up rows.
//
// Called by every expert backend's reference path and by tests. Pure: thread-safe.
#ifndef MOE_KERNELS_ACTIVATION_H_
#define MOE_KERNELS_ACTIVATION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

enum class ActivationKind : uint8_t { kSilu, kSwigluOai, kSitu, kGelu, kGeluTanh };
absl::string_view ActivationKindName(ActivationKind k);
absl::StatusOr<ActivationKind> ParseActivationKind(absl::string_view name);  // "silu", ...

// Layout of gate and up rows inside w13 [2I, H] (and b13 [2I]).
enum class GateUpLayout : uint8_t {
  kInterleaved,   // row 2j = gate j, row 2j+1 = up j (gpt-oss)
  kConcatenated,  // rows [0, I) gate, [I, 2I) up (DeepSeek, Qwen, ModelOpt)
};

struct ActivationParams {
  ActivationKind kind = ActivationKind::kSilu;
  float alpha = 1.702f;     // SWIGLUOAI
  float limit = 7.0f;       // SWIGLUOAI (config swiglu_limit)
  float beta = 1.0f;        // SITU, > 0
  float linear_beta = 0.f;  // SITU: > 0 applies linear_beta * tanh(u / linear_beta), else u
};

// INVALID_ARGUMENT for non-finite parameters, limit <= 0 (SWIGLUOAI), beta <= 0 or
// linear_beta < 0 (SITU).
[[nodiscard]] absl::Status ValidateActivation(const ActivationParams& p);

// act(g, u) in fp32.
float ApplyActivation(const ActivationParams& p, float gate, float up);

// h: [2I] in `layout`; out: [I].
void ApplyActivationRow(const ActivationParams& p, GateUpLayout layout, const float* h,
                        int64_t inter, float* out);

// Row index inside w13/b13 of gate j and up j.
inline int64_t GateRow(GateUpLayout layout, int64_t j, int64_t /*inter*/) {
  return layout == GateUpLayout::kInterleaved ? 2 * j : j;
}
inline int64_t UpRow(GateUpLayout layout, int64_t j, int64_t inter) {
  return layout == GateUpLayout::kInterleaved ? 2 * j + 1 : inter + j;
}

}  // namespace moe

#endif  // MOE_KERNELS_ACTIVATION_H_
