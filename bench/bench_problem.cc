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

// Random codes; E4M3 block scales 0x36..0x3A (0.75..1.25); the caller sets the global scale.
WeightMatrix RandomNvfp4(int64_t rows, int64_t cols, uint64_t& state, ProblemLayer& p) {
  std::vector<uint8_t>& values = p.bytes.emplace_back(rows * cols / 2);
  std::vector<uint8_t>& scales = p.bytes.emplace_back(rows * cols / kNvfp4Block);
  for (size_t i = 0; i < values.size(); i += 8) {
    const uint64_t r = SplitMix(state);
    std::copy_n(reinterpret_cast<const uint8_t*>(&r), std::min<size_t>(8, values.size() - i),
                values.data() + i);
  }
  for (uint8_t& s : scales) s = static_cast<uint8_t>(0x36 + SplitMix(state) % 5);
  WeightMatrix m;
  m.format = WeightFormat::kNvfp4;
  m.rows = rows;
  m.cols = cols;
  m.values = MakeView(DType::kU8, {rows, cols / 2}, values.data());
  m.scales = MakeView(DType::kE4M3, {rows, cols / kNvfp4Block}, scales.data());
  return m;
}

// Uniform in [lo, hi).
float Uniform(uint64_t& state, float lo, float hi) {
  return lo + (hi - lo) * static_cast<float>(SplitMix(state) % 1000000) / 1e6f;
}

// Problems B and C: SILU, concatenated gate/up, no biases.
ProblemLayer MakeSiluProblem(char name, int experts, int top_k, int64_t hidden, int64_t inter,
                             WeightFormat format, uint64_t seed) {
  ProblemLayer p;
  p.name = name;
  p.top_k = top_k;
  p.bytes.reserve(4 * experts);
  uint64_t state = seed;
  ExpertLayer& l = p.layer;
  l.hidden = hidden;
  l.intermediate = inter;
  l.format = format;
  l.layout = GateUpLayout::kConcatenated;
  l.activation.kind = ActivationKind::kSilu;
  for (int e = 0; e < experts; ++e) {
    ExpertWeights w;
    if (format == WeightFormat::kNvfp4) {
      // Code RMS ~2.9 x block scale ~1 x global ~2^-8 / 2^-7: weights of RMS ~1/sqrt(fan-in).
      w.w13 = RandomNvfp4(2 * inter, hidden, state, p);
      w.w2 = RandomNvfp4(hidden, inter, state, p);
      w.w13_gate_global_scale = Uniform(state, 0.003f, 0.005f);
      w.w13_up_global_scale = Uniform(state, 0.003f, 0.005f);
      w.w2_global_scale = Uniform(state, 0.006f, 0.009f);
    } else {
      w.w13 = RandomMxfp4(2 * inter, hidden, state, p);
      w.w2 = RandomMxfp4(hidden, inter, state, p);
    }
    l.experts.push_back(w);
  }
  return p;
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

ProblemLayer MakeProblem(char name, uint64_t seed) {
  switch (name) {
    case 'B':
      return MakeSiluProblem('B', 256, 8, 7168, 2048, WeightFormat::kNvfp4, seed);
    case 'C':
      return MakeSiluProblem('C', 128, 8, 2048, 768, WeightFormat::kMxfp4, seed);
    default:
      return MakeProblemA(seed);
  }
}

double ExpertBytes(const ProblemLayer& problem) {
  const ExpertWeights& w = problem.layer.experts[0];
  const size_t global_scales = problem.layer.format == WeightFormat::kNvfp4 ? 3 * sizeof(float) : 0;
  return static_cast<double>(w.w13.values.NumBytes() + w.w13.scales.NumBytes() +
                             w.w2.values.NumBytes() + w.w2.scales.NumBytes() + global_scales);
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
  b.top_k = problem.top_k;
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
    for (int k = 0; k < b.top_k; ++k) {
      // Partial Fisher-Yates: K distinct experts, uniformly.
      std::swap(pool[k], pool[k + rng() % (experts - k)]);
      b.ids.push_back(pool[k]);
      b.weights.push_back(unit(rng));
      sum += b.weights.back();
    }
    for (int k = 0; k < b.top_k; ++k) b.weights[t * b.top_k + k] /= sum;
  }
  return b;
}

}  // namespace moe::bench
