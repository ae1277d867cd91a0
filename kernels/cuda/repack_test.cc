// The fragment layout and the repacking, checked on the CPU: every packed E2M1 code must decode
// (the device's rotate/mask/scale-multiply steps, emulated here in exact float arithmetic) to the
// value DequantizeRows gives for the source row and column the layout assigns to it.
#include "kernels/cuda/repack.h"

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/fp4_fragment.h"
#include "kernels/formats.h"

namespace moe::cuda {
namespace {

float Bf16BitsToFloat(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(FragmentLayoutTest, PackedBitsTileTheWord) {
  std::set<int> used;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 4; ++q) used.insert(PackedBitPosition(j, h, q));
  EXPECT_EQ(used.size(), 32u);
}

// UnpackFragmentWord's shifts equal the rotate-and-mask definition (MagRotation, SignRotation)
// for every word: no bit a register keeps wraps around, so the packing and the device decode agree.
TEST(FragmentLayoutTest, ShiftDecodeEqualsRotations) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t w = i < 32 ? 1u << i : static_cast<uint32_t>(rng());
    uint32_t regs[4];
    UnpackFragmentWord(w, regs);
    for (int j = 0; j < 4; ++j) {
      const uint32_t want = (RotateRight(w, MagRotation(j)) & kMagMask) |
                            (RotateRight(w, SignRotation(j)) & kSignMask);
      ASSERT_EQ(regs[j], want) << "word " << w << " reg " << j;
    }
  }
}

// Each code in each of the 8 places unpacks to sign << 15 | magnitude << 6 in its half, and that
// bf16 is the E2M1 value times 2^-126 (0.5 becomes the subnormal 2^-127).
TEST(FragmentLayoutTest, EveryCodeInEveryPlaceDecodes) {
  const float kE2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (int place = 0; place < 8; ++place) {
    for (int code = 0; code < 16; ++code) {
      uint8_t codes[8] = {};
      codes[place] = static_cast<uint8_t>(code);
      uint32_t regs[4];
      UnpackFragmentWord(PackFragmentWord(codes), regs);
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 2; ++h) {
          const uint32_t half = (regs[j] >> (16 * h)) & 0xFFFFu;
          const uint32_t want =
              2 * j + h == place ? ((code & 8u) << 12) | ((code & 7u) << 6) : 0u;
          ASSERT_EQ(half, want) << "place " << place << " code " << code << " reg " << j;
        }
      }
      const float value =
          Bf16BitsToFloat((regs[place / 2] >> (16 * (place % 2))) & 0xFFFFu) * std::ldexp(1.f, 126);
      const float expect = (code & 8) ? -kE2m1[code & 7] : kE2m1[code & 7];
      EXPECT_EQ(value, expect) << "code " << code;
      EXPECT_EQ(value, E2m1ToFloat(static_cast<uint8_t>(code)));
    }
  }
}

TEST(FragmentLayoutTest, FragmentCoordinatesFollowTheMmaLayout) {
  // PTX m16n8k16 A fragment: reg0 (g, 2t..), reg1 (g+8, 2t..), reg2 (g, 2t+8..), reg3 (g+8, 2t+8..).
  EXPECT_EQ(FragmentRow(0, 3), 3);
  EXPECT_EQ(FragmentRow(1, 3), 11);
  EXPECT_EQ(FragmentRow(2, 3), 3);
  EXPECT_EQ(FragmentRow(3, 3), 11);
  EXPECT_EQ(FragmentK(0, 0, 2), 4);
  EXPECT_EQ(FragmentK(0, 1, 2), 5);
  EXPECT_EQ(FragmentK(1, 1, 2), 5);
  EXPECT_EQ(FragmentK(2, 0, 2), 12);
  EXPECT_EQ(FragmentK(3, 1, 3), 15);
}

TEST(FragmentLayoutTest, ActivationPermutationIsTheBFragmentOrder) {
  std::set<int> seen;
  for (int k = 0; k < 64; ++k) {
    const int pos = ActPermIndex(k);
    ASSERT_GE(pos, 0);
    ASSERT_LT(pos, 64);
    seen.insert(pos);
    EXPECT_EQ(ActPermSource(pos), k);
  }
  EXPECT_EQ(seen.size(), 64u);
  // Lane t's registers for k-step s: b0 = (16s + 2t, +1) at 16t + 4s, b1 = (16s + 2t + 8, +9).
  for (int t = 0; t < 4; ++t) {
    for (int s = 0; s < 4; ++s) {
      EXPECT_EQ(ActPermIndex(16 * s + 2 * t), 16 * t + 4 * s);
      EXPECT_EQ(ActPermIndex(16 * s + 2 * t + 1), 16 * t + 4 * s + 1);
      EXPECT_EQ(ActPermIndex(16 * s + 2 * t + 8), 16 * t + 4 * s + 2);
      EXPECT_EQ(ActPermIndex(16 * s + 2 * t + 9), 16 * t + 4 * s + 3);
    }
  }
}

TEST(FragmentLayoutTest, ScalePairs) {
  EXPECT_EQ(MxScalePair(0x00007F00u, 1), 0x3F803F80u);  // byte 127 -> 1.0 in both halves
  EXPECT_EQ(MxScalePair(0x00007F00u, 0), 0u);
  EXPECT_EQ(MxScalePair(0x80000000u, 3), 0x40004000u);  // 128 -> 2.0
  EXPECT_EQ(MxScaleByte(0, 0), 0);
  EXPECT_EQ(MxScaleByte(3, 0), 1);
  EXPECT_EQ(MxScaleByte(1, 1), 2);
  EXPECT_EQ(MxScaleByte(2, 1), 3);
  EXPECT_EQ(NvScalePair(0x40003F80u, 0), 0x3F803F80u);
  EXPECT_EQ(NvScalePair(0x40003F80u, 1), 0x40004000u);
}

TEST(RepackTest, ShapesOfTheReferenceProblem) {
  const PackedShape w13 = W13PackedShape(2880, 2880);
  EXPECT_EQ(w13.tiles, 360);
  EXPECT_EQ(w13.chunks, 45);
  const PackedShape w2 = W2PackedShape(2880, 2880);
  EXPECT_EQ(w2.tiles, 180);
  EXPECT_EQ(w2.chunks, 45);
  EXPECT_EQ(W2PackedShape(336, 208).tiles, 21);
  EXPECT_EQ(W2PackedShape(336, 208).chunks, 4);
  EXPECT_EQ(w13.scale_words(WeightFormat::kMxfp4) * 4, w13.scale_words(WeightFormat::kNvfp4));
}

struct RandomMatrix {
  WeightMatrix w;
  std::vector<uint8_t> values;
  std::vector<uint8_t> scales;
};

RandomMatrix MakeMatrix(WeightFormat format, int64_t rows, int64_t cols, int scale_lo,
                        int scale_hi, std::mt19937& rng) {
  RandomMatrix m;
  const int64_t block = format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  m.values.resize(rows * cols / 2);
  m.scales.resize(rows * cols / block);
  std::uniform_int_distribution<int> byte(0, 255), scale(scale_lo, scale_hi);
  for (uint8_t& v : m.values) v = static_cast<uint8_t>(byte(rng));
  for (uint8_t& s : m.scales) s = static_cast<uint8_t>(scale(rng));
  m.w.format = format;
  m.w.rows = rows;
  m.w.cols = cols;
  m.w.values = MakeView(DType::kU8, {rows, cols / 2}, m.values.data());
  m.w.scales = MakeView(format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3,
                        {rows, cols / block}, m.scales.data());
  return m;
}

// Emulates the device decode of every packed element and compares it with DequantizeRows at
// the source (row, k) that `source_row` and the fragment layout assign to it.
template <typename RowFn>
void ExpectPackedMatches(const RandomMatrix& m, const PackedShape& shape,
                         const std::vector<uint32_t>& values, const std::vector<uint32_t>& scales,
                         const PackedScaleInfo& info, RowFn source_row) {
  std::vector<float> dense(m.w.rows * m.w.cols);
  DequantizeRows(m.w, 0, m.w.rows, 1.f, dense.data());
  const bool mx = m.w.format == WeightFormat::kMxfp4;
  int64_t checked = 0;
  for (int64_t tile = 0; tile < shape.tiles; ++tile) {
    for (int64_t chunk = 0; chunk < shape.chunks; ++chunk) {
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int step = 0; step < 4; ++step) {
          uint32_t raw[4];
          UnpackFragmentWord(values[((tile * shape.chunks + chunk) * 32 + lane) * 4 + step], raw);
          for (int j = 0; j < 4; ++j) {
            const int row8 = j & 1;
            const int64_t sbase = (tile * shape.chunks + chunk) * 8 + g;
            const uint32_t pair = mx ? MxScalePair(scales[sbase], MxScaleByte(step, row8))
                                     : NvScalePair(scales[sbase * 4 + step], row8);
            for (int h = 0; h < 2; ++h) {
              const float a = Bf16BitsToFloat((raw[j] >> (16 * h)) & 0xFFFFu) *
                              Bf16BitsToFloat((pair >> (16 * h)) & 0xFFFFu);
              const int64_t row = source_row(tile, FragmentRow(j, g));
              const int64_t k = chunk * 64 + step * 16 + FragmentK(j, h, t);
              const float want = row >= 0 && k < m.w.cols ? dense[row * m.w.cols + k] : 0.f;
              ASSERT_EQ(a * info.epilogue_factor, want)
                  << "tile " << tile << " chunk " << chunk << " lane " << lane << " step "
                  << step << " reg " << j << " half " << h;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, shape.tiles * shape.chunks * 64 * 16);
}

struct PackCase {
  WeightFormat format;
  GateUpLayout layout;
  int64_t hidden;
  int64_t inter;
  int scale_lo;  // UE8M0 byte range (MXFP4) or E4M3 byte range (NVFP4)
  int scale_hi;
};

class RepackMatrixTest : public ::testing::TestWithParam<PackCase> {};

TEST_P(RepackMatrixTest, W13AndW2DecodeToTheSourceValues) {
  const PackCase c = GetParam();
  std::mt19937 rng(std::random_device{}());
  const RandomMatrix w13 = MakeMatrix(c.format, 2 * c.inter, c.hidden, c.scale_lo, c.scale_hi, rng);
  const RandomMatrix w2 = MakeMatrix(c.format, c.hidden, c.inter, c.scale_lo, c.scale_hi, rng);

  const PackedShape s13 = W13PackedShape(c.hidden, c.inter);
  std::vector<uint32_t> v13(s13.value_words()), c13(s13.scale_words(c.format));
  PackedScaleInfo i13;
  ASSERT_TRUE(PackW13(w13.w, c.layout, absl::MakeSpan(v13), absl::MakeSpan(c13), &i13).ok());
  const int64_t inter = c.inter;
  const GateUpLayout layout = c.layout;
  ExpectPackedMatches(w13, s13, v13, c13, i13, [&](int64_t tile, int r) -> int64_t {
    const int64_t j = 8 * tile + (r % 8);  // tile rows 0..7 gate j, 8..15 up j
    if (layout == GateUpLayout::kInterleaved) return r < 8 ? 2 * j : 2 * j + 1;
    return r < 8 ? j : inter + j;
  });

  const PackedShape s2 = W2PackedShape(c.hidden, c.inter);
  std::vector<uint32_t> v2(s2.value_words()), c2(s2.scale_words(c.format));
  PackedScaleInfo i2;
  ASSERT_TRUE(PackW2(w2.w, absl::MakeSpan(v2), absl::MakeSpan(c2), &i2).ok());
  const int64_t hidden = c.hidden;
  ExpectPackedMatches(w2, s2, v2, c2, i2, [&](int64_t tile, int r) -> int64_t {
    const int64_t row = 16 * tile + r;
    return row < hidden ? row : -1;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Formats, RepackMatrixTest,
    ::testing::Values(
        PackCase{WeightFormat::kMxfp4, GateUpLayout::kInterleaved, 128, 64, 118, 126},
        PackCase{WeightFormat::kMxfp4, GateUpLayout::kConcatenated, 96, 32, 100, 128},
        // Scale bytes above 128 need an exponent shift.
        PackCase{WeightFormat::kMxfp4, GateUpLayout::kInterleaved, 160, 96, 120, 140},
        PackCase{WeightFormat::kMxfp4, GateUpLayout::kConcatenated, 64, 16, 1, 10},
        // NVFP4: every E4M3 byte but NaN (0x7F, 0xFF are excluded by the range), subnormals too.
        PackCase{WeightFormat::kNvfp4, GateUpLayout::kConcatenated, 80, 48, 0, 126},
        PackCase{WeightFormat::kNvfp4, GateUpLayout::kInterleaved, 336, 208, 0x80, 0xFE}));

TEST(RepackTest, RejectsBf16AndWrongSizes) {
  std::mt19937 rng(1);
  RandomMatrix m = MakeMatrix(WeightFormat::kMxfp4, 32, 64, 120, 125, rng);
  std::vector<uint32_t> v(10), s(10);
  PackedScaleInfo info;
  EXPECT_FALSE(PackW2(m.w, absl::MakeSpan(v), absl::MakeSpan(s), &info).ok());
  m.w.format = WeightFormat::kBf16;
  const PackedShape shape = W2PackedShape(32, 64);
  std::vector<uint32_t> v2(shape.value_words()), s2(shape.scale_words(WeightFormat::kMxfp4));
  EXPECT_FALSE(PackW2(m.w, absl::MakeSpan(v2), absl::MakeSpan(s2), &info).ok());
}

}  // namespace
}  // namespace moe::cuda
