// Gated activations, numerics.md section 6. Everything is computed in fp32 with the standard
// library's float functions, in the order the formulas are written (for SILU and SWIGLUOAI the
// order of vLLM's kernels), so backends differ from this reference by last-bit rounding only.
#include "kernels/activation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

struct NamedKind {
  absl::string_view name;
  ActivationKind kind;
};
constexpr NamedKind kKindNames[] = {
    {"silu", ActivationKind::kSilu},          {"swigluoai", ActivationKind::kSwigluOai},
    {"situ", ActivationKind::kSitu},          {"gelu", ActivationKind::kGelu},
    {"gelu_tanh", ActivationKind::kGeluTanh},
};

float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

float Silu(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// gpt-oss: the gate is clamped from above only, the up projection on both sides, and the "+1"
// on up is part of the model (vLLM swigluoai_and_mul).
float SwigluOai(const ActivationParams& p, float g, float u) {
  g = std::min(g, p.limit);
  u = std::clamp(u, -p.limit, p.limit);
  const float glu = g * Sigmoid(p.alpha * g);
  return (u + 1.f) * glu;
}

float Situ(const ActivationParams& p, float g, float u) {
  const float gate = p.beta * std::tanh(g / p.beta) * Sigmoid(g);
  const float up = p.linear_beta > 0.f ? p.linear_beta * std::tanh(u / p.linear_beta) : u;
  return gate * up;
}

float GeluErf(float g, float u) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  return 0.5f * g * (1.f + std::erf(g * kInvSqrt2)) * u;
}

float GeluTanh(float g, float u) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCubic = 0.044715f;
  const float inner = kSqrt2OverPi * (g + kCubic * g * g * g);
  return 0.5f * g * (1.f + std::tanh(inner)) * u;
}

// One switch per row rather than per element.
template <typename Fn>
void ForEachPair(GateUpLayout layout, const float* h, int64_t inter, float* out, Fn fn) {
  if (layout == GateUpLayout::kInterleaved) {
    for (int64_t j = 0; j < inter; ++j) out[j] = fn(h[2 * j], h[2 * j + 1]);
  } else {
    for (int64_t j = 0; j < inter; ++j) out[j] = fn(h[j], h[inter + j]);
  }
}

}  // namespace

absl::string_view ActivationKindName(ActivationKind k) {
  for (const NamedKind& n : kKindNames) {
    if (n.kind == k) return n.name;
  }
  return "unknown";
}

absl::StatusOr<ActivationKind> ParseActivationKind(absl::string_view name) {
  for (const NamedKind& n : kKindNames) {
    if (n.name == name) return n.kind;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown activation '", name, "' (expected silu, swigluoai, situ, gelu or gelu_tanh)"));
}

absl::Status ValidateActivation(const ActivationParams& p) {
  if (!std::isfinite(p.alpha) || !std::isfinite(p.limit) || !std::isfinite(p.beta) ||
      !std::isfinite(p.linear_beta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation parameters must be finite: alpha=", p.alpha, " limit=", p.limit,
                     " beta=", p.beta, " linear_beta=", p.linear_beta));
  }
  if (p.kind == ActivationKind::kSwigluOai && p.limit <= 0.f) {
    return absl::InvalidArgumentError(absl::StrCat("swigluoai needs limit > 0, got ", p.limit));
  }
  if (p.kind == ActivationKind::kSitu && (p.beta <= 0.f || p.linear_beta < 0.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("situ needs beta > 0 and linear_beta >= 0, got beta=", p.beta,
                     " linear_beta=", p.linear_beta));
  }
  return absl::OkStatus();
}

float ApplyActivation(const ActivationParams& p, float gate, float up) {
  switch (p.kind) {
    case ActivationKind::kSilu:
      return Silu(gate, up);
    case ActivationKind::kSwigluOai:
      return SwigluOai(p, gate, up);
    case ActivationKind::kSitu:
      return Situ(p, gate, up);
    case ActivationKind::kGelu:
      return GeluErf(gate, up);
    case ActivationKind::kGeluTanh:
      return GeluTanh(gate, up);
  }
  return std::nanf("");
}

void ApplyActivationRow(const ActivationParams& p, GateUpLayout layout, const float* h,
                        int64_t inter, float* out) {
  switch (p.kind) {
    case ActivationKind::kSilu:
      return ForEachPair(layout, h, inter, out, Silu);
    case ActivationKind::kSwigluOai:
      return ForEachPair(layout, h, inter, out,
                         [&p](float g, float u) { return SwigluOai(p, g, u); });
    case ActivationKind::kSitu:
      return ForEachPair(layout, h, inter, out, [&p](float g, float u) { return Situ(p, g, u); });
    case ActivationKind::kGelu:
      return ForEachPair(layout, h, inter, out, GeluErf);
    case ActivationKind::kGeluTanh:
      return ForEachPair(layout, h, inter, out, GeluTanh);
  }
}

}  // namespace moe
