// Hand-derived cases for the baseline-ISA pieces of the CPU backend: activation quantization,
// the weighted combine (including BF16 rounding), BF16 widening, the gated-activation epilogue
// and the work-splitting heuristics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/activation.h"
#include "kernels/cpu/combine.h"
#include "kernels/cpu/cpu_heuristics.h"
#include "kernels/cpu/fp4_gemm.h"
#include "kernels/cpu/gated_activation.h"
#include "kernels/cpu/quantize_rows.h"

namespace moe::cpu {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

TEST(QuantizeRowsTest, Int16PerBlock) {
  // Block 0: max 2 -> scale 2/16383; 2 -> 16383, -1 -> -8191.5 -> -8192 (ties to even),
  // 0.5 -> 4095.75 -> 4096. Block 1: all zero.
  std::vector<float> x(64, 0.f);
  x[0] = 2.f;
  x[1] = -1.f;
  x[31] = 0.5f;
  std::vector<int16_t> q(64, 7);
  float scales[2];
  QuantizeRowInt16(x.data(), 64, 32, q.data(), scales);
  EXPECT_EQ(scales[0], 2.f / 16383);
  EXPECT_EQ(scales[1], 0.f);
  EXPECT_EQ(q[0], 16383);
  EXPECT_EQ(q[1], -8192);
  EXPECT_EQ(q[31], 4096);
  for (int i = 2; i < 31; ++i) EXPECT_EQ(q[i], 0) << i;
  for (int i = 32; i < 64; ++i) EXPECT_EQ(q[i], 0) << i;
}

TEST(QuantizeRowsTest, NonFiniteBlocksGetNanScale) {
  std::vector<float> x(48, 1.f);
  x[3] = kNan;
  x[40] = -std::numeric_limits<float>::infinity();
  std::vector<int16_t> q(48, 7);
  float scales[3];
  QuantizeRowInt16(x.data(), 48, 16, q.data(), scales);
  EXPECT_TRUE(std::isnan(scales[0]));
  EXPECT_EQ(scales[1], 1.f / 16383);
  EXPECT_TRUE(std::isnan(scales[2]));
  EXPECT_EQ(q[0], 0);
  EXPECT_EQ(q[16], 16383);
  EXPECT_EQ(q[47], 0);
}

TEST(QuantizeRowsTest, Int8WithBlockSums) {
  // max 1 -> scale 1/127: 1 -> 127, -0.5 -> -63.5 -> -64, 0.25 -> 31.75 -> 32; in column order.
  std::vector<float> x(16, 0.f);
  x[0] = 1.f;
  x[9] = -0.5f;
  x[15] = 0.25f;
  std::vector<int8_t> q(16, 7);
  float scale;
  int32_t bias;
  QuantizeRowInt8(x.data(), 16, 16, q.data(), &scale, &bias);
  EXPECT_EQ(scale, 1.f / 127);
  std::vector<int8_t> want(16, 0);
  want[0] = 127;
  want[9] = -64;
  want[15] = 32;
  EXPECT_EQ(q, want);
  EXPECT_EQ(bias, kInt8WeightBias * (127 - 64 + 32));
}

TEST(QuantizeRowsTest, Bf16Inputs) {
  // BF16 0x4000 = 2, 0xBF80 = -1, 0x3F00 = 0.5.
  std::vector<uint16_t> x(32, 0);
  x[0] = 0x4000;
  x[1] = 0xBF80;
  x[31] = 0x3F00;
  std::vector<int16_t> q(32);
  float scale;
  QuantizeBf16RowInt16(x.data(), 32, 32, q.data(), &scale);
  EXPECT_EQ(scale, 2.f / 16383);
  EXPECT_EQ(q[0], 16383);
  EXPECT_EQ(q[1], -8192);
  EXPECT_EQ(q[31], 4096);
  std::vector<float> wide(11);
  std::vector<uint16_t> eleven(11, 0x3F80);  // 1.0
  eleven[10] = 0xC040;                       // -3.0, in the scalar tail
  Bf16RowToFloat(eleven.data(), 11, wide.data());
  EXPECT_EQ(wide[0], 1.f);
  EXPECT_EQ(wide[9], 1.f);
  EXPECT_EQ(wide[10], -3.f);
}

TEST(CombineTest, WeightedSumInSlotOrderThenShared) {
  // hidden 9 (one vector and a scalar tail); routes 0..3 hold rows filled with r + 1.
  const int64_t hidden = 9;
  std::vector<float> y(4 * hidden);
  for (int r = 0; r < 4; ++r) std::fill(&y[r * hidden], &y[(r + 1) * hidden], r + 1.f);
  // token 0: 0.5 * route 2 + 0.25 * route 0 + shared route 3; token 1: nothing routed here.
  const std::vector<int32_t> route_of = {2, 0, -1, -1};
  const std::vector<float> weights = {0.5f, 0.25f, 9.f, 9.f};
  const std::vector<int32_t> shared = {3, -1};
  std::vector<float> out(2 * hidden, kNan);
  CombineParams p;
  p.expert_out = y.data();
  p.hidden = hidden;
  p.tokens = 2;
  p.top_k = 2;
  p.route_of = route_of.data();
  p.weights = weights.data();
  p.shared = 1;
  p.shared_route_of = shared.data();
  p.out_f32 = out.data();
  CombineRoutes(p, 0, 2);
  CombineRoutes(p, 1, 2);
  for (int n = 0; n < hidden; ++n) {
    EXPECT_EQ(out[n], 0.5f * 3 + 0.25f * 1 + 4.f) << n;  // 5.75
    EXPECT_EQ(out[hidden + n], 0.f) << n;
  }
}

TEST(CombineTest, Bf16OutputRoundsToNearestEven) {
  // 1 + 3 * 2^-9 -> 1 + 2^-7 (0x3F81); 1 + 2^-8 is a tie -> 1 (0x3F80); 3 + 2^-7 is a tie
  // between 3 (0x4040) and 3 + 2^-6 (0x4041) -> the even 0x4040; NaN -> 0x7FC0.
  const float values[] = {1.f + 3.f / 512, 1.f + 1.f / 256, 3.f + 1.f / 128, kNan};
  const uint16_t want[] = {0x3F81, 0x3F80, 0x4040, 0x7FC0};
  for (int64_t hidden : {int64_t{4}, int64_t{8}}) {  // scalar tail and vector paths
    std::vector<float> y(hidden);
    for (int64_t i = 0; i < hidden; ++i) y[i] = values[i % 4];
    const int32_t route_of = 0;
    const float weight = 1.f;
    std::vector<uint16_t> out(hidden, 0);
    CombineParams p;
    p.expert_out = y.data();
    p.hidden = hidden;
    p.tokens = 1;
    p.top_k = 1;
    p.route_of = &route_of;
    p.weights = &weight;
    p.out_bf16 = out.data();
    CombineRoutes(p, 0, 1);
    for (int64_t i = 0; i < hidden; ++i) EXPECT_EQ(out[i], want[i % 4]) << hidden << " " << i;
  }
}

TEST(GatedActivationTest, MatchesTheReferenceFormulas) {
  ActivationParams params;
  params.kind = ActivationKind::kSwigluOai;
  const float gate[] = {-3.f, 0.5f, 9.f}, up[] = {1.f, -8.f, 2.f};
  float out[3];
  GatedActivation(&params, gate, up, 3, out);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i], ApplyActivation(params, gate[i], up[i])) << i;
}

TEST(HeuristicsTest, EvenSplitAndPanelCols) {
  int64_t covered = 0;
  for (int i = 0; i < 3; ++i) {
    const Range r = EvenSplit(10, i, 3);
    EXPECT_EQ(r.begin, covered);
    covered = r.end;
  }
  EXPECT_EQ(covered, 10);
  EXPECT_EQ(PanelCols(2880, 32), 512);
  EXPECT_EQ(PanelCols(96, 16), 96);
  EXPECT_EQ(PanelCols(528, 16), 512);
}

TEST(HeuristicsTest, PlanCoversEveryUnitOnceInOrderAndBalances) {
  // Routes per expert 3, 0, 40, 1, 5 (prefix sums below); 7 units each.
  const std::vector<int64_t> route_begin = {0, 3, 3, 43, 44, 49};
  const auto unit_cost = [&](int e) {
    return 1.0 + 0.2 * static_cast<double>(route_begin[e + 1] - route_begin[e]);
  };
  for (int pieces : {1, 2, 3, 8, 64}) {
    GemmPlan plan;
    plan.next = 5;
    PlanGemm(route_begin, 7, pieces, &plan);
    EXPECT_EQ(plan.next, 0);
    std::vector<std::vector<int>> hits(5, std::vector<int>(7, 0));
    double total = 0, largest = 0;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const GemmWorkItem& item = plan.items[i];
      if (i > 0) {  // expert order, then unit order
        const GemmWorkItem& prev = plan.items[i - 1];
        EXPECT_TRUE(prev.expert < item.expert ||
                    (prev.expert == item.expert && prev.end == item.begin));
      }
      const int64_t routes = route_begin[item.expert + 1] - route_begin[item.expert];
      EXPECT_EQ(item.panel, routes > kStreamMaxRoutes);
      for (int64_t u = item.begin; u < item.end; ++u) ++hits[item.expert][u];
      const double cost = (item.end - item.begin) * unit_cost(item.expert);
      total += cost;
      largest = std::max(largest, cost);
    }
    for (int e = 0; e < 5; ++e) {
      for (int u = 0; u < 7; ++u) EXPECT_EQ(hits[e][u], e == 1 ? 0 : 1) << e << "," << u;
    }
    // Each item is at most one piece plus one unit of the costliest expert (9 = 1 + 0.2 * 40),
    // and a piece only splits where an expert ends.
    EXPECT_LE(largest, total / pieces + 9.0) << pieces;
    EXPECT_LE(plan.items.size(), static_cast<size_t>(pieces + 3)) << pieces;
  }
}

}  // namespace
}  // namespace moe::cpu
