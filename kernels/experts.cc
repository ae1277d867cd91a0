// Scalar CPU reference for one MoE layer's experts (numerics.md section 6).
//
// Work is grouped by expert: each expert that has at least one token is dequantized once into
// fp32 scratch (global scales are applied to the GEMM results, not to the weights, as the spec
// words it), then every token routed to it runs w13 -> activation -> w2 and adds its weighted
// result into an fp32 accumulator. The output tensor is written once at the end, so BF16 output
// is rounded exactly once and `out` may even alias `hidden_states`.
#include "kernels/experts.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status CheckBias(const TensorView& bias, int64_t length, const std::string& name) {
  if (!bias.present()) return absl::OkStatus();
  return CheckTensor(bias, name, DType::kF32, {length});
}

absl::Status ValidateExpert(const ExpertLayer& layer, const ExpertWeights& w,
                            const std::string& name) {
  const int64_t h = layer.hidden;
  const int64_t inter = layer.intermediate;
  if (w.w13.format != layer.format || w.w2.format != layer.format) {
    return absl::InvalidArgumentError(absl::StrCat(name,
                                                   ": matrix format differs from layer format ",
                                                   std::string(WeightFormatName(layer.format))));
  }
  if (w.w13.rows != 2 * inter || w.w13.cols != h || w.w2.rows != h || w.w2.cols != inter) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": w13 is [", w.w13.rows, ", ", w.w13.cols, "] and w2 [", w.w2.rows, ", ", w.w2.cols,
        "]; the layer needs [", 2 * inter, ", ", h, "] and [", h, ", ", inter, "]"));
  }
  if (absl::Status s = ValidateWeightMatrix(w.w13, 2 * inter, h, name + ".w13"); !s.ok()) return s;
  if (absl::Status s = ValidateWeightMatrix(w.w2, h, inter, name + ".w2"); !s.ok()) return s;
  for (float scale : {w.w13_gate_global_scale, w.w13_up_global_scale, w.w2_global_scale}) {
    if (!std::isfinite(scale)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": non-finite global scale"));
    }
    if (layer.format != WeightFormat::kNvfp4 && scale != 1.f) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": global scale ", scale, " given for a non-NVFP4 format"));
    }
  }
  if (absl::Status s = CheckBias(w.b13, 2 * inter, name + ".b13"); !s.ok()) return s;
  return CheckBias(w.b2, h, name + ".b2");
}

// fp32 dot product. Eight independent partial sums let the compiler vectorize without
// -ffast-math; the result is still an fp32 accumulation, which is all the contract asks.
float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) partial[l] += a[i] * b[i];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

// One expert's weights in fp32, dequantized without global scales.
struct DenseExpert {
  std::vector<float> w13;  // [2I, H]
  std::vector<float> w2;   // [H, I]
};

void Dequantize(const ExpertWeights& w, DenseExpert& dense) {
  dense.w13.resize(static_cast<size_t>(w.w13.rows * w.w13.cols));
  dense.w2.resize(static_cast<size_t>(w.w2.rows * w.w2.cols));
  DequantizeRows(w.w13, 0, w.w13.rows, 1.f, dense.w13.data());
  DequantizeRows(w.w2, 0, w.w2.rows, 1.f, dense.w2.data());
}

// Scratch reused across tokens of one call.
struct TokenScratch {
  std::vector<float> h;  // [2I]
  std::vector<float> a;  // [I]
};

// acc[0, H) += weight * expert(x).
void AddExpertOutput(const ExpertLayer& layer, const ExpertWeights& w, const DenseExpert& dense,
                     const float* x, float weight, TokenScratch& scratch, float* acc) {
  const int64_t h_dim = layer.hidden;
  const int64_t inter = layer.intermediate;
  const float* b13 = w.b13.present() ? w.b13.As<const float>() : nullptr;
  const float* b2 = w.b2.present() ? w.b2.As<const float>() : nullptr;
  for (int64_t j = 0; j < inter; ++j) {
    for (const auto& [row, scale] :
         {std::pair{GateRow(layer.layout, j, inter), w.w13_gate_global_scale},
          std::pair{UpRow(layer.layout, j, inter), w.w13_up_global_scale}}) {
      float v = Dot(&dense.w13[row * h_dim], x, h_dim) * scale;
      if (b13 != nullptr) v += b13[row];
      scratch.h[row] = v;
    }
  }
  ApplyActivationRow(layer.activation, layer.layout, scratch.h.data(), inter, scratch.a.data());
  for (int64_t n = 0; n < h_dim; ++n) {
    float y = Dot(&dense.w2[n * inter], scratch.a.data(), inter) * w.w2_global_scale;
    if (b2 != nullptr) y += b2[n];
    acc[n] += weight * y;
  }
}

struct Route {
  int64_t token;
  float weight;
};

// Routes of the request bucketed by local slot, in token order inside each bucket.
std::vector<std::vector<Route>> GroupByExpert(const ExpertLayer& layer,
                                              const ExpertsRequest& request) {
  std::vector<std::vector<Route>> groups(layer.experts.size());
  const int64_t tokens = request.local_ids.dim(0);
  const int64_t k = request.local_ids.dim(1);
  const int32_t* ids = request.local_ids.As<const int32_t>();
  const float* weights = request.topk_weights.As<const float>();
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (ids[i] >= 0) groups[ids[i]].push_back(Route{i / k, weights[i]});
  }
  return groups;
}

std::vector<float> HiddenStatesAsF32(const TensorView& hs) {
  std::vector<float> x(static_cast<size_t>(hs.NumElements()));
  if (hs.dtype == DType::kF32) {
    if (!x.empty()) std::memcpy(x.data(), hs.data, x.size() * sizeof(float));
  } else {
    const uint16_t* bits = hs.As<const uint16_t>();
    for (size_t i = 0; i < x.size(); ++i) x[i] = Bf16ToFloat(bits[i]);
  }
  return x;
}

void RunGroup(const ExpertLayer& layer, const ExpertWeights& w, const std::vector<Route>& routes,
              const std::vector<float>& x, DenseExpert& dense, TokenScratch& scratch,
              std::vector<float>& acc) {
  if (routes.empty()) return;
  Dequantize(w, dense);
  const int64_t h_dim = layer.hidden;
  for (const Route& r : routes) {
    AddExpertOutput(layer, w, dense, &x[r.token * h_dim], r.weight, scratch, &acc[r.token * h_dim]);
  }
}

void WriteOutput(const std::vector<float>& acc, const TensorView& out) {
  if (out.dtype == DType::kF32) {
    if (!acc.empty()) std::memcpy(out.data, acc.data(), acc.size() * sizeof(float));
    return;
  }
  uint16_t* bits = out.As<uint16_t>();
  for (size_t i = 0; i < acc.size(); ++i) bits[i] = FloatToBf16(acc[i]);
}

}  // namespace

absl::Status ValidateExpertLayer(const ExpertLayer& layer) {
  if (layer.hidden <= 0 || layer.intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert layer: hidden ", layer.hidden,
                                                   " and intermediate ", layer.intermediate,
                                                   " must be positive"));
  }
  if (absl::Status s = ValidateActivation(layer.activation); !s.ok()) return s;
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    absl::Status s = ValidateExpert(layer, layer.experts[e], absl::StrCat("expert ", e));
    if (!s.ok()) return s;
  }
  for (size_t e = 0; e < layer.shared_experts.size(); ++e) {
    absl::Status s =
        ValidateExpert(layer, layer.shared_experts[e], absl::StrCat("shared expert ", e));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateExpertsRequest(const ExpertLayer& layer, const ExpertsRequest& request) {
  const int64_t h = layer.hidden;
  if (absl::Status s = CheckTensorOneOf(request.hidden_states, "hidden_states",
                                        {DType::kF32, DType::kBF16}, {kAnyDim, h});
      !s.ok()) {
    return s;
  }
  const int64_t tokens = request.hidden_states.dim(0);
  if (absl::Status s = CheckTensor(request.local_ids, "local_ids", DType::kI32, {tokens, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t k = request.local_ids.dim(1);
  if (absl::Status s = CheckTensor(request.topk_weights, "topk_weights", DType::kF32, {tokens, k});
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckTensorOneOf(request.out, "out", {DType::kF32, DType::kBF16}, {tokens, h});
      !s.ok()) {
    return s;
  }
  if (request.shared_mask.present()) {
    if (absl::Status s = CheckTensor(request.shared_mask, "shared_mask", DType::kBool, {tokens});
        !s.ok()) {
      return s;
    }
    const uint8_t* mask = request.shared_mask.As<const uint8_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      if (mask[t] > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("shared_mask[", t, "] = ", static_cast<int>(mask[t]), " is not a bool"));
      }
    }
  }
  const int32_t* ids = request.local_ids.As<const int32_t>();
  const float* weights = request.topk_weights.As<const float>();
  const int64_t num_experts = static_cast<int64_t>(layer.experts.size());
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (ids[i] < -1 || ids[i] >= num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "local_ids[", i / k, ",", i % k, "] = ", ids[i], " outside [-1, ", num_experts, ")"));
    }
    if (!std::isfinite(weights[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("topk_weights[", i / k, ",", i % k, "] is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status RequireHostTensors(const ExpertsRequest& request, absl::string_view backend) {
  if (!request.hidden_on_device && !request.out_on_device) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      backend, ": hidden states and output must be host memory (device tensors need a CUDA "
               "backend)"));
}

absl::Status RunExpertsReference(const ExpertLayer& layer, const ExpertsRequest& request) {
  if (absl::Status s = RequireHostTensors(request, "cpu-reference"); !s.ok()) return s;
  if (absl::Status s = ValidateExpertsRequest(layer, request); !s.ok()) return s;
  const int64_t tokens = request.hidden_states.dim(0);
  const int64_t h_dim = layer.hidden;
  const std::vector<float> x = HiddenStatesAsF32(request.hidden_states);
  std::vector<float> acc(static_cast<size_t>(tokens * h_dim), 0.f);
  DenseExpert dense;
  TokenScratch scratch{std::vector<float>(static_cast<size_t>(2 * layer.intermediate)),
                       std::vector<float>(static_cast<size_t>(layer.intermediate))};

  const std::vector<std::vector<Route>> groups = GroupByExpert(layer, request);
  for (size_t e = 0; e < groups.size(); ++e) {
    RunGroup(layer, layer.experts[e], groups[e], x, dense, scratch, acc);
  }
  if (request.shared_mask.present() && !layer.shared_experts.empty()) {
    std::vector<Route> marked;
    const uint8_t* mask = request.shared_mask.As<const uint8_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      if (mask[t] != 0) marked.push_back(Route{t, 1.f});
    }
    for (const ExpertWeights& shared : layer.shared_experts) {
      RunGroup(layer, shared, marked, x, dense, scratch, acc);
    }
  }
  WriteOutput(acc, request.out);
  return absl::OkStatus();
}

}  // namespace moe
