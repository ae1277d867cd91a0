#include "kernels/activation.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

// Independent double-precision formulas straight from numerics.md section 6.
double SigmoidD(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double ReferenceAct(const ActivationParams& p, double g, double u) {
  switch (p.kind) {
    case ActivationKind::kSilu:
      return g * SigmoidD(g) * u;
    case ActivationKind::kSwigluOai: {
      const double limit = p.limit;
      g = std::min(g, limit);
      u = std::max(-limit, std::min(u, limit));
      return (u + 1.0) * g * SigmoidD(static_cast<double>(p.alpha) * g);
    }
    case ActivationKind::kSitu: {
      const double beta = p.beta, lb = p.linear_beta;
      const double up = lb > 0 ? lb * std::tanh(u / lb) : u;
      return beta * std::tanh(g / beta) * SigmoidD(g) * up;
    }
    case ActivationKind::kGelu:
      return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
    case ActivationKind::kGeluTanh: {
      const double c = std::sqrt(2.0 / M_PI);
      return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g))) * u;
    }
  }
  return std::nan("");
}

// fp32 evaluation of exp/tanh/erf: a few ulps relative, plus a tiny absolute floor for results
// that cancel to near zero.
void ExpectClose(float actual, double expected, const char* what) {
  EXPECT_NEAR(actual, expected, 4e-6 * std::abs(expected) + 1e-12) << what;
}

// For sweeps: GELU's (1 + erf) and (1 + tanh) cancel for negative gates, so fp32 loses up to an
// ulp of 1 (1.2e-7) times 0.5 |g u| in absolute terms there.
double SweepTolerance(double expected, float g, float u) {
  return 4e-6 * std::abs(expected) + 1.2e-7 * std::abs(static_cast<double>(g) * u) + 1e-9;
}

ActivationParams Params(ActivationKind kind) {
  ActivationParams p;
  p.kind = kind;
  return p;
}

TEST(ActivationNameTest, RoundTrips) {
  struct Case {
    ActivationKind kind;
    const char* name;
  };
  const Case cases[] = {{ActivationKind::kSilu, "silu"},
                        {ActivationKind::kSwigluOai, "swigluoai"},
                        {ActivationKind::kSitu, "situ"},
                        {ActivationKind::kGelu, "gelu"},
                        {ActivationKind::kGeluTanh, "gelu_tanh"}};
  for (const Case& c : cases) {
    EXPECT_EQ(ActivationKindName(c.kind), c.name);
    auto parsed = ParseActivationKind(c.name);
    ASSERT_TRUE(parsed.ok()) << c.name;
    EXPECT_EQ(*parsed, c.kind);
  }
  for (const char* bad : {"", "SILU", "swiglu", "gelu-tanh", "relu"}) {
    EXPECT_EQ(ParseActivationKind(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

struct HandCase {
  ActivationParams params;
  float gate, up;
  double expected;
  const char* what;
};

ActivationParams Situ(float beta, float linear_beta) {
  ActivationParams p = Params(ActivationKind::kSitu);
  p.beta = beta;
  p.linear_beta = linear_beta;
  return p;
}

TEST(ApplyActivationTest, HandComputedValues) {
  const ActivationParams silu = Params(ActivationKind::kSilu);
  const ActivationParams oai = Params(ActivationKind::kSwigluOai);  // alpha 1.702, limit 7
  const ActivationParams gelu = Params(ActivationKind::kGelu);
  const ActivationParams gelu_tanh = Params(ActivationKind::kGeluTanh);
  const HandCase cases[] = {
      // 1 / (1 + e^-1) * 2 = 2 / 1.3678794411714423 = 1.4621171572600098
      {silu, 1.f, 2.f, 1.4621171572600098, "silu(1)*2"},
      // -2 / (1 + e^2) * 3 = -6 / 8.38905609893065 = -0.7152175321327052
      {silu, -2.f, 3.f, -0.7152175321327052, "silu(-2)*3"},
      {silu, 0.f, 5.f, 0.0, "silu(0)*5"},
      // (0.5 + 1) * 1 * sigmoid(1.702) = 1.5 * 0.8457957659... = 1.268693648899232
      {oai, 1.f, 0.5f, 1.268693648899232, "swigluoai inside the limit"},
      // (-0.25 + 1) * -0.5 * sigmoid(-0.851) = -0.375 * 0.29922312... = -0.11220867254521491
      {oai, -0.5f, -0.25f, -0.11220867254521491, "swigluoai negative gate"},
      // gate 10 -> 7, up -9 -> -7: (-7 + 1) * 7 * sigmoid(11.914) = -41.99971876981991
      {oai, 10.f, -9.f, -41.99971876981991, "swigluoai both clamped"},
      // gate 7 and up 7 sit exactly on the limit: (7 + 1) * 7 * sigmoid(11.914) = 55.99962502642654
      {oai, 7.f, 7.f, 55.99962502642654, "swigluoai at the limit"},
      {oai, 1e6f, 1e6f, 55.99962502642654, "swigluoai far above the limit"},
      // The gate has no lower clamp: (0.5 + 1) * -10 * sigmoid(-17.02) = -6.086941942282968e-07
      {oai, -10.f, 0.5f, -6.086941942282968e-07, "swigluoai gate not clamped below"},
      // beta 1, linear_beta 0 (u passes through): tanh(0.5) * sigmoid(0.5) * 2
      //   = 0.46211715726 * 0.62245933120 * 2 = 0.5752982732899359
      {Situ(1.f, 0.f), 0.5f, 2.f, 0.5752982732899359, "situ u passed through"},
      // beta 2, linear_beta 3: 2 tanh(0.5) * sigmoid(1) * 3 tanh(4/3)
      //   = 0.92423431452 * 0.73105857863 * 2.61021960452 = 1.763622186270071
      {Situ(2.f, 3.f), 1.f, 4.f, 1.763622186270071, "situ with linear_beta"},
      // 0.5 * 1 * (1 + erf(1/sqrt 2)) * 1 = Phi(1) = 0.8413447460685429
      {gelu, 1.f, 1.f, 0.8413447460685429, "gelu(1)"},
      // 0.5 * -1 * (1 + erf(-1/sqrt 2)) * 2 = -Phi(-1) * 2 = -0.31731050786291415
      {gelu, -1.f, 2.f, -0.31731050786291415, "gelu(-1)*2"},
      // 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)) = 0.8411919906082768
      {gelu_tanh, 1.f, 1.f, 0.8411919906082768, "gelu_tanh(1)"},
      // 0.5 * 2 * (1 + tanh(sqrt(2/pi) * (2 + 0.044715 * 8))) * -1 = -1.954597694087775
      {gelu_tanh, 2.f, -1.f, -1.954597694087775, "gelu_tanh(2)*-1"},
  };
  for (const HandCase& c : cases) {
    ExpectClose(ApplyActivation(c.params, c.gate, c.up), c.expected, c.what);
    // The test's own double formula agrees with the hand value (guards the table); 2e-8 covers
    // the float alpha 1.702f against the hand values' exact 1.702.
    EXPECT_NEAR(ReferenceAct(c.params, c.gate, c.up), c.expected,
                1e-12 + 2e-8 * std::abs(c.expected))
        << c.what;
  }
}

TEST(ApplyActivationTest, SwigluOaiClampIsFlatBeyondLimit) {
  ActivationParams p = Params(ActivationKind::kSwigluOai);
  p.limit = 3.f;
  p.alpha = 1.f;
  // Anything above the limit behaves like the limit itself, for gate and for up.
  EXPECT_EQ(ApplyActivation(p, 3.5f, 1.f), ApplyActivation(p, 3.f, 1.f));
  EXPECT_EQ(ApplyActivation(p, 1.f, 100.f), ApplyActivation(p, 1.f, 3.f));
  EXPECT_EQ(ApplyActivation(p, 1.f, -100.f), ApplyActivation(p, 1.f, -3.f));
  // (u + 1) with u clamped to -3: (-2) * 1 * sigmoid(1) = -1.4621171572600098
  ExpectClose(ApplyActivation(p, 1.f, -50.f), -1.4621171572600098, "up clamped below");
  // Just inside the limit the value still moves.
  EXPECT_NE(ApplyActivation(p, 2.99f, 1.f), ApplyActivation(p, 3.f, 1.f));
}

TEST(ApplyActivationTest, SweepAgainstDoubleFormulas) {
  const ActivationKind kinds[] = {ActivationKind::kSilu, ActivationKind::kSwigluOai,
                                  ActivationKind::kSitu, ActivationKind::kGelu,
                                  ActivationKind::kGeluTanh};
  for (ActivationKind kind : kinds) {
    ActivationParams p = Params(kind);
    if (kind == ActivationKind::kSitu) p = Situ(1.5f, 2.f);
    for (float g = -9.f; g <= 9.f; g += 0.375f) {
      for (float u = -9.f; u <= 9.f; u += 1.125f) {
        const double expected = ReferenceAct(p, g, u);
        EXPECT_NEAR(ApplyActivation(p, g, u), expected, SweepTolerance(expected, g, u))
            << ActivationKindName(kind) << " g=" << g << " u=" << u;
      }
    }
  }
}

std::vector<float> LayoutRow(GateUpLayout layout, const std::vector<float>& gate,
                             const std::vector<float>& up) {
  const size_t inter = gate.size();
  std::vector<float> h(2 * inter);
  for (size_t j = 0; j < inter; ++j) {
    if (layout == GateUpLayout::kInterleaved) {
      h[2 * j] = gate[j];
      h[2 * j + 1] = up[j];
    } else {
      h[j] = gate[j];
      h[inter + j] = up[j];
    }
  }
  return h;
}

TEST(ApplyActivationRowTest, BothLayouts) {
  const std::vector<float> gate = {1.f, 10.f, -0.5f, 7.f, 0.f};
  const std::vector<float> up = {0.5f, -9.f, -0.25f, 7.f, 3.f};
  // swigluoai with defaults, values from HandComputedValues; gate 0 gives 0.
  const double expected[] = {1.268693648899232, -41.99971876981991, -0.11220867254521491,
                             55.99962502642654, 0.0};
  const ActivationParams p = Params(ActivationKind::kSwigluOai);
  for (GateUpLayout layout : {GateUpLayout::kInterleaved, GateUpLayout::kConcatenated}) {
    const std::vector<float> h = LayoutRow(layout, gate, up);
    std::vector<float> out(gate.size(), -123.f);
    ApplyActivationRow(p, layout, h.data(), static_cast<int64_t>(gate.size()), out.data());
    for (size_t j = 0; j < gate.size(); ++j) {
      ExpectClose(out[j], expected[j],
                  layout == GateUpLayout::kInterleaved ? "interleaved" : "concatenated");
    }
  }
}

TEST(ApplyActivationRowTest, EveryKindMatchesScalarForm) {
  const std::vector<float> gate = {-3.f, -1.25f, 0.f, 0.75f, 2.5f, 8.f};
  const std::vector<float> up = {2.f, -0.5f, 1.f, -4.f, 0.25f, -8.f};
  for (ActivationKind kind :
       {ActivationKind::kSilu, ActivationKind::kSwigluOai, ActivationKind::kSitu,
        ActivationKind::kGelu, ActivationKind::kGeluTanh}) {
    ActivationParams p = Params(kind);
    if (kind == ActivationKind::kSitu) p = Situ(0.5f, 1.f);
    for (GateUpLayout layout : {GateUpLayout::kInterleaved, GateUpLayout::kConcatenated}) {
      const std::vector<float> h = LayoutRow(layout, gate, up);
      std::vector<float> out(gate.size());
      ApplyActivationRow(p, layout, h.data(), static_cast<int64_t>(gate.size()), out.data());
      for (size_t j = 0; j < gate.size(); ++j) {
        const double expected = ReferenceAct(p, gate[j], up[j]);
        EXPECT_NEAR(out[j], expected, SweepTolerance(expected, gate[j], up[j]))
            << ActivationKindName(kind) << " j=" << j;
      }
    }
  }
}

TEST(GateUpRowTest, Indices) {
  // I = 4: interleaved gate 2 -> row 4, up 2 -> row 5; concatenated gate 2 -> 2, up 2 -> 6.
  EXPECT_EQ(GateRow(GateUpLayout::kInterleaved, 2, 4), 4);
  EXPECT_EQ(UpRow(GateUpLayout::kInterleaved, 2, 4), 5);
  EXPECT_EQ(GateRow(GateUpLayout::kConcatenated, 2, 4), 2);
  EXPECT_EQ(UpRow(GateUpLayout::kConcatenated, 2, 4), 6);
}

TEST(ValidateActivationTest, AcceptsDefaultsAndValidSitu) {
  for (ActivationKind kind :
       {ActivationKind::kSilu, ActivationKind::kSwigluOai, ActivationKind::kSitu,
        ActivationKind::kGelu, ActivationKind::kGeluTanh}) {
    EXPECT_TRUE(ValidateActivation(Params(kind)).ok()) << ActivationKindName(kind);
  }
  EXPECT_TRUE(ValidateActivation(Situ(0.25f, 2.f)).ok());
  // limit only matters to swigluoai, beta only to situ.
  ActivationParams silu = Params(ActivationKind::kSilu);
  silu.limit = -1.f;
  silu.beta = 0.f;
  EXPECT_TRUE(ValidateActivation(silu).ok());
}

TEST(ValidateActivationTest, RejectsInvalidParameters) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::pair<ActivationParams, const char*>> bad;
  auto add = [&bad](ActivationKind kind, float alpha, float limit, float beta, float lb,
                    const char* what) {
    ActivationParams p = Params(kind);
    p.alpha = alpha;
    p.limit = limit;
    p.beta = beta;
    p.linear_beta = lb;
    bad.emplace_back(p, what);
  };
  add(ActivationKind::kSwigluOai, 1.702f, 0.f, 1.f, 0.f, "limit 0");
  add(ActivationKind::kSwigluOai, 1.702f, -7.f, 1.f, 0.f, "negative limit");
  add(ActivationKind::kSwigluOai, 1.702f, inf, 1.f, 0.f, "infinite limit");
  add(ActivationKind::kSwigluOai, nan, 7.f, 1.f, 0.f, "NaN alpha");
  add(ActivationKind::kSitu, 1.702f, 7.f, 0.f, 0.f, "beta 0");
  add(ActivationKind::kSitu, 1.702f, 7.f, -1.f, 0.f, "negative beta");
  add(ActivationKind::kSitu, 1.702f, 7.f, 1.f, -0.5f, "negative linear_beta");
  add(ActivationKind::kSitu, 1.702f, 7.f, nan, 0.f, "NaN beta");
  add(ActivationKind::kSitu, 1.702f, 7.f, 1.f, inf, "infinite linear_beta");
  add(ActivationKind::kSilu, -inf, 7.f, 1.f, 0.f, "non-finite alpha on silu");
  for (const auto& [p, what] : bad) {
    EXPECT_EQ(ValidateActivation(p).code(), absl::StatusCode::kInvalidArgument) << what;
  }
}

}  // namespace
}  // namespace moe
