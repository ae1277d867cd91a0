// Tests of the expert reference against an independent, deliberately naive formulation: every
// weight element is decoded to double by this file's own E2M1/UE8M0/E4M3/BF16 decoders and the
// whole layer is evaluated in double. Plus hand-derived cases and the INVALID_ARGUMENT paths.
#include "kernels/experts.h"
#include "kernels/sweep_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

using sweep::SweepCase;

using Rng = std::mt19937_64;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- This file's own element decoders (numerics.md section 1) ------------------------------

double E2m1Value(uint8_t nibble) {
  static constexpr double kMagnitude[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double m = kMagnitude[nibble & 7];
  return (nibble & 8) ? -m : m;
}

double Ue8m0Value(uint8_t b) { return std::ldexp(1.0, static_cast<int>(b) - 127); }

double E4m3Value(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 7;
  const double m =
      exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return (bits & 0x80) ? -m : m;
}

double Bf16Value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// Truncation to BF16: the value the test then uses is whatever these bits decode to.
uint16_t Bf16Bits(float f) {
  uint32_t wide;
  std::memcpy(&wide, &f, sizeof(f));
  return static_cast<uint16_t>(wide >> 16);
}

// ---- Owned test weights ----------------------------------------------------------------------

struct OwnedMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> packed;  // fp4 formats: [rows, cols / 2]
  std::vector<uint16_t> bf16;   // BF16: [rows, cols]
  std::vector<uint8_t> scales;  // MXFP4: [rows, cols / 32], NVFP4: [rows, cols / 16]

  int64_t Block() const { return format == WeightFormat::kMxfp4 ? 32 : 16; }

  WeightMatrix View() const {
    WeightMatrix w{format, rows, cols, {}, {}};
    if (format == WeightFormat::kBf16) {
      w.values = MakeView(DType::kBF16, {rows, cols}, bf16.data());
      return w;
    }
    w.values = MakeView(DType::kU8, {rows, cols / 2}, packed.data());
    const DType scale_type = format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3;
    w.scales = MakeView(scale_type, {rows, cols / Block()}, scales.data());
    return w;
  }

  double Element(int64_t n, int64_t k) const {
    if (format == WeightFormat::kBf16) return Bf16Value(bf16[n * cols + k]);
    const uint8_t byte = packed[n * (cols / 2) + k / 2];
    const double value = E2m1Value(k % 2 == 0 ? byte & 0xF : byte >> 4);
    const uint8_t scale = scales[n * (cols / Block()) + k / Block()];
    return value * (format == WeightFormat::kMxfp4 ? Ue8m0Value(scale) : E4m3Value(scale));
  }

  std::vector<double> Decode() const {
    std::vector<double> d(rows * cols);
    for (int64_t n = 0; n < rows; ++n) {
      for (int64_t k = 0; k < cols; ++k) d[n * cols + k] = Element(n, k);
    }
    return d;
  }
};

// Every element the E2M1 code (fp4) or BF16 bits `code`, every scale byte `scale`.
OwnedMatrix UniformMatrix(WeightFormat f, int64_t rows, int64_t cols, uint16_t code,
                          uint8_t scale) {
  OwnedMatrix m{f, rows, cols, {}, {}, {}};
  if (f == WeightFormat::kBf16) {
    m.bf16.assign(rows * cols, code);
  } else {
    m.packed.assign(rows * cols / 2, static_cast<uint8_t>(code | (code << 4)));
    m.scales.assign(rows * cols / m.Block(), scale);
  }
  return m;
}

// Random weights whose products with unit-variance inputs stay near unit variance.
OwnedMatrix RandomMatrix(WeightFormat f, int64_t rows, int64_t cols, Rng& rng) {
  OwnedMatrix m{f, rows, cols, {}, {}, {}};
  if (f == WeightFormat::kBf16) {
    std::normal_distribution<float> normal(0.f, 1.f / std::sqrt(static_cast<float>(cols)));
    for (int64_t i = 0; i < rows * cols; ++i) m.bf16.push_back(Bf16Bits(normal(rng)));
    return m;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < rows * cols / 2; ++i) m.packed.push_back(byte(rng));
  std::uniform_int_distribution<int> jitter(-1, 1);
  std::uniform_int_distribution<int> exponent(5, 8);  // E4M3 scales in [0.25, 3.75]
  std::uniform_int_distribution<int> mantissa(0, 7);
  // 2.93 is the RMS of a uniformly random E2M1 code.
  const int base = 127 - static_cast<int>(std::lround(std::log2(2.93 * std::sqrt(cols))));
  for (int64_t i = 0; i < rows * cols / m.Block(); ++i) {
    m.scales.push_back(f == WeightFormat::kMxfp4 ? base + jitter(rng)
                                                 : (exponent(rng) << 3) | mantissa(rng));
  }
  return m;
}

struct OwnedExpert {
  OwnedMatrix w13;
  OwnedMatrix w2;
  float gate_scale = 1.f;
  float up_scale = 1.f;
  float w2_scale = 1.f;
  std::vector<float> b13;  // empty: no bias
  std::vector<float> b2;

  ExpertWeights View() const {
    ExpertWeights w{w13.View(), w2.View(), gate_scale, up_scale, w2_scale, {}, {}};
    if (!b13.empty()) w.b13 = MakeView(DType::kF32, {static_cast<int64_t>(b13.size())}, b13.data());
    if (!b2.empty()) w.b2 = MakeView(DType::kF32, {static_cast<int64_t>(b2.size())}, b2.data());
    return w;
  }
};

struct TestModel {
  int64_t hidden = 0;
  int64_t inter = 0;
  WeightFormat format = WeightFormat::kBf16;
  GateUpLayout layout = GateUpLayout::kConcatenated;
  ActivationParams activation;
  std::vector<OwnedExpert> experts;
  std::vector<OwnedExpert> shared;

  ExpertLayer Layer() const {
    ExpertLayer layer{hidden, inter, format, layout, activation, {}, {}};
    for (const OwnedExpert& e : experts) layer.experts.push_back(e.View());
    for (const OwnedExpert& e : shared) layer.shared_experts.push_back(e.View());
    return layer;
  }
};

OwnedExpert RandomExpert(const TestModel& m, bool bias, Rng& rng) {
  OwnedExpert e{RandomMatrix(m.format, 2 * m.inter, m.hidden, rng),
                RandomMatrix(m.format, m.hidden, m.inter, rng)};
  if (m.format == WeightFormat::kNvfp4) {
    // Undo the typical E4M3 scale (~1.5) and the fan-in, with distinct factors per matrix.
    std::uniform_real_distribution<float> factor(0.5f, 2.f);
    const float in_h = 1.f / (1.5f * 2.93f * std::sqrt(static_cast<float>(m.hidden)));
    const float in_i = 1.f / (1.5f * 2.93f * std::sqrt(static_cast<float>(m.inter)));
    e.gate_scale = in_h * factor(rng);
    e.up_scale = in_h * factor(rng);
    e.w2_scale = in_i * factor(rng);
  }
  if (bias) {
    std::normal_distribution<float> normal(0.f, 0.5f);
    for (int64_t i = 0; i < 2 * m.inter; ++i) e.b13.push_back(normal(rng));
    for (int64_t i = 0; i < m.hidden; ++i) e.b2.push_back(normal(rng));
  }
  return e;
}

// ---- Owned test inputs -----------------------------------------------------------------------

struct TestInputs {
  int64_t tokens = 0;
  int64_t k = 0;
  int64_t hidden = 0;
  DType in_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  std::vector<float> x_f32;
  std::vector<uint16_t> x_bf16;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint8_t> mask;  // empty: no mask
  std::vector<float> out_f32;
  std::vector<uint16_t> out_bf16;

  // Fills x from doubles (converted to the input dtype) and poisons the output with NaNs so
  // that a row the reference fails to write is caught.
  void SetHidden(const std::vector<double>& x) {
    for (double v : x) {
      x_f32.push_back(static_cast<float>(v));
      x_bf16.push_back(Bf16Bits(static_cast<float>(v)));
    }
    out_f32.assign(tokens * hidden, kNan);
    out_bf16.assign(tokens * hidden, 0x7FC0);
  }

  double X(int64_t i) const { return in_dtype == DType::kF32 ? x_f32[i] : Bf16Value(x_bf16[i]); }
  double Out(int64_t i) const {
    return out_dtype == DType::kF32 ? out_f32[i] : Bf16Value(out_bf16[i]);
  }

  ExpertsRequest Request() {
    ExpertsRequest r;
    r.hidden_states = in_dtype == DType::kF32
                          ? MakeView(DType::kF32, {tokens, hidden}, x_f32.data())
                          : MakeView(DType::kBF16, {tokens, hidden}, x_bf16.data());
    r.local_ids = MakeView(DType::kI32, {tokens, k}, ids.data());
    r.topk_weights = MakeView(DType::kF32, {tokens, k}, weights.data());
    if (!mask.empty()) r.shared_mask = MakeView(DType::kBool, {tokens}, mask.data());
    r.out = out_dtype == DType::kF32 ? MakeView(DType::kF32, {tokens, hidden}, out_f32.data())
                                     : MakeView(DType::kBF16, {tokens, hidden}, out_bf16.data());
    return r;
  }
};

// ---- The naive formulation, in double --------------------------------------------------------

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

double NaiveActivation(const ActivationParams& p, double g, double u) {
  switch (p.kind) {
    case ActivationKind::kSilu:
      return g * Sigmoid(g) * u;
    case ActivationKind::kSwigluOai:
      g = std::min<double>(g, p.limit);
      u = std::clamp<double>(u, -p.limit, p.limit);
      return (u + 1) * g * Sigmoid(p.alpha * g);
    case ActivationKind::kSitu: {
      const double lin = p.linear_beta > 0 ? p.linear_beta * std::tanh(u / p.linear_beta) : u;
      return p.beta * std::tanh(g / p.beta) * Sigmoid(g) * lin;
    }
    case ActivationKind::kGelu:
      return 0.5 * g * (1 + std::erf(g / std::sqrt(2.0))) * u;
    case ActivationKind::kGeluTanh: {
      const double c = std::sqrt(2.0 / M_PI);
      return 0.5 * g * (1 + std::tanh(c * (g + 0.044715 * g * g * g))) * u;
    }
  }
  return 0;
}

struct DecodedExpert {
  const OwnedExpert* owned;
  std::vector<double> w13;
  std::vector<double> w2;
};

// out[0, H) += weight * expert(x), every step in double.
void NaiveAddExpert(const TestModel& m, const DecodedExpert& e, const double* x, double weight,
                    double* out) {
  const int64_t hd = m.hidden;
  const int64_t in = m.inter;
  const bool interleaved = m.layout == GateUpLayout::kInterleaved;
  std::vector<double> a(in);
  for (int64_t j = 0; j < in; ++j) {
    const int64_t gate_row = interleaved ? 2 * j : j;
    const int64_t up_row = interleaved ? 2 * j + 1 : in + j;
    double g = 0, u = 0;
    for (int64_t c = 0; c < hd; ++c) {
      g += e.w13[gate_row * hd + c] * x[c];
      u += e.w13[up_row * hd + c] * x[c];
    }
    g *= e.owned->gate_scale;
    u *= e.owned->up_scale;
    if (!e.owned->b13.empty()) {
      g += e.owned->b13[gate_row];
      u += e.owned->b13[up_row];
    }
    a[j] = NaiveActivation(m.activation, g, u);
  }
  for (int64_t n = 0; n < hd; ++n) {
    double y = 0;
    for (int64_t j = 0; j < in; ++j) y += e.w2[n * in + j] * a[j];
    y *= e.owned->w2_scale;
    if (!e.owned->b2.empty()) y += e.owned->b2[n];
    out[n] += weight * y;
  }
}

std::vector<DecodedExpert> DecodeAll(const std::vector<OwnedExpert>& experts) {
  std::vector<DecodedExpert> decoded;
  for (const OwnedExpert& e : experts) decoded.push_back({&e, e.w13.Decode(), e.w2.Decode()});
  return decoded;
}

std::vector<double> NaiveLayer(const TestModel& m, const TestInputs& in) {
  const std::vector<DecodedExpert> experts = DecodeAll(m.experts);
  const std::vector<DecodedExpert> shared = DecodeAll(m.shared);
  std::vector<double> out(in.tokens * m.hidden, 0.0);
  std::vector<double> x(m.hidden);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t c = 0; c < m.hidden; ++c) x[c] = in.X(t * m.hidden + c);
    double* row = &out[t * m.hidden];
    for (int64_t k = 0; k < in.k; ++k) {
      const int32_t id = in.ids[t * in.k + k];
      if (id >= 0) NaiveAddExpert(m, experts[id], x.data(), in.weights[t * in.k + k], row);
    }
    if (!in.mask.empty() && in.mask[t]) {
      for (const DecodedExpert& e : shared) NaiveAddExpert(m, e, x.data(), 1.0, row);
    }
  }
  return out;
}

// ---- Random sweep ----------------------------------------------------------------------------


// Variant 0 uses SITU's linear_beta branch, variant 1 passes u through.
ActivationParams ParamsFor(ActivationKind kind, int variant) {
  ActivationParams p;
  p.kind = kind;
  p.limit = 2.5f;  // low enough that the clamps act on unit-variance inputs
  p.beta = 2.f;
  p.linear_beta = variant % 2 == 0 ? 3.f : 0.f;
  return p;
}

TestInputs RandomInputs(const SweepCase& c, Rng& rng) {
  TestInputs in{c.tokens, c.k, c.hidden, c.in_dtype, c.out_dtype};
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(c.tokens * c.hidden);
  for (double& v : x) v = normal(rng);
  in.SetHidden(x);
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  std::bernoulli_distribution not_local(0.25), coin(0.5);
  std::vector<int32_t> slots(c.experts);
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    const bool none_local = t % 8 == 5;
    for (int64_t k = 0; k < c.k; ++k) {
      in.ids.push_back(none_local || not_local(rng) ? -1 : slots[k]);
      in.weights.push_back(weight(rng));
    }
    if (c.shared > 0) in.mask.push_back(coin(rng) ? 1 : 0);
  }
  return in;
}

class ExpertsSweepTest : public testing::TestWithParam<SweepCase> {};

TEST_P(ExpertsSweepTest, MatchesNaiveDoubleFormulation) {
  const SweepCase& c = GetParam();
  Rng rng(std::hash<std::string>{}(c.name));
  TestModel m{c.hidden, c.inter, c.format, c.layout, ParamsFor(c.act, c.bias ? 0 : 1), {}, {}};
  for (int64_t e = 0; e < c.experts; ++e) m.experts.push_back(RandomExpert(m, c.bias, rng));
  for (int s = 0; s < c.shared; ++s) m.shared.push_back(RandomExpert(m, c.bias, rng));
  const ExpertLayer layer = m.Layer();
  ASSERT_TRUE(ValidateExpertLayer(layer).ok()) << ValidateExpertLayer(layer);

  TestInputs in = RandomInputs(c, rng);
  ASSERT_TRUE(RunExpertsReference(layer, in.Request()).ok());
  const std::vector<double> want = NaiveLayer(m, in);

  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff2 += (in.Out(i) - want[i]) * (in.Out(i) - want[i]);
    ref2 += want[i] * want[i];
  }
  // Tokens without a local route or a shared-expert mark must come back exactly zero.
  for (int64_t t = 0; t < c.tokens; ++t) {
    bool touched = !in.mask.empty() && in.mask[t];
    for (int64_t k = 0; k < c.k; ++k) touched |= in.ids[t * c.k + k] >= 0;
    if (touched) continue;
    for (int64_t n = 0; n < c.hidden; ++n) ASSERT_EQ(in.Out(t * c.hidden + n), 0.0) << t;
  }
  if (ref2 == 0) {
    EXPECT_EQ(diff2, 0);
    return;
  }
  const double tolerance = c.out_dtype == DType::kF32 ? 1e-5 : 1e-2;
  EXPECT_LE(std::sqrt(diff2 / ref2), tolerance);
  if (c.out_dtype == DType::kBF16) {
    EXPECT_GT(std::sqrt(diff2 / ref2), 0);  // the output really is rounded
  }
}

constexpr WeightFormat kMx = WeightFormat::kMxfp4;
constexpr WeightFormat kNv = WeightFormat::kNvfp4;
constexpr WeightFormat kBf = WeightFormat::kBf16;
constexpr GateUpLayout kInter = GateUpLayout::kInterleaved;
constexpr GateUpLayout kConcat = GateUpLayout::kConcatenated;
constexpr DType kF = DType::kF32;
constexpr DType kB = DType::kBF16;

// Shapes: token counts, expert counts, top-k, the gpt-oss hidden size and odd multiples of 32.
std::vector<SweepCase> ShapeCases() {
  using A = ActivationKind;
  return {
      {"GptOssFull", kMx, kInter, A::kSwigluOai, 1, 1, 1, 2880, 2880, true, 0, kB, kB},
      {"Nvfp4Full", kNv, kConcat, A::kSilu, 3, 1, 1, 2880, 2880, false, 0, kF, kF},
      {"WideHidden", kNv, kConcat, A::kSilu, 17, 4, 2, 2880, 160, true, 1, kF, kF},
      {"WideHiddenMx", kMx, kInter, A::kGelu, 64, 7, 4, 2880, 96, false, 0, kB, kF},
      {"WideHiddenBf16", kBf, kConcat, A::kSitu, 3, 4, 4, 2880, 64, true, 2, kF, kB},
      {"WideInter", kMx, kConcat, A::kGeluTanh, 3, 4, 2, 96, 2880, true, 1, kF, kF},
      {"NoTokens", kMx, kInter, A::kSilu, 0, 4, 2, 96, 160, true, 1, kF, kF},
      {"NoTokensBf16", kNv, kConcat, A::kSilu, 0, 1, 1, 96, 160, false, 0, kB, kB},
      {"OneToken", kNv, kInter, A::kSwigluOai, 1, 7, 4, 96, 160, true, 0, kF, kF},
      {"ManyTokensTopOne", kBf, kInter, A::kSilu, 64, 7, 1, 160, 96, false, 1, kB, kF},
      {"ManyTokensTopFour", kNv, kConcat, A::kGelu, 64, 4, 4, 96, 160, true, 2, kF, kF},
      {"SeventeenTokens", kMx, kConcat, A::kSitu, 17, 7, 2, 224, 96, false, 1, kF, kB},
      {"SingleExpert", kMx, kInter, A::kGeluTanh, 17, 1, 1, 96, 160, true, 0, kB, kB},
  };
}

// Every format x layout x activation, the other axes cycling through these shapes.
std::vector<SweepCase> ComboCases() {
  return sweep::ComboCases({{3, 4, 2, 96, 160}, {17, 7, 4, 160, 96}, {1, 1, 1, 32, 32},
                            {64, 4, 1, 64, 224}, {17, 4, 4, 96, 96}, {3, 7, 2, 224, 32}});
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExpertsSweepTest, testing::ValuesIn(ShapeCases()),
                         sweep::SweepCaseName);
INSTANTIATE_TEST_SUITE_P(Combos, ExpertsSweepTest, testing::ValuesIn(ComboCases()),
                         sweep::SweepCaseName);

// ---- Hand-derived cases ----------------------------------------------------------------------

// MXFP4, concatenated, SILU, H = I = 32, x = 1/32 everywhere.
// Expert 0: gate rows 1.0 (code 2, scale 127), up rows 2.0 (code 2, scale 128), w2 -0.5 (code 9,
//   scale 127), b2 = 1: g = 1, u = 2, y = 1 + 32 * -0.5 * 2 silu(1) = 1 - 32 * 0.7310585786300049.
// Expert 1: w13 all zero, b13 gate 2 / up 3, w2 0.5 (code 2, scale 126):
//   a = silu(2) * 3 = 3 * 2 / (1 + e^-2), y = 32 * 0.5 * a.
TEST(ExpertsHandTest, Mxfp4SiluConcatenated) {
  TestModel m{32, 32, kMx, kConcat, ParamsFor(ActivationKind::kSilu, 0), {}, {}};
  OwnedExpert e0{UniformMatrix(kMx, 64, 32, 2, 127), UniformMatrix(kMx, 32, 32, 9, 127)};
  std::fill(e0.w13.scales.begin() + 32, e0.w13.scales.end(), 128);  // up rows [32, 64)
  e0.b2.assign(32, 1.f);
  OwnedExpert e1{UniformMatrix(kMx, 64, 32, 0, 127), UniformMatrix(kMx, 32, 32, 2, 126)};
  e1.b13.assign(64, 3.f);
  std::fill(e1.b13.begin(), e1.b13.begin() + 32, 2.f);
  m.experts = {e0, e1};
  const ExpertLayer layer = m.Layer();
  ASSERT_TRUE(ValidateExpertLayer(layer).ok());

  TestInputs in{3, 2, 32, kF, kF};
  in.SetHidden(std::vector<double>(3 * 32, 1.0 / 32));
  in.ids = {0, 1, -1, 1, -1, -1};
  in.weights = {0.25f, 0.5f, 7.f, 2.f, 3.f, 4.f};
  ASSERT_TRUE(RunExpertsReference(layer, in.Request()).ok());
  const double y0 = -22.393874516160157;
  const double y1 = 84.5565194858767;
  for (int n = 0; n < 32; ++n) {
    EXPECT_NEAR(in.Out(n), 0.25 * y0 + 0.5 * y1, 1e-4) << n;  // 36.67979111389831
    EXPECT_NEAR(in.Out(32 + n), 2 * y1, 1e-4) << n;           // 169.1130389717534
    EXPECT_EQ(in.Out(64 + n), 0.0) << n;
  }
}

// NVFP4, interleaved, SWIGLUOAI, H = 32, I = 16, x = 1/8 everywhere, codes 1.0 (2) and 1.5 (3).
// Gate rows (even) E4M3 scale 1.0 (0x38), global 0.25: g = 32 * 1/8 * 0.25 = 1.
// Up rows (odd) scale 0.5 (0x30), global 1.5: u = 32 * 1/8 * 0.5 * 1.5 = 3 (both inside the limit).
// a = (3 + 1) * 1 * sigmoid(1.702); w2 = 1.5 * 2.0 (0x40) * 0.125 = 0.375, y = 16 * 0.375 * a
//   = 24 * sigmoid(1.702) = 20.29909838238771. Reading the rows as concatenated would mix scales.
// The same expert is also the shared expert, added with weight 1 for the masked token.
TEST(ExpertsHandTest, Nvfp4SwigluInterleavedWithSharedExpert) {
  TestModel m{32, 16, kNv, kInter, ParamsFor(ActivationKind::kSwigluOai, 0), {}, {}};
  m.activation.limit = 7.f;
  OwnedExpert e{UniformMatrix(kNv, 32, 32, 2, 0x38), UniformMatrix(kNv, 32, 16, 3, 0x40)};
  for (int row = 1; row < 32; row += 2) {
    e.w13.scales[row * 2] = e.w13.scales[row * 2 + 1] = 0x30;
  }
  e.gate_scale = 0.25f;
  e.up_scale = 1.5f;
  e.w2_scale = 0.125f;
  m.experts = {e};
  m.shared = {e};
  const ExpertLayer layer = m.Layer();
  ASSERT_TRUE(ValidateExpertLayer(layer).ok());

  TestInputs in{2, 1, 32, kB, kF};
  in.SetHidden(std::vector<double>(2 * 32, 0.125));
  in.ids = {0, -1};
  in.weights = {0.5f, 1.f};
  in.mask = {1, 1};
  ASSERT_TRUE(RunExpertsReference(layer, in.Request()).ok());
  const double y = 20.29909838238771;
  for (int n = 0; n < 32; ++n) {
    EXPECT_NEAR(in.Out(n), 1.5 * y, 1e-4) << n;
    EXPECT_NEAR(in.Out(32 + n), y, 1e-4) << n;
  }
}

// The BF16 output is the fp32 sum rounded once, not a BF16 accumulator rounded per route.
TEST(ExpertsHandTest, Bf16OutputRoundsOnce) {
  TestModel m{32, 32, kBf, kConcat, ParamsFor(ActivationKind::kSilu, 0), {}, {}};
  // All weights 2^-5 (BF16 0x3D00), x = 1: g = u = 1, each expert gives silu(1) = 0.731 + b2.
  OwnedExpert e0{UniformMatrix(kBf, 64, 32, 0x3D00, 0), UniformMatrix(kBf, 32, 32, 0x3D00, 0)};
  OwnedExpert e1 = e0;
  e0.b2.assign(32, 256.f);
  m.experts = {e0, e1};
  TestInputs in{1, 3, 32, kF, kB};
  in.SetHidden(std::vector<double>(32, 1.0));
  in.ids = {0, 1, 1};
  in.weights = {1.f, 1.f, 1.f};
  ASSERT_TRUE(RunExpertsReference(m.Layer(), in.Request()).ok());
  // fp32 sum = 256 + 3 * 0.731 = 258.19 -> 258 (BF16 spacing 2 above 256). A BF16 accumulator
  // would round 256.73 back to 256 after every route and end at 256.
  for (int n = 0; n < 32; ++n) EXPECT_EQ(in.Out(n), 258.0) << n;
}

// ---- INVALID_ARGUMENT paths -------------------------------------------------------------------

// A valid MXFP4 layer with two experts and one shared expert, H = I = 32.
TestModel SmallModel(WeightFormat f = kMx) {
  TestModel m{32, 32, f, kConcat, ParamsFor(ActivationKind::kSilu, 0), {}, {}};
  Rng rng(7);
  for (int e = 0; e < 2; ++e) m.experts.push_back(RandomExpert(m, true, rng));
  m.shared.push_back(RandomExpert(m, false, rng));
  return m;
}

TestInputs SmallInputs() {
  TestInputs in{3, 2, 32, kF, kF};
  in.SetHidden(std::vector<double>(3 * 32, 0.5));
  in.ids = {0, 1, -1, 1, -1, -1};
  in.weights = {0.5f, 0.5f, 0.f, 1.f, 0.f, 0.f};
  in.mask = {1, 0, 1};
  return in;
}

TEST(ExpertsValidationTest, SmallModelIsValid) {
  TestModel m = SmallModel();
  TestInputs in = SmallInputs();
  EXPECT_TRUE(ValidateExpertLayer(m.Layer()).ok());
  EXPECT_TRUE(ValidateExpertsRequest(m.Layer(), in.Request()).ok());
  EXPECT_TRUE(RunExpertsReference(m.Layer(), in.Request()).ok());
  EXPECT_TRUE(ValidateExpertLayer(SmallModel(kNv).Layer()).ok());
  EXPECT_TRUE(ValidateExpertLayer(SmallModel(kBf).Layer()).ok());
}

using Model = TestModel;
using Layer = ExpertLayer;
using In = TestInputs;
using Req = ExpertsRequest;

struct LayerMutation {
  std::string name;
  WeightFormat format;
  void (*mutate)(TestModel&, ExpertLayer&);
};

void PrintTo(const LayerMutation& m, std::ostream* os) { *os << m.name; }

class ExpertLayerErrorTest : public testing::TestWithParam<LayerMutation> {};

TEST_P(ExpertLayerErrorTest, IsInvalidArgument) {
  TestModel m = SmallModel(GetParam().format);
  ExpertLayer layer = m.Layer();
  GetParam().mutate(m, layer);
  EXPECT_EQ(ValidateExpertLayer(layer).code(), absl::StatusCode::kInvalidArgument);
}

const LayerMutation kLayerMutations[] = {
    {"ZeroHidden", kMx, [](Model&, Layer& l) { l.hidden = 0; }},
    {"W13RowsMismatch", kMx, [](Model&, Layer& l) { l.intermediate = 64; }},
    {"W2ShapeMismatch", kMx,
     [](Model& m, Layer& l) {
       m.experts[1].w2 = UniformMatrix(kMx, 32, 64, 2, 127);
       l.experts[1] = m.experts[1].View();
     }},
    {"W13TensorTooSmall", kMx,
     [](Model&, Layer& l) {
       l.experts[0].w13.values.shape = Shape{63, 16};
     }},
    {"FormatDiffersFromLayer", kMx, [](Model&, Layer& l) { l.format = WeightFormat::kNvfp4; }},
    {"GlobalScaleOnMxfp4", kMx, [](Model&, Layer& l) { l.experts[0].w13_up_global_scale = 2.f; }},
    {"GlobalScaleOnBf16", kBf, [](Model&, Layer& l) { l.experts[1].w2_global_scale = 0.5f; }},
    {"NanGlobalScaleNvfp4", kNv,
     [](Model&, Layer& l) { l.experts[0].w13_gate_global_scale = kNan; }},
    {"InfGlobalScaleNvfp4", kNv,
     [](Model&, Layer& l) { l.shared_experts[0].w2_global_scale = kInf; }},
    {"B13WrongLength", kMx,
     [](Model& m, Layer& l) {
       l.experts[0].b13 = MakeView(DType::kF32, {63}, m.experts[0].b13.data());
     }},
    {"B2WrongLength", kMx,
     [](Model& m, Layer& l) {
       l.experts[1].b2 = MakeView(DType::kF32, {33}, m.experts[1].b2.data());
     }},
    {"B2WrongDtype", kMx,
     [](Model& m, Layer& l) {
       l.experts[1].b2 = MakeView(DType::kBF16, {32}, m.experts[1].b2.data());
     }},
    {"NanScaleByte", kMx, [](Model& m, Layer&) { m.experts[0].w2.scales[5] = 255; }},
    {"InvalidActivation", kMx,
     [](Model&, Layer& l) {
       l.activation.kind = ActivationKind::kSwigluOai;
       l.activation.limit = 0.f;
     }},
    {"BadSharedExpert", kMx, [](Model&, Layer& l) { l.shared_experts[0].w2.cols = 16; }},
};

INSTANTIATE_TEST_SUITE_P(All, ExpertLayerErrorTest, testing::ValuesIn(kLayerMutations),
                         [](const testing::TestParamInfo<LayerMutation>& i) {
                           return i.param.name;
                         });

struct RequestMutation {
  std::string name;
  void (*mutate)(TestInputs&, ExpertsRequest&);
};

void PrintTo(const RequestMutation& m, std::ostream* os) { *os << m.name; }

class ExpertsRequestErrorTest : public testing::TestWithParam<RequestMutation> {};

TEST_P(ExpertsRequestErrorTest, IsInvalidArgument) {
  TestModel m = SmallModel();
  const ExpertLayer layer = m.Layer();
  TestInputs in = SmallInputs();
  ExpertsRequest request = in.Request();
  GetParam().mutate(in, request);
  EXPECT_EQ(ValidateExpertsRequest(layer, request).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunExpertsReference(layer, request).code(), absl::StatusCode::kInvalidArgument);
}

const RequestMutation kRequestMutations[] = {
    {"HiddenI32", [](In&, Req& r) { r.hidden_states.dtype = DType::kI32; }},
    {"HiddenWrongWidth",
     [](In&, Req& r) {
       r.hidden_states.shape = Shape{3, 16};
     }},
    {"HiddenRankOne", [](In&, Req& r) { r.hidden_states.shape = Shape{96}; }},
    {"HiddenNullData", [](In&, Req& r) { r.hidden_states.data = nullptr; }},
    {"IdsI64", [](In&, Req& r) { r.local_ids.dtype = DType::kI64; }},
    {"IdsFewerTokens",
     [](In&, Req& r) {
       r.local_ids.shape = Shape{2, 2};
     }},
    {"WeightsOtherK",
     [](In&, Req& r) {
       r.topk_weights.shape = Shape{3, 1};
     }},
    {"WeightsOtherTokens",
     [](In&, Req& r) {
       r.topk_weights.shape = Shape{2, 2};
     }},
    {"WeightsBf16", [](In&, Req& r) { r.topk_weights.dtype = DType::kBF16; }},
    {"IdEqualsExpertCount", [](In& in, Req&) { in.ids[3] = 2; }},
    {"IdBelowMinusOne", [](In& in, Req&) { in.ids[0] = -2; }},
    {"NanWeight", [](In& in, Req&) { in.weights[1] = kNan; }},
    {"InfWeight", [](In& in, Req&) { in.weights[0] = kInf; }},
    {"MinusInfWeightOnUnroutedSlot", [](In& in, Req&) { in.weights[5] = -kInf; }},
    {"OutNarrow",
     [](In&, Req& r) {
       r.out.shape = Shape{3, 16};
     }},
    {"OutOtherTokens",
     [](In&, Req& r) {
       r.out.shape = Shape{4, 32};
     }},
    {"OutI32", [](In&, Req& r) { r.out.dtype = DType::kI32; }},
    {"MaskU8", [](In&, Req& r) { r.shared_mask.dtype = DType::kU8; }},
    {"MaskShort", [](In&, Req& r) { r.shared_mask.shape = Shape{2}; }},
    {"MaskNotBool", [](In& in, Req&) { in.mask[2] = 2; }},
};

INSTANTIATE_TEST_SUITE_P(All, ExpertsRequestErrorTest, testing::ValuesIn(kRequestMutations),
                         [](const testing::TestParamInfo<RequestMutation>& i) {
                           return i.param.name;
                         });

}  // namespace
}  // namespace moe
