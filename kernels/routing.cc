// Routing, numerics.md section 7.
//
// Conventions this file fixes (the spec leaves them open):
//  - Output order: the K ids of a token are written in descending selection score (softmax
//    probability, sigmoid score, or for DeepSeekV3 the bias-corrected score), ties lower id first.
//  - Renormalize and RenormalizeNaive run the same code (softmax over all E, top-k, divide by the
//    sum of the K chosen probabilities), so their results are bit-identical.
//  - A renormalization whose K scores sum to 0 (every chosen sigmoid underflowed) gives 1/K each.
//  - DeepSeekV3 groups of a single expert score that expert alone (there is no second one).
//  - correction_bias is read by DeepSeekV3 only; other methods ignore it.
//  - routed_scaling_factor must be finite and > 0 for DeepSeekV3.
#include "kernels/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

struct NamedMethod {
  absl::string_view name;
  RoutingMethod method;
};
constexpr NamedMethod kMethodNames[] = {
    {"default", RoutingMethod::kDefault},
    {"renormalize", RoutingMethod::kRenormalize},
    {"renormalize_naive", RoutingMethod::kRenormalizeNaive},
    {"deepseek_v3", RoutingMethod::kDeepSeekV3},
    {"sigmoid", RoutingMethod::kSigmoid},
    {"sigmoid_renorm", RoutingMethod::kSigmoidRenorm},
};

absl::Status CheckBias(const TensorView& bias, absl::string_view name, int64_t num_experts) {
  if (!bias.present()) return absl::OkStatus();
  if (absl::Status s = CheckTensor(bias, name, DType::kF32, {num_experts}); !s.ok()) return s;
  const float* b = bias.As<const float>();
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!std::isfinite(b[e])) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", e, "] is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGroups(const RoutingParams& p, int64_t num_experts) {
  if (p.n_group < 1 || num_experts % p.n_group != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("deepseek_v3: n_group ", p.n_group, " does not divide E = ", num_experts));
  }
  const int64_t group_size = num_experts / p.n_group;
  if (p.topk_group < 1 || p.topk_group > p.n_group || p.topk_group * group_size < p.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("deepseek_v3: topk_group ", p.topk_group, " of ",
                                                   p.n_group, " groups of ", group_size,
                                                   " experts cannot supply top_k = ", p.top_k));
  }
  if (!std::isfinite(p.routed_scaling_factor) || p.routed_scaling_factor <= 0.f) {
    return absl::InvalidArgumentError(
        absl::StrCat("deepseek_v3: routed_scaling_factor must be finite and > 0, got ",
                     p.routed_scaling_factor));
  }
  return CheckBias(p.correction_bias, "correction_bias", num_experts);
}

// Logits plus router bias must stay finite: an overflow to inf would turn softmax into NaN.
absl::Status CheckLogitValues(const TensorView& logits, const TensorView& router_bias) {
  const int64_t tokens = logits.dim(0), experts = logits.dim(1);
  const float* z = logits.As<const float>();
  const float* bias = router_bias.present() ? router_bias.As<const float>() : nullptr;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      const float v = z[t * experts + e] + (bias != nullptr ? bias[e] : 0.f);
      if (!std::isfinite(v)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "logits[", t, ", ", e, "]", bias != nullptr ? " + router_bias" : "", " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRoute(const RoutingParams& p, const TensorView& logits,
                           const TensorView& topk_ids, const TensorView& topk_weights) {
  if (absl::Status s = CheckTensor(logits, "logits", DType::kF32, {kAnyDim, kAnyDim}); !s.ok()) {
    return s;
  }
  const int64_t tokens = logits.dim(0), experts = logits.dim(1);
  if (p.top_k < 1 || p.top_k > experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k ", p.top_k, " outside [1, E = ", experts, "]"));
  }
  if (absl::Status s = CheckTensor(topk_ids, "topk_ids", DType::kI32, {tokens, p.top_k}); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckTensor(topk_weights, "topk_weights", DType::kF32, {tokens, p.top_k});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckBias(p.router_bias, "router_bias", experts); !s.ok()) return s;
  if (p.method == RoutingMethod::kDeepSeekV3) {
    if (absl::Status s = CheckGroups(p, experts); !s.ok()) return s;
  }
  return CheckLogitValues(logits, p.router_bias);
}

// Scratch buffers of one token, reused across tokens.
struct Scratch {
  std::vector<float> score;   // softmax probabilities or sigmoid scores
  std::vector<float> select;  // DeepSeekV3: score + correction bias
  std::vector<float> group_score;
  std::vector<int32_t> groups;  // DeepSeekV3: group indices to rank
  std::vector<int32_t> order;   // candidate expert ids to rank
};

// The strict total order every selection uses: higher value first, ties to the lower index.
struct HigherThenLowerIndex {
  const float* value;
  bool operator()(int32_t a, int32_t b) const {
    return value[a] > value[b] || (value[a] == value[b] && a < b);
  }
};

// Moves the k best of `candidates` under HigherThenLowerIndex to its front, in that order.
void RankFront(const float* value, int32_t k, std::vector<int32_t>& candidates) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                    HigherThenLowerIndex{value});
}

void Softmax(const float* z, int64_t n, float* p) {
  const float max_z = *std::max_element(z, z + n);
  float sum = 0.f;
  for (int64_t e = 0; e < n; ++e) {
    p[e] = std::exp(z[e] - max_z);
    sum += p[e];
  }
  for (int64_t e = 0; e < n; ++e) p[e] /= sum;
}

void Sigmoid(const float* z, int64_t n, float* s) {
  for (int64_t e = 0; e < n; ++e) s[e] = 1.f / (1.f + std::exp(-z[e]));
}

void Renormalize(int32_t k, float* w) {
  float sum = 0.f;
  for (int32_t i = 0; i < k; ++i) sum += w[i];
  for (int32_t i = 0; i < k; ++i) w[i] = sum > 0.f ? w[i] / sum : 1.f / static_cast<float>(k);
}

// DeepSeekV3 group stage: fills scratch.order with the experts of the topk_group best groups,
// a group's score being the sum of its two largest `select` values.
void GroupCandidates(const RoutingParams& p, int64_t num_experts, Scratch& scratch) {
  const int32_t group_size = static_cast<int32_t>(num_experts / p.n_group);
  const int32_t pick = std::min(group_size, 2);
  scratch.group_score.resize(p.n_group);
  for (int32_t g = 0; g < p.n_group; ++g) {
    scratch.order.resize(group_size);
    std::iota(scratch.order.begin(), scratch.order.end(), g * group_size);
    RankFront(scratch.select.data(), pick, scratch.order);
    float sum = 0.f;
    for (int32_t i = 0; i < pick; ++i) sum += scratch.select[scratch.order[i]];
    scratch.group_score[g] = sum;
  }
  scratch.groups.resize(p.n_group);
  std::iota(scratch.groups.begin(), scratch.groups.end(), 0);
  RankFront(scratch.group_score.data(), p.topk_group, scratch.groups);
  scratch.order.clear();
  for (int32_t i = 0; i < p.topk_group; ++i) {
    const int32_t first = scratch.groups[i] * group_size;
    for (int32_t e = first; e < first + group_size; ++e) scratch.order.push_back(e);
  }
}

void RouteDeepSeekV3(const RoutingParams& p, const float* z, int64_t num_experts, Scratch& scratch,
                     int32_t* ids, float* weights) {
  Sigmoid(z, num_experts, scratch.score.data());
  const float* correction =
      p.correction_bias.present() ? p.correction_bias.As<const float>() : nullptr;
  for (int64_t e = 0; e < num_experts; ++e) {
    scratch.select[e] = scratch.score[e] + (correction != nullptr ? correction[e] : 0.f);
  }
  GroupCandidates(p, num_experts, scratch);
  RankFront(scratch.select.data(), p.top_k, scratch.order);
  for (int32_t i = 0; i < p.top_k; ++i) {
    ids[i] = scratch.order[i];
    weights[i] = scratch.score[ids[i]];
  }
  if (p.renormalize) Renormalize(p.top_k, weights);
  for (int32_t i = 0; i < p.top_k; ++i) weights[i] *= p.routed_scaling_factor;
}

// Softmax and sigmoid methods: rank every expert by its score, weights are the scores.
void RouteByScore(const RoutingParams& p, const float* z, int64_t num_experts, Scratch& scratch,
                  int32_t* ids, float* weights) {
  const bool sigmoid =
      p.method == RoutingMethod::kSigmoid || p.method == RoutingMethod::kSigmoidRenorm;
  if (sigmoid) {
    Sigmoid(z, num_experts, scratch.score.data());
  } else {
    Softmax(z, num_experts, scratch.score.data());
  }
  scratch.order.resize(num_experts);
  std::iota(scratch.order.begin(), scratch.order.end(), 0);
  RankFront(scratch.score.data(), p.top_k, scratch.order);
  for (int32_t i = 0; i < p.top_k; ++i) {
    ids[i] = scratch.order[i];
    weights[i] = scratch.score[ids[i]];
  }
  if (p.method != RoutingMethod::kDefault && p.method != RoutingMethod::kSigmoid) {
    Renormalize(p.top_k, weights);
  }
}

}  // namespace

absl::string_view RoutingMethodName(RoutingMethod m) {
  for (const NamedMethod& n : kMethodNames) {
    if (n.method == m) return n.name;
  }
  return "unknown";
}

absl::StatusOr<RoutingMethod> ParseRoutingMethod(absl::string_view name) {
  for (const NamedMethod& n : kMethodNames) {
    if (n.name == name) return n.method;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown routing method '", name,
                   "' (expected default, renormalize, renormalize_naive, deepseek_v3, sigmoid or "
                   "sigmoid_renorm)"));
}

absl::Status Route(const RoutingParams& params, const TensorView& logits, TensorView topk_ids,
                   TensorView topk_weights) {
  if (absl::Status s = ValidateRoute(params, logits, topk_ids, topk_weights); !s.ok()) return s;
  const int64_t tokens = logits.dim(0), experts = logits.dim(1);
  const float* router_bias =
      params.router_bias.present() ? params.router_bias.As<const float>() : nullptr;
  Scratch scratch;
  scratch.score.resize(experts);
  scratch.select.resize(experts);
  std::vector<float> z(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits.As<const float>() + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      z[e] = row[e] + (router_bias != nullptr ? router_bias[e] : 0.f);
    }
    int32_t* ids = topk_ids.As<int32_t>() + t * params.top_k;
    float* weights = topk_weights.As<float>() + t * params.top_k;
    if (params.method == RoutingMethod::kDeepSeekV3) {
      RouteDeepSeekV3(params, z.data(), experts, scratch, ids, weights);
    } else {
      RouteByScore(params, z.data(), experts, scratch, ids, weights);
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
