#include "kernels/formats.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- E2M1 ---------------------------------------------------------------------------------------

// The 16 E2M1 codes, written out by hand from numerics.md section 1.
constexpr float kE2m1Table[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                  -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

TEST(E2m1Test, DecodesAllCodes) {
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(E2m1ToFloat(code), kE2m1Table[code]) << code;
    EXPECT_EQ(std::signbit(E2m1ToFloat(code)), code >= 8) << code;
    // The high nibble is ignored.
    EXPECT_EQ(E2m1ToFloat(0xA0 | code), kE2m1Table[code]) << code;
  }
}

TEST(E2m1Test, EncodesEveryGridValueToItsCode) {
  for (int code = 0; code < 16; ++code) {
    const int expected = code == 8 ? 0 : code;  // -0.0 is the canonical code 0
    EXPECT_EQ(FloatToE2m1(kE2m1Table[code]), expected) << code;
  }
}

TEST(E2m1Test, RoundsHandVectors) {
  struct Case {
    float x;
    uint8_t code;
  };
  const Case cases[] = {
      {0.25f, 0x0}, {0.2500001f, 0x1}, {0.74f, 0x1}, {0.75f, 0x2}, {1.25f, 0x2},  {1.26f, 0x3},
      {1.75f, 0x4}, {2.5f, 0x4},       {2.51f, 0x5}, {3.49f, 0x5}, {3.5f, 0x6},   {5.f, 0x6},
      {5.01f, 0x7}, {6.5f, 0x7},       {1e30f, 0x7}, {kInf, 0x7},  {-0.75f, 0xA}, {-1.75f, 0xC},
      {-5.f, 0xE},  {-7.f, 0xF},       {-kInf, 0xF}, {-0.f, 0x0},  {-0.1f, 0x0},  {-0.25f, 0x0},
      {kNan, 0x0},  {1e-30f, 0x0},
  };
  for (const Case& c : cases) EXPECT_EQ(FloatToE2m1(c.x), c.code) << c.x;
}

TEST(E2m1Test, MidpointsGoToEvenCodeAndNeighboursToNearest) {
  for (int lo = 0; lo < 7; ++lo) {
    const float a = kE2m1Table[lo];
    const float b = kE2m1Table[lo + 1];
    const float mid = (a + b) / 2;
    const int even = lo % 2 == 0 ? lo : lo + 1;
    EXPECT_EQ(FloatToE2m1(mid), even) << mid;
    EXPECT_EQ(FloatToE2m1(-mid), even == 0 ? 0 : (8 | even)) << -mid;
    EXPECT_EQ(FloatToE2m1(std::nextafter(mid, 100.f)), lo + 1) << mid;
    EXPECT_EQ(FloatToE2m1(std::nextafter(mid, -100.f)), lo) << mid;
  }
}

// ---- E4M3 ---------------------------------------------------------------------------------------

// Value of an E4M3fn code from its bit fields, in double: s eeee mmm, bias 7.
double E4m3Reference(int bits) {
  const int s = bits >> 7;
  const int e = (bits >> 3) & 0xF;
  const int m = bits & 0x7;
  const double magnitude =
      e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -magnitude : magnitude;
}

bool IsE4m3Nan(int bits) { return bits == 0x7F || bits == 0xFF; }

TEST(E4m3Test, DecodesAllCodes) {
  for (int bits = 0; bits < 256; ++bits) {
    const float v = E4m3ToFloat(bits);
    if (IsE4m3Nan(bits)) {
      EXPECT_TRUE(std::isnan(v)) << bits;
    } else {
      EXPECT_EQ(v, static_cast<float>(E4m3Reference(bits))) << bits;
      EXPECT_EQ(std::signbit(v), bits >= 0x80) << bits;
    }
  }
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0.001953125f);  // 2^-9
  EXPECT_EQ(E4m3ToFloat(0x08), 0.015625f);     // 2^-6
  EXPECT_EQ(E4m3ToFloat(0x38), 1.f);
}

TEST(E4m3Test, RoundTripsAllCodes) {
  for (int bits = 0; bits < 256; ++bits) {
    if (IsE4m3Nan(bits)) continue;
    EXPECT_EQ(FloatToE4m3(static_cast<float>(E4m3Reference(bits))), bits) << bits;
  }
}

TEST(E4m3Test, MidpointsRoundToEvenAndNeighboursToNearest) {
  for (int lo = 0; lo < 0x7E; ++lo) {
    const double mid = (E4m3Reference(lo) + E4m3Reference(lo + 1)) / 2;
    const float m = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(m), mid);  // midpoints need at most 5 significant bits
    const int even = lo % 2 == 0 ? lo : lo + 1;
    EXPECT_EQ(FloatToE4m3(m), even) << mid;
    EXPECT_EQ(FloatToE4m3(-m), 0x80 | even) << mid;
    EXPECT_EQ(FloatToE4m3(std::nextafter(m, kInf)), lo + 1) << mid;
    EXPECT_EQ(FloatToE4m3(std::nextafter(m, 0.f)), lo) << mid;
  }
}

TEST(E4m3Test, HandVectors) {
  struct Case {
    float x;
    uint8_t bits;
  };
  const Case cases[] = {
      {1.0625f, 0x38},         // between 1 (0x38) and 1.125 (0x39): tie to even
      {1.1875f, 0x3A},         // between 1.125 and 1.25 (0x3A): tie to even
      {0.001953125f, 0x01},    // 2^-9, the smallest subnormal
      {0.0009765625f, 0x00},   // 2^-10: tie between 0 and 2^-9, even is 0
      {0.00048828125f, 0x00},  // 2^-11
      {0.0029296875f, 0x02},   // 1.5 * 2^-9: tie between codes 1 and 2
      {0.0146484375f, 0x08},   // 7.5 * 2^-9: tie between 0x07 and 2^-6 (0x08)
      {448.f, 0x7E},          {449.f, 0x7E}, {464.f, 0x7E}, {480.f, 0x7E},
      {1e9f, 0x7E},           {kInf, 0x7E},  {-kInf, 0xFE}, {-500.f, 0xFE},
      {-0.f, 0x80},           {0.f, 0x00},   {kNan, 0x7F},  {-kNan, 0x7F},
  };
  for (const Case& c : cases) EXPECT_EQ(FloatToE4m3(c.x), c.bits) << c.x;
}

// ---- UE8M0 --------------------------------------------------------------------------------------

TEST(Ue8m0Test, DecodesAllCodes) {
  for (int b = 0; b < 255; ++b) {
    EXPECT_EQ(Ue8m0ToFloat(b), static_cast<float>(std::pow(2.0, b - 127))) << b;
  }
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(255)));
  EXPECT_EQ(Ue8m0ToFloat(127), 1.f);
  EXPECT_EQ(Ue8m0ToFloat(128), 2.f);
  EXPECT_EQ(Ue8m0ToFloat(126), 0.5f);
  EXPECT_EQ(Bits(Ue8m0ToFloat(0)), 0x00400000u);    // 2^-127: an fp32 subnormal
  EXPECT_EQ(Bits(Ue8m0ToFloat(254)), 0x7F000000u);  // 2^127
}

// ---- BF16 ---------------------------------------------------------------------------------------

TEST(Bf16Test, DecodesAndRoundTripsAllCodes) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float v = Bf16ToFloat(static_cast<uint16_t>(b));
    ASSERT_EQ(Bits(v), b << 16) << b;
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(v)))) << b;
    } else {
      EXPECT_EQ(FloatToBf16(v), b) << b;
    }
  }
}

TEST(Bf16Test, RoundsToNearestEven) {
  struct Case {
    uint32_t f32;
    uint16_t bf16;
  };
  const Case cases[] = {
      {0x3F808000, 0x3F80},  // tie, upper half even: stays
      {0x3F818000, 0x3F82},  // tie, upper half odd: rounds up to even
      {0x3F808001, 0x3F81},  // just above the tie
      {0x3F807FFF, 0x3F80},  // just below the tie
      {0xBF818000, 0xBF82},  // negative tie
      {0x7F7FFFFF, 0x7F80},  // FLT_MAX rounds to infinity
      {0x7F800000, 0x7F80},  // +inf
      {0xFF800000, 0xFF80},  // -inf
      {0x7F800001, 0x7FC0},  // NaN with only a low payload bit stays NaN (quiet)
      {0xFF800001, 0xFFC0}, {0x7FC00000, 0x7FC0},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToBf16(FromBits(c.f32)), c.bf16) << std::hex << c.f32;
  }
}

// The bulk conversions against the scalar ones: every BF16 code, and a stride through all 2^32
// fp32 bit patterns (ties, NaNs with any payload, infinities, subnormals), at lengths that leave
// a scalar tail and at unaligned offsets.
TEST(Bf16Test, BulkConversionsEqualScalar) {
  std::vector<uint16_t> codes(65536 + 7);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint16_t>(i * 40503u);
  std::vector<float> decoded(codes.size() + 1, -1.f);
  Bf16ToFloatN(codes.data() + 1, decoded.data() + 1, static_cast<int64_t>(codes.size()) - 1);
  EXPECT_EQ(decoded[0], -1.f);
  for (size_t i = 1; i < codes.size(); ++i) ASSERT_EQ(Bits(decoded[i]), uint32_t{codes[i]} << 16) << i;

  std::vector<float> values;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 65521) values.push_back(FromBits(static_cast<uint32_t>(b)));
  for (uint32_t b : {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0x7F800001u, 0xFF800001u, 0xFFFFFFFFu,
                     0x7FFFFFFFu, 0x00008000u, 0x80018000u}) {
    values.push_back(FromBits(b));
  }
  ASSERT_GT(values.size(), 65536u);
  for (int64_t len : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{33}, static_cast<int64_t>(values.size()) - 3}) {
    std::vector<uint16_t> bulk(values.size(), 0xABCD);
    FloatToBf16N(values.data() + 3, bulk.data() + 3, len);
    for (int64_t i = 0; i < 3; ++i) ASSERT_EQ(bulk[i], 0xABCD);
    for (int64_t i = 0; i < len; ++i) {
      ASSERT_EQ(bulk[i + 3], FloatToBf16(values[i + 3])) << std::hex << Bits(values[i + 3]);
    }
    if (3 + len < static_cast<int64_t>(bulk.size())) {
      ASSERT_EQ(bulk[3 + len], 0xABCD);
    }
  }
}

// ---- Weight matrices ----------------------------------------------------------------------------

// A weight matrix with storage of its own.
struct OwnedMatrix {
  std::vector<uint8_t> packed;
  std::vector<uint8_t> scales;
  std::vector<uint16_t> bf16;
  WeightMatrix w;
};

OwnedMatrix MakeMatrix(WeightFormat f, int64_t rows, int64_t cols) {
  OwnedMatrix m;
  m.w.format = f;
  m.w.rows = rows;
  m.w.cols = cols;
  if (f == WeightFormat::kBf16) {
    m.bf16.assign(rows * cols, 0);
    m.w.values = MakeView(DType::kBF16, {rows, cols}, m.bf16.data());
    return m;
  }
  const int64_t block = f == WeightFormat::kMxfp4 ? 32 : 16;
  m.packed.assign(rows * cols / 2, 0);
  m.scales.assign(rows * cols / block, f == WeightFormat::kMxfp4 ? 127 : 0x38);
  m.w.values = MakeView(DType::kU8, {rows, cols / 2}, m.packed.data());
  m.w.scales = MakeView(f == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3, {rows, cols / block},
                        m.scales.data());
  return m;
}

std::vector<float> Dequantize(const WeightMatrix& w, float global_scale) {
  std::vector<float> out(w.rows * w.cols, -1.f);
  EXPECT_TRUE(
      DequantizeMatrix(w, global_scale, MakeView(DType::kF32, {w.rows, w.cols}, out.data())).ok());
  return out;
}

TEST(DequantizeTest, Mxfp4HandBuilt) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kMxfp4, 2, 64);
  uint8_t* row0 = m.packed.data();
  uint8_t* row1 = m.packed.data() + 32;
  row0[0] = 0x21;   // k0 = code 1 (0.5), k1 = code 2 (1.0): the even element is the low nibble
  row0[15] = 0x9F;  // k30 = code F (-6), k31 = code 9 (-0.5)
  row0[16] = 0x7B;  // k32 = code B (-1.5), k33 = code 7 (6)
  row1[0] = 0x0C;   // k0 = code C (-2), k1 = 0
  row1[31] = 0x70;  // k62 = 0, k63 = 6
  const uint8_t scales[4] = {128, 126, 127, 0};  // 2, 0.5, 1, 2^-127
  std::copy(scales, scales + 4, m.scales.begin());

  std::vector<float> expected(128, 0.f);
  expected[0] = 1.f;
  expected[1] = 2.f;
  expected[30] = -12.f;
  expected[31] = -1.f;
  expected[32] = -0.75f;
  expected[33] = 3.f;
  expected[64 + 0] = -2.f;
  expected[64 + 63] = 6.f * std::ldexp(1.f, -127);
  EXPECT_EQ(Dequantize(m.w, 1.f), expected);

  std::vector<float> halved(expected);
  for (float& v : halved) v *= 0.5f;
  EXPECT_EQ(Dequantize(m.w, 0.5f), halved);

  std::vector<float> row(64, -1.f);
  DequantizeRows(m.w, 1, 2, 1.f, row.data());
  EXPECT_EQ(row, std::vector<float>(expected.begin() + 64, expected.end()));
}

TEST(DequantizeTest, Nvfp4HandBuiltWithGlobalScale) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kNvfp4, 1, 32);
  m.packed[0] = 0x53;  // k0 = code 3 (1.5), k1 = code 5 (3)
  m.packed[8] = 0xE1;  // k16 = code 1 (0.5), k17 = code E (-4)
  m.scales[0] = 0x40;  // 2.0
  m.scales[1] = 0x31;  // 1.125 * 2^-1 = 0.5625
  std::vector<float> expected(32, 0.f);
  expected[0] = 1.5f * 2.f * 4.f;
  expected[1] = 3.f * 2.f * 4.f;
  expected[16] = 0.5f * 0.5625f * 4.f;
  expected[17] = -4.f * 0.5625f * 4.f;
  EXPECT_EQ(Dequantize(m.w, 4.f), expected);
}

TEST(DequantizeTest, Bf16WithGlobalScale) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kBf16, 1, 4);
  const uint16_t values[4] = {0x3F80, 0xC040, 0x4049, 0x0000};  // 1, -3, 3.140625, 0
  std::copy(values, values + 4, m.bf16.begin());
  EXPECT_EQ(Dequantize(m.w, 2.f), std::vector<float>({2.f, -6.f, 6.28125f, 0.f}));
}

TEST(DequantizeTest, RejectsBadArguments) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kMxfp4, 2, 64);
  std::vector<float> out(128);
  EXPECT_EQ(DequantizeMatrix(m.w, 1.f, MakeView(DType::kF32, {2, 32}, out.data())).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DequantizeMatrix(m.w, kNan, MakeView(DType::kF32, {2, 64}, out.data())).code(),
            absl::StatusCode::kInvalidArgument);
  m.scales[3] = 255;
  EXPECT_EQ(DequantizeMatrix(m.w, 1.f, MakeView(DType::kF32, {2, 64}, out.data())).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateWeightMatrixTest, AcceptsWellFormedMatrices) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kBf16}) {
    OwnedMatrix m = MakeMatrix(f, 3, 64);
    EXPECT_TRUE(ValidateWeightMatrix(m.w, 3, 64, "w").ok()) << WeightFormatName(f);
  }
}

TEST(ValidateWeightMatrixTest, RejectsMalformedMatrices) {
  struct Case {
    std::string label;
    WeightFormat format;
    std::function<void(OwnedMatrix&)> mutate;
    std::string message;
  };
  const Case cases[] = {
      {"rows", WeightFormat::kMxfp4, [](OwnedMatrix& m) { m.w.rows = 3; },
       "w13: MXFP4 matrix is [3, 64], expected [2, 64]"},
      {"values dtype", WeightFormat::kMxfp4,
       [](OwnedMatrix& m) { m.w.values.dtype = DType::kE4M3; },
       "w13.values: expected dtype U8, got E4M3"},
      {"values shape", WeightFormat::kNvfp4,
       [](OwnedMatrix& m) {
         m.w.values.shape = {2, 64};
       },
       "w13.values: dimension 1 is 64"},
      {"nvfp4 scale dtype", WeightFormat::kNvfp4,
       [](OwnedMatrix& m) { m.w.scales.dtype = DType::kU8; },
       "w13.scales: expected dtype E4M3, got U8"},
      {"mxfp4 scale shape", WeightFormat::kMxfp4,
       [](OwnedMatrix& m) {
         m.w.scales.shape = {2, 4};
       },
       "w13.scales: dimension 1 is 4, expected 2"},
      {"null values", WeightFormat::kMxfp4, [](OwnedMatrix& m) { m.w.values.data = nullptr; },
       "w13.values: data is null"},
      {"mxfp4 nan scale", WeightFormat::kMxfp4, [](OwnedMatrix& m) { m.scales[3] = 255; },
       "w13.scales: NaN UE8M0 scale at [1, 1]"},
      {"nvfp4 nan scale", WeightFormat::kNvfp4, [](OwnedMatrix& m) { m.scales[5] = 0x7F; },
       "w13.scales: NaN E4M3 scale at [1, 1]"},
      {"nvfp4 negative nan scale", WeightFormat::kNvfp4, [](OwnedMatrix& m) { m.scales[2] = 0xFF; },
       "w13.scales: NaN E4M3 scale at [0, 2]"},
      {"bf16 nan", WeightFormat::kBf16, [](OwnedMatrix& m) { m.bf16[70] = 0x7FC0; },
       "w13.values: non-finite BF16 value at [1, 6]"},
      {"bf16 inf", WeightFormat::kBf16, [](OwnedMatrix& m) { m.bf16[1] = 0x7F80; },
       "w13.values: non-finite BF16 value at [0, 1]"},
      {"bf16 -inf", WeightFormat::kBf16, [](OwnedMatrix& m) { m.bf16[127] = 0xFF80; },
       "w13.values: non-finite BF16 value at [1, 63]"},
      {"bf16 with scales", WeightFormat::kBf16,
       [](OwnedMatrix& m) {
         m.w.scales = MakeView(DType::kU8, {2, 2}, m.bf16.data());
       },
       "w13.scales: a BF16 matrix has no scales"},
  };
  for (const Case& c : cases) {
    OwnedMatrix m = MakeMatrix(c.format, 2, 64);
    c.mutate(m);
    absl::Status s = ValidateWeightMatrix(m.w, 2, 64, "w13");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.label;
  }
}

TEST(ValidateWeightMatrixTest, RejectsColsNotMultipleOfBlock) {
  OwnedMatrix mx = MakeMatrix(WeightFormat::kMxfp4, 2, 64);
  mx.w.cols = 48;
  mx.w.values.shape = {2, 24};
  mx.w.scales.shape = {2, 1};
  absl::Status s = ValidateWeightMatrix(mx.w, 2, 48, "w2");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "w2: cols = 48 is not a multiple of the MXFP4 block of 32");

  OwnedMatrix nv = MakeMatrix(WeightFormat::kNvfp4, 2, 32);
  nv.w.cols = 24;
  s = ValidateWeightMatrix(nv.w, 2, 24, "w2");
  EXPECT_EQ(s.message(), "w2: cols = 24 is not a multiple of the NVFP4 block of 16");
}

// ---- Quantization -------------------------------------------------------------------------------

TEST(QuantizeMatrixTest, Mxfp4ScalesAndCodesByHand) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kMxfp4, 1, 128);
  std::vector<float> in(128, 0.f);
  in[0] = 6.f;     // block 0: amax 6 -> 2^0 (byte 127), 6 -> code 7
  in[1] = -1.25f;  // -> tie between 1 and 1.5 -> 1 (code A)
  in[32] = 6.01f;  // block 1: amax 6.01 > 6 -> 2^1 (128); 6.01 / 2 = 3.005 -> 3 (code 5)
  in[33] = 0.5f;   // 0.25 -> 0
  in[64] = 3.f;    // block 2: amax 3 -> 2^-1 (126); 3 / 0.5 = 6 -> code 7
  in[65] = 0.75f;  // 1.5 -> code 3
  // block 3 stays zero: byte 127 by convention, codes 0.
  ASSERT_TRUE(QuantizeMatrix(in.data(), 1, 128, 1.f, m.w).ok());
  EXPECT_EQ(m.scales, std::vector<uint8_t>({127, 128, 126, 127}));
  EXPECT_EQ(m.packed[0], 0xA7);
  EXPECT_EQ(m.packed[16], 0x05);
  EXPECT_EQ(m.packed[32], 0x37);
  for (int i : {1, 17, 33, 48, 63}) EXPECT_EQ(m.packed[i], 0) << i;
}

TEST(QuantizeMatrixTest, Nvfp4ScalesAndCodesByHand) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kNvfp4, 1, 48);
  std::vector<float> in(48, 0.f);
  in[0] = 6.f;      // block 0: sf = e4m3(6 / 6) = 1.0 (0x38)
  in[1] = -3.f;     // code D
  in[16] = 2688.f;  // block 1: sf = e4m3(448) = 0x7E; 2688 / 448 = 6 -> code 7
  in[17] = 672.f;   // 672 / 448 = 1.5 -> code 3
  in[32] = 0.001f;  // block 2: 0.001 / 6 = 1.67e-4 < 2^-10 -> sf = 0 -> every code 0
  in[33] = -0.0005f;
  ASSERT_TRUE(QuantizeMatrix(in.data(), 1, 48, 1.f, m.w).ok());
  EXPECT_EQ(m.scales, std::vector<uint8_t>({0x38, 0x7E, 0x00}));
  EXPECT_EQ(m.packed[0], 0xD7);
  EXPECT_EQ(m.packed[8], 0x37);
  EXPECT_EQ(m.packed[16], 0x00);
}

// Values that lie on the grid of each format survive a round trip exactly.
TEST(QuantizeMatrixTest, GridValuesRoundTripExactly) {
  std::vector<float> in(64);
  for (int k = 0; k < 64; ++k) in[k] = kE2m1Table[k % 16] * 8.f;  // every block holds +-48
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kBf16}) {
    OwnedMatrix m = MakeMatrix(f, 1, 64);
    ASSERT_TRUE(QuantizeMatrix(in.data(), 1, 64, 1.f, m.w).ok());
    EXPECT_EQ(Dequantize(m.w, 1.f), in) << WeightFormatName(f);
  }
}

// Random rows spanning two decades (so that every NVFP4 block scale stays an E4M3 normal under one
// global scale); error bounds derived in the comments.
TEST(QuantizeMatrixTest, RandomRoundTripWithinFormatBound) {
  constexpr int64_t kRows = 12, kCols = 256;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> in(kRows * kCols);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t k = 0; k < kCols; ++k) in[r * kCols + k] = normal(rng) * std::pow(10.f, r / 4 - 1);
  }
  float matrix_amax = 0.f;
  for (float v : in) matrix_amax = std::max(matrix_amax, std::fabs(v));

  struct Case {
    WeightFormat format;
    float global_scale;
    int64_t block;
    // Error bound is slack * max(block_amax / divisor, |x|), slack 0.25 plus room for the fp32
    // rounding of x / u at a tie:
    // MXFP4: the unit u = 2^e satisfies u < amax/3; E2M1 error <= 0.25 * max(1, |x|/u) units.
    // NVFP4: u = e4m3(amax/6/g)*g is within 1/16 of amax/6, so u < amax/5 and |x|/u <= 6.4, where
    //        saturation error (<= 0.4) is still under 0.25 * |x|/u.
    // BF16: half an ulp, <= 2^-8 relative (block 1, divisor huge).
    float divisor;
    float slack;
  };
  const Case cases[] = {
      {WeightFormat::kMxfp4, 1.f, 32, 3.f, 0.26f},
      {WeightFormat::kNvfp4, matrix_amax / 2688.f, 16, 5.f, 0.26f},
      {WeightFormat::kBf16, 1.f, 1, 1e30f, 1.f / 256},
  };
  for (const Case& c : cases) {
    OwnedMatrix m = MakeMatrix(c.format, kRows, kCols);
    ASSERT_TRUE(QuantizeMatrix(in.data(), kRows, kCols, c.global_scale, m.w).ok());
    const std::vector<float> out = Dequantize(m.w, c.global_scale);
    double total_error = 0;
    for (int64_t i = 0; i < kRows * kCols; i += c.block) {
      float amax = 0.f;
      for (int64_t j = 0; j < c.block; ++j) amax = std::max(amax, std::fabs(in[i + j]));
      for (int64_t j = i; j < i + c.block; ++j) {
        const float bound = c.slack * std::max(amax / c.divisor, std::fabs(in[j]));
        EXPECT_LE(std::fabs(out[j] - in[j]), bound) << WeightFormatName(c.format) << " " << j;
        total_error += std::fabs(out[j] - in[j]);
      }
    }
    EXPECT_GT(total_error, 0.0) << WeightFormatName(c.format);  // the data is not all on-grid
  }
}

TEST(QuantizeMatrixTest, RejectsBadArguments) {
  OwnedMatrix m = MakeMatrix(WeightFormat::kNvfp4, 1, 32);
  std::vector<float> in(32, 1.f);
  EXPECT_EQ(QuantizeMatrix(in.data(), 2, 32, 1.f, m.w).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeMatrix(nullptr, 1, 32, 1.f, m.w).code(), absl::StatusCode::kInvalidArgument);
  for (float g : {0.f, -1.f, kNan, kInf}) {
    EXPECT_EQ(QuantizeMatrix(in.data(), 1, 32, g, m.w).code(), absl::StatusCode::kInvalidArgument)
        << g;
  }
  in[20] = kInf;
  absl::Status s = QuantizeMatrix(in.data(), 1, 32, 1.f, m.w);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "in: non-finite value at [0, 20]");
}

}  // namespace
}  // namespace moe
