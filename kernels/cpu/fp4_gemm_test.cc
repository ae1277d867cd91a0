// The FP4 GEMM kernels of every instruction set this processor has, against a double-precision
// product of the dequantized weights (formats.h) with the dequantized activations the kernels
// were given: the block sums are exact integers, so only the per-block fp32 scaling rounds.
// Covers both paths (streaming and panel, int16 and int8 activations), several panels per row,
// partial register tiles, both epilogues, biases, NVFP4 global scales and split work items.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_heuristics.h"
#include "kernels/cpu/fp4_pack.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize_rows.h"
#include "kernels/cpu/random_layer.h"
#include "kernels/cpu/thread_pool.h"

namespace moe::cpu {
namespace {

std::vector<CpuIsa> IsasHere() {
  std::vector<CpuIsa> isas;
  const CpuFeatures f = DetectCpuFeatures();
  for (const char* name : {"avx2", "avx512", "avx512vnni"}) {
    if (absl::StatusOr<CpuIsa> isa = ChooseIsa(name, f); isa.ok()) isas.push_back(*isa);
  }
  return isas;
}

// Routes per expert: 2 (streaming), 0, 9 and 5 (panel, with partial tiles).
const std::vector<int64_t> kRoutes = {2, 0, 9, 5};
constexpr int64_t kTokens = 7;

struct Problem {
  WeightFormat format;
  int64_t rows, cols;
  RowPairing pairing;
  OwnedLayer owner;
  std::vector<WeightMatrix> source;
  std::vector<PackedFp4Matrix> packed;
  std::vector<Fp4MatrixRef> refs;
  std::vector<std::vector<float>> dense;  // dequantized source rows
  std::vector<float> bias;
  std::vector<int64_t> route_begin{0};
  std::vector<int32_t> input_row;
  int block = 32;
  // Activations, both precisions.
  std::vector<int16_t> q16;
  std::vector<float> s16;
  std::vector<int8_t> q8;
  std::vector<float> s8;
  std::vector<int32_t> b8;

  Problem(WeightFormat f, int64_t r, int64_t c, RowPairing p)
      : format(f), rows(r), cols(c), pairing(p) {
    block = f == WeightFormat::kMxfp4 ? 32 : 16;
    std::mt19937_64 rng(r * 131 + c);
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < rows; ++i) bias.push_back(normal(rng));
    for (size_t e = 0; e < kRoutes.size(); ++e) {
      source.push_back(RandomMatrix(f, rows, cols, 50 + e, owner));
      dense.emplace_back(rows * cols);
      DequantizeRows(source.back(), 0, rows, 1.f, dense.back().data());
      packed.push_back(*PackFp4Matrix(source.back(), pairing, GateUpLayout::kInterleaved, 0.75f,
                                      1.25f, bias.data()));
      refs.push_back(packed.back().ref());
      route_begin.push_back(route_begin.back() + kRoutes[e]);
      for (int64_t i = 0; i < kRoutes[e]; ++i) input_row.push_back((e * 3 + i) % kTokens);
    }
    const int64_t blocks = cols / block;
    q16.resize(kTokens * cols);
    s16.resize(kTokens * blocks);
    q8.resize(kTokens * cols);
    s8.resize(kTokens * blocks);
    b8.resize(kTokens * blocks);
    std::vector<float> x(cols);
    for (int64_t t = 0; t < kTokens; ++t) {
      for (float& v : x) v = normal(rng);
      QuantizeRowInt16(x.data(), cols, block, &q16[t * cols], &s16[t * blocks]);
      QuantizeRowInt8(x.data(), cols, block, &q8[t * cols], &s8[t * blocks], &b8[t * blocks]);
    }
  }

  // Value of packed row p for route r, in double, from the quantized activations.
  double Expected(int64_t e, int64_t r, int64_t p, bool int8, double* magnitude) const {
    const int64_t src = SourceRow(pairing, GateUpLayout::kInterleaved, rows, p);
    const int64_t t = input_row[r];
    double sum = 0, abs_sum = 0;
    for (int64_t k = 0; k < cols; ++k) {
      const double x = int8 ? q8[t * cols + k] * double(s8[t * (cols / block) + k / block])
                            : q16[t * cols + k] * double(s16[t * (cols / block) + k / block]);
      sum += dense[e][src * cols + k] * x;
      abs_sum += std::fabs(dense[e][src * cols + k] * x);
    }
    const double global = pairing == RowPairing::kPlain || p % 16 < 8 ? 0.75 : 1.25;
    *magnitude = abs_sum * global;
    return sum * global + bias[src];
  }
};

// act(gate, up) = 2 gate - up, enough to see that gate and up rows are paired correctly.
void TestGated(const void*, const float* gate, const float* up, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = 2 * gate[i] - up[i];
}

// Runs the kernel on two pool threads with every expert's groups split in two work items.
std::vector<float> RunKernel(const Problem& pb, CpuIsa isa, bool int8, bool force_panel,
                             Fp4Epilogue epilogue) {
  const int64_t groups = pb.rows / kGroupRows;
  std::vector<GemmWorkItem> items;
  for (size_t e = 0; e < kRoutes.size(); ++e) {
    if (kRoutes[e] == 0) continue;
    const bool panel = force_panel || kRoutes[e] > kStreamMaxRoutes;
    items.push_back({static_cast<int32_t>(e), panel, 0, groups / 2});
    items.push_back({static_cast<int32_t>(e), panel, groups / 2, groups});
  }
  const int64_t panel_cols = PanelCols(pb.cols, pb.block);
  std::vector<AlignedVector<int16_t>> panels(2, AlignedVector<int16_t>(panel_cols * 16));
  std::vector<std::vector<float>> panel_scales(2, std::vector<float>(panel_cols));
  std::vector<std::vector<float>> acc(2, std::vector<float>(16 * 9));
  std::vector<Fp4Scratch> scratch;
  for (int i = 0; i < 2; ++i)
    scratch.push_back({panels[i].data(), panel_scales[i].data(), acc[i].data()});
  const int64_t out_cols = epilogue == Fp4Epilogue::kStore ? pb.rows : pb.rows / 2;
  std::vector<float> out(pb.route_begin.back() * out_cols, std::nanf(""));
  Fp4GemmParams p;
  p.experts = pb.refs.data();
  p.route_begin = pb.route_begin.data();
  p.input_row = pb.input_row.data();
  p.input = pb.q16.data();
  p.input_stride = pb.cols;
  p.input_scales = pb.s16.data();
  p.input_scale_stride = pb.cols / pb.block;
  if (int8) {
    p.input8 = pb.q8.data();
    p.input8_scales = pb.s8.data();
    p.input8_bias = pb.b8.data();
  }
  p.out = out.data();
  p.out_stride = out_cols;
  p.epilogue = epilogue;
  p.gated_fn = &TestGated;
  int32_t next = 0;
  p.items = items.data();
  p.num_items = static_cast<int32_t>(items.size());
  p.next_item = &next;
  p.scratch = scratch.data();
  p.panel_cols = panel_cols;
  const Fp4GemmFn kernel = KernelsFor(isa).fp4_gemm;
  ThreadPool pool(2);
  pool.ParallelFor(2, [&](int i, int) { kernel(p, i); });
  EXPECT_EQ(next, static_cast<int32_t>(items.size()) + 2);  // every item claimed once
  return out;
}

struct GemmCase {
  std::string name;
  WeightFormat format;
  int64_t rows, cols;
};

class Fp4GemmTest : public testing::TestWithParam<GemmCase> {};

TEST_P(Fp4GemmTest, StoreMatchesDoubleProduct) {
  const GemmCase& c = GetParam();
  const Problem pb(c.format, c.rows, c.cols, RowPairing::kPlain);
  for (CpuIsa isa : IsasHere()) {
    for (bool int8 : {false, true}) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)) + (int8 ? " int8" : " int16"));
      const std::vector<float> out = RunKernel(pb, isa, int8, false, Fp4Epilogue::kStore);
      for (size_t e = 0; e < kRoutes.size(); ++e) {
        const bool panel8 = int8 && kRoutes[e] > kStreamMaxRoutes;
        for (int64_t r = pb.route_begin[e]; r < pb.route_begin[e + 1]; ++r) {
          for (int64_t p = 0; p < c.rows; ++p) {
            double magnitude;
            const double want = pb.Expected(e, r, p, panel8, &magnitude);
            ASSERT_NEAR(out[r * c.rows + p], want, 1e-5 * magnitude + 1e-6)
                << "expert " << e << " route " << r << " row " << p;
          }
        }
      }
    }
  }
}

TEST_P(Fp4GemmTest, GatedEpiloguePairsGateAndUpRows) {
  const GemmCase& c = GetParam();
  const Problem pb(c.format, c.rows, c.cols, RowPairing::kGateUp);
  for (CpuIsa isa : IsasHere()) {
    SCOPED_TRACE(CpuIsaName(isa));
    const std::vector<float> out = RunKernel(pb, isa, false, false, Fp4Epilogue::kGated);
    for (size_t e = 0; e < kRoutes.size(); ++e) {
      for (int64_t r = pb.route_begin[e]; r < pb.route_begin[e + 1]; ++r) {
        for (int64_t j = 0; j < c.rows / 2; ++j) {
          const int64_t gate_row = j / 8 * 16 + j % 8;  // packed rows of gate j and up j
          double m1, m2;
          const double want = 2 * pb.Expected(e, r, gate_row, false, &m1) -
                              pb.Expected(e, r, gate_row + 8, false, &m2);
          ASSERT_NEAR(out[r * (c.rows / 2) + j], want, 1e-5 * (2 * m1 + m2) + 1e-6)
              << "expert " << e << " route " << r << " j " << j;
        }
      }
    }
  }
}

// The streaming and panel paths round at the same points: identical bits.
TEST_P(Fp4GemmTest, StreamingAndPanelPathsAgreeBitForBit) {
  const GemmCase& c = GetParam();
  const Problem pb(c.format, c.rows, c.cols, RowPairing::kPlain);
  for (CpuIsa isa : IsasHere()) {
    const std::vector<float> mixed = RunKernel(pb, isa, false, false, Fp4Epilogue::kStore);
    const std::vector<float> panel = RunKernel(pb, isa, false, true, Fp4Epilogue::kStore);
    EXPECT_EQ(mixed, panel) << CpuIsaName(isa);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Fp4GemmTest,
    testing::Values(GemmCase{"Mxfp4Small", WeightFormat::kMxfp4, 48, 96},
                    GemmCase{"Nvfp4OddBlocks", WeightFormat::kNvfp4, 32, 80},
                    GemmCase{"Mxfp4ThreePanels", WeightFormat::kMxfp4, 32, 1056},
                    GemmCase{"Nvfp4TwoPanels", WeightFormat::kNvfp4, 16, 528}),
    [](const testing::TestParamInfo<GemmCase>& info) { return info.param.name; });

}  // namespace
}  // namespace moe::cpu
