// The packed layout against the source matrix: every nibble, scale, row scale and bias lands where
// fp4_pack.h says, for both pairings and both gate/up layouts. (That the kernels decode this
// layout correctly is fp4_gemm_test's job.)
#include "kernels/cpu/fp4_pack.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace moe::cpu {
namespace {

struct Source {
  std::vector<uint8_t> values;
  std::vector<uint8_t> scales;
  WeightMatrix w;
};

Source RandomSource(WeightFormat f, int64_t rows, int64_t cols, uint64_t seed) {
  const int64_t block = f == WeightFormat::kMxfp4 ? 32 : 16;
  Source s;
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < rows * cols / 2; ++i) s.values.push_back(rng() & 0xFF);
  for (int64_t i = 0; i < rows * cols / block; ++i) s.scales.push_back(100 + rng() % 40);
  s.w = WeightMatrix{f, rows, cols, MakeView(DType::kU8, {rows, cols / 2}, s.values.data()),
                     MakeView(f == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3,
                              {rows, cols / block}, s.scales.data())};
  return s;
}

uint8_t SourceCode(const Source& s, int64_t row, int64_t k) {
  const uint8_t byte = s.values[row * (s.w.cols / 2) + k / 2];
  return k % 2 == 0 ? byte & 0xF : byte >> 4;
}

TEST(Fp4PackTest, SourceRowsOfGateUpPairing) {
  const GateUpLayout kInter = GateUpLayout::kInterleaved, kConcat = GateUpLayout::kConcatenated;
  // 32 rows: I = 16, groups 0 and 1; packed row p = 16 g + i, gate j = 8 g + i % 8.
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kInter, 32, 0), 0);  // gate 0
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 0), 0);
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kInter, 32, 8), 1);  // up 0
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 8), 16);
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kInter, 32, 17), 18);  // gate 9
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 17), 9);
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kInter, 32, 31), 31);  // up 15
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 31), 31);
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 23), 15);  // gate 15
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kInter, 32, 25), 19);   // up 9
  EXPECT_EQ(SourceRow(RowPairing::kGateUp, kConcat, 32, 25), 25);
  EXPECT_EQ(SourceRow(RowPairing::kPlain, kInter, 32, 23), 23);
}

struct PackCase {
  WeightFormat format;
  RowPairing pairing;
  GateUpLayout layout;
  int64_t rows, cols;
};

class Fp4PackCaseTest : public testing::TestWithParam<PackCase> {};

TEST_P(Fp4PackCaseTest, EveryElementScaleAndBiasLandsInPlace) {
  const PackCase& c = GetParam();
  const Source s = RandomSource(c.format, c.rows, c.cols, c.rows * 7 + c.cols);
  std::vector<float> bias(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) bias[r] = 0.5f * r - 3;
  absl::StatusOr<PackedFp4Matrix> m =
      PackFp4Matrix(s.w, c.pairing, c.layout, 2.f, 3.f, bias.data());
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t block = c.format == WeightFormat::kMxfp4 ? 32 : 16;
  const Fp4MatrixRef ref = m->ref();
  EXPECT_EQ(ref.groups, c.rows / 16);
  EXPECT_EQ(ref.block, block);
  EXPECT_EQ(ref.nvfp4, c.format == WeightFormat::kNvfp4);
  EXPECT_EQ(m->codes.size(), static_cast<size_t>(c.rows * c.cols / 2));
  for (int64_t p = 0; p < c.rows; ++p) {
    const int64_t src = SourceRow(c.pairing, c.layout, c.rows, p);
    for (int64_t k = 0; k < c.cols; ++k) {
      ASSERT_EQ(PackedCode(*m, p, k), SourceCode(s, src, k)) << p << "," << k;
    }
    for (int64_t b = 0; b < c.cols / block; ++b) {
      ASSERT_EQ(ref.scales[((p / 16) * (c.cols / block) + b) * 16 + p % 16],
                s.scales[src * (c.cols / block) + b]);
    }
    const bool first = c.pairing == RowPairing::kPlain || p % 16 < 8;
    EXPECT_EQ(ref.row_scale[p], (first ? 2.f : 3.f) / 512);
    EXPECT_EQ(ref.bias[p], bias[src]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Fp4PackCaseTest,
    testing::Values(
        PackCase{WeightFormat::kMxfp4, RowPairing::kPlain, GateUpLayout::kInterleaved, 32, 64},
        PackCase{WeightFormat::kMxfp4, RowPairing::kGateUp, GateUpLayout::kInterleaved, 48, 96},
        PackCase{WeightFormat::kMxfp4, RowPairing::kGateUp, GateUpLayout::kConcatenated, 32, 32},
        PackCase{WeightFormat::kNvfp4, RowPairing::kGateUp, GateUpLayout::kConcatenated, 64, 48},
        PackCase{WeightFormat::kNvfp4, RowPairing::kPlain, GateUpLayout::kConcatenated, 16, 16}));

TEST(Fp4PackTest, NoBiasAndInvalidShapes) {
  const Source s = RandomSource(WeightFormat::kMxfp4, 16, 32, 1);
  absl::StatusOr<PackedFp4Matrix> m =
      PackFp4Matrix(s.w, RowPairing::kPlain, GateUpLayout::kInterleaved, 1.f, 1.f, nullptr);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->ref().bias, nullptr);

  const Source odd = RandomSource(WeightFormat::kMxfp4, 24, 32, 2);
  EXPECT_EQ(PackFp4Matrix(odd.w, RowPairing::kPlain, GateUpLayout::kInterleaved, 1.f, 1.f, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint16_t> bf16(16 * 32);
  const WeightMatrix w{
      WeightFormat::kBf16, 16, 32, MakeView(DType::kBF16, {16, 32}, bf16.data()), {}};
  EXPECT_EQ(PackFp4Matrix(w, RowPairing::kPlain, GateUpLayout::kInterleaved, 1.f, 1.f, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::cpu
