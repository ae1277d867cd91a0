#include "kernels/cpu/random_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace moe::cpu {
namespace {

// splitmix64: fast enough to fill gigabytes of benchmark weights.
struct FastRng {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

uint8_t* Own(OwnedLayer& owner, int64_t n) {
  owner.bytes.push_back(std::make_unique<uint8_t[]>(static_cast<size_t>(std::max<int64_t>(n, 1))));
  return owner.bytes.back().get();
}

uint16_t Bf16Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

// 2.93 is the RMS of a uniformly random E2M1 code; 1.5 the typical E4M3 scale drawn below.
constexpr double kCodeRms = 2.93;

TensorView OwnedFloats(OwnedLayer& owner, std::vector<float> values) {
  owner.floats.push_back(std::move(values));
  std::vector<float>& v = owner.floats.back();
  return MakeView(DType::kF32, {static_cast<int64_t>(v.size())}, v.data());
}

ExpertWeights RandomExpert(const RandomLayerSpec& s, uint64_t seed, OwnedLayer& owner) {
  ExpertWeights w;
  w.w13 = RandomMatrix(s.format, 2 * s.inter, s.hidden, seed * 2 + 1, owner);
  w.w2 = RandomMatrix(s.format, s.hidden, s.inter, seed * 2 + 2, owner);
  std::mt19937_64 rng(seed);
  if (s.format == WeightFormat::kNvfp4) {
    std::uniform_real_distribution<float> factor(0.5f, 2.f);
    const float in_h = 1.f / (1.5f * kCodeRms * std::sqrt(static_cast<float>(s.hidden)));
    const float in_i = 1.f / (1.5f * kCodeRms * std::sqrt(static_cast<float>(s.inter)));
    w.w13_gate_global_scale = in_h * factor(rng);
    w.w13_up_global_scale = in_h * factor(rng);
    w.w2_global_scale = in_i * factor(rng);
  }
  if (s.bias) {
    std::normal_distribution<float> normal(0.f, 0.5f);
    std::vector<float> b13(2 * s.inter), b2(s.hidden);
    for (float& v : b13) v = normal(rng);
    for (float& v : b2) v = normal(rng);
    w.b13 = OwnedFloats(owner, std::move(b13));
    w.b2 = OwnedFloats(owner, std::move(b2));
  }
  return w;
}

}  // namespace

WeightMatrix RandomMatrix(WeightFormat format, int64_t rows, int64_t cols, uint64_t seed,
                          OwnedLayer& owner) {
  FastRng rng{seed * 0x2545F4914F6CDD1Dull + 1};
  WeightMatrix w{format, rows, cols, {}, {}};
  if (format == WeightFormat::kBf16) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> normal(0.f, 1.f / std::sqrt(static_cast<float>(cols)));
    auto* v = reinterpret_cast<uint16_t*>(Own(owner, rows * cols * 2));
    for (int64_t i = 0; i < rows * cols; ++i) v[i] = Bf16Bits(normal(gen));
    w.values = MakeView(DType::kBF16, {rows, cols}, v);
    return w;
  }
  const int64_t block = format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  uint8_t* codes = Own(owner, rows * cols / 2);
  for (int64_t i = 0; i < rows * cols / 2; i += 8) {
    const uint64_t bits = rng.Next();
    std::memcpy(codes + i, &bits, std::min<int64_t>(8, rows * cols / 2 - i));
  }
  uint8_t* scales = Own(owner, rows * cols / block);
  const int base = 127 - static_cast<int>(std::lround(std::log2(kCodeRms * std::sqrt(cols))));
  for (int64_t i = 0; i < rows * cols / block; ++i) {
    const uint64_t r = rng.Next();
    // MXFP4: 2^(base - 1 .. base + 1); NVFP4: E4M3 exponents 5..8 (scales 0.25 .. 3.75).
    scales[i] = format == WeightFormat::kMxfp4
                    ? static_cast<uint8_t>(base - 1 + static_cast<int>(r % 3))
                    : static_cast<uint8_t>(((5 + (r >> 8) % 4) << 3) | (r >> 16) % 8);
  }
  w.values = MakeView(DType::kU8, {rows, cols / 2}, codes);
  w.scales = MakeView(format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3,
                      {rows, cols / block}, scales);
  return w;
}

std::unique_ptr<OwnedLayer> MakeRandomLayer(const RandomLayerSpec& s) {
  auto owner = std::make_unique<OwnedLayer>();
  owner->floats.reserve(static_cast<size_t>(2 * (s.experts + s.shared)));  // views stay valid
  ExpertLayer& layer = owner->layer;
  layer.hidden = s.hidden;
  layer.intermediate = s.inter;
  layer.format = s.format;
  layer.layout = s.layout;
  layer.activation = s.activation;
  for (int64_t e = 0; e < s.experts; ++e) {
    layer.experts.push_back(RandomExpert(s, s.seed * 1000003 + e, *owner));
  }
  for (int64_t e = 0; e < s.shared; ++e) {
    layer.shared_experts.push_back(RandomExpert(s, s.seed * 1000003 + 500000 + e, *owner));
  }
  return owner;
}

ExpertsRequest OwnedRequest::Request() {
  ExpertsRequest r;
  r.hidden_states = in_dtype == DType::kF32
                        ? MakeView(DType::kF32, {tokens, hidden}, x_f32.data())
                        : MakeView(DType::kBF16, {tokens, hidden}, x_bf16.data());
  r.local_ids = MakeView(DType::kI32, {tokens, top_k}, ids.data());
  r.topk_weights = MakeView(DType::kF32, {tokens, top_k}, weights.data());
  if (!mask.empty()) r.shared_mask = MakeView(DType::kBool, {tokens}, mask.data());
  r.out = out_dtype == DType::kF32 ? MakeView(DType::kF32, {tokens, hidden}, out_f32.data())
                                   : MakeView(DType::kBF16, {tokens, hidden}, out_bf16.data());
  return r;
}

float OwnedRequest::Out(int64_t i) const {
  if (out_dtype == DType::kF32) return out_f32[i];
  const uint32_t bits = static_cast<uint32_t>(out_bf16[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void OwnedRequest::Poison() {
  std::fill(out_f32.begin(), out_f32.end(), std::nanf(""));
  std::fill(out_bf16.begin(), out_bf16.end(), 0x7FC0);
}

OwnedRequest MakeRandomRequest(const ExpertLayer& layer, const RandomRequestSpec& s) {
  OwnedRequest r;
  r.tokens = s.tokens;
  r.hidden = layer.hidden;
  r.top_k = s.top_k;
  r.in_dtype = s.in_dtype;
  r.out_dtype = s.out_dtype;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < s.tokens * layer.hidden; ++i) {
    const float v = normal(rng);
    r.x_f32.push_back(v);
    r.x_bf16.push_back(Bf16Bits(v));
  }
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  std::bernoulli_distribution not_local(s.not_local), coin(0.5);
  std::vector<int32_t> slots(layer.experts.size());
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int64_t k = 0; k < s.top_k; ++k) {
      const bool local = k < static_cast<int64_t>(slots.size()) && !not_local(rng);
      r.ids.push_back(local ? slots[k] : -1);
      r.weights.push_back(weight(rng));
    }
    if (s.shared_mask) r.mask.push_back(coin(rng) ? 1 : 0);
  }
  r.out_f32.assign(s.out_dtype == DType::kF32 ? s.tokens * layer.hidden : 0, 0.f);
  r.out_bf16.assign(s.out_dtype == DType::kBF16 ? s.tokens * layer.hidden : 0, 0);
  r.Poison();
  return r;
}

}  // namespace moe::cpu
