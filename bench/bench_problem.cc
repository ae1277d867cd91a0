#include "bench/bench_problem.h"

#include <algorithm>
#include <numeric>

#include "kernels/formats.h"

namespace moe::bench {
namespace {

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random codes; UE8M0 scales 119..121 (weights of RMS about 1/sqrt(2880)).
WeightMatrix RandomMxfp4(int64_t rows, int64_t cols, uint64_t& state, ProblemLayer& p) {
  std::vector<uint8_t>& values = p.bytes.emplace_back(rows * cols / 2);
  std::vector<uint8_t>& scales = p.bytes.emplace_back(rows * cols / kMxfp4Block);
  for (size_t i = 0; i < values.size(); i += 8) {
    const uint64_t r = SplitMix(state);
    std::copy_n(reinterpret_cast<const uint8_t*>(&r), std::min<size_t>(8, values.size() - i),
                values.data() + i);
  }
  for (uint8_t& s : scales) s = static_cast<uint8_t>(119 + SplitMix(state) % 3);
  WeightMatrix m;
  m.format = WeightFormat::kMxfp4;
  m.rows = rows;
  m.cols = cols;
  m.values = MakeView(DType::kU8, {rows, cols / 2}, values.data());
  m.scales = MakeView(DType::kU8, {rows, cols / kMxfp4Block}, scales.data());
  return m;
}

TensorView RandomBias(int64_t n, float scale, uint64_t& state, ProblemLayer& p) {
  std::vector<float>& b = p.biases.emplace_back(n);
  for (float& x : b) x = scale * (static_cast<float>(SplitMix(state) % 20001) / 10000.f - 1.f);
  return MakeView(DType::kF32, {n}, b.data());
}

}  // namespace

ProblemLayer MakeProblemA(uint64_t seed) {
  ProblemLayer p;
  // Reserve so views stay valid while the vectors of vectors grow.
  p.bytes.reserve(4 * kProblemExperts);
  p.biases.reserve(2 * kProblemExperts);
  uint64_t state = seed;
  ExpertLayer& l = p.layer;
  l.hidden = kProblemHidden;
  l.intermediate = kProblemInter;
  l.format = WeightFormat::kMxfp4;
  l.layout = GateUpLayout::kInterleaved;
  l.activation.kind = ActivationKind::kSwigluOai;
  l.activation.alpha = 1.702f;
  l.activation.limit = 7.f;
  for (int e = 0; e < kProblemExperts; ++e) {
    ExpertWeights w;
    w.w13 = RandomMxfp4(2 * kProblemInter, kProblemHidden, state, p);
    w.w2 = RandomMxfp4(kProblemHidden, kProblemInter, state, p);
    w.b13 = RandomBias(2 * kProblemInter, 0.5f, state, p);
    w.b2 = RandomBias(kProblemHidden, 0.1f, state, p);
    l.experts.push_back(w);
  }
  return p;
}

double ExpertBytes(const ProblemLayer& problem) {
  const ExpertWeights& w = problem.layer.experts[0];
  return static_cast<double>(w.w13.values.NumBytes() + w.w13.scales.NumBytes() +
                             w.w2.values.NumBytes() + w.w2.scales.NumBytes());
}

ExpertsRequest HostBatch::Request(uint16_t* out) const {
  ExpertsRequest r;
  r.hidden_states = MakeView(DType::kBF16, {tokens, hidden_size}, hidden.data());
  r.local_ids = MakeView(DType::kI32, {tokens, top_k}, ids.data());
  r.topk_weights = MakeView(DType::kF32, {tokens, top_k}, weights.data());
  r.out = MakeView(DType::kBF16, {tokens, hidden_size}, out);
  return r;
}

HostBatch RandomBatch(const ProblemLayer& problem, int64_t tokens, std::mt19937_64& rng) {
  HostBatch b;
  b.tokens = tokens;
  b.top_k = kProblemTopK;
  b.hidden_size = problem.layer.hidden;
  b.hidden.resize(tokens * b.hidden_size);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (uint16_t& h : b.hidden) h = FloatToBf16(normal(rng));
  const int experts = static_cast<int>(problem.layer.experts.size());
  std::vector<int32_t> pool(experts);
  std::uniform_real_distribution<float> unit(0.05f, 1.f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    float sum = 0;
    for (int k = 0; k < kProblemTopK; ++k) {
      // Partial Fisher-Yates: K distinct experts, uniformly.
      std::swap(pool[k], pool[k + rng() % (experts - k)]);
      b.ids.push_back(pool[k]);
      b.weights.push_back(unit(rng));
      sum += b.weights.back();
    }
    for (int k = 0; k < kProblemTopK; ++k) b.weights[t * kProblemTopK + k] /= sum;
  }
  return b;
}

}  // namespace moe::bench
