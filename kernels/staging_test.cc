#include "kernels/staging.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// The bytes of packed int32 scales in memory order (the wire and GPU layout).
std::vector<uint8_t> Bytes(const std::vector<int32_t>& words) {
  std::vector<uint8_t> out(words.size() * 4);
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

template <typename T>
TensorView View(DType dtype, Shape shape, std::vector<T>& v) {
  return MakeView(dtype, std::move(shape), v.data());
}

// ---- MXFP8 --------------------------------------------------------------------------------------

// One row, eight groups of 32, each exercising one rule of numerics.md section 3.
TEST(QuantizeMxfp8Test, HandDerivedGroups) {
  std::vector<float> x(256, 0.f);
  auto at = [&](int group, int j) -> float& { return x[group * 32 + j]; };
  at(0, 0) = 448.f;  // amax 448: s = 1 exactly, mantissa 0 -> byte 127
  at(0, 1) = -1.f;
  at(0, 2) = 0.5f;
  at(1, 0) = 449.f;  // amax 449: s = 449/448 > 1 -> byte 128; 449 * 2^-1 = 224.5 -> 224
  at(1, 1) = 2.f;
  // Group 2 all zero: amax floor 1e-4; s = 1e-4/448 = 2.232e-7 lies in [2^-23 = 1.192e-7,
  // 2^-22 = 2.384e-7): biased exponent 127 - 23 = 104, mantissa != 0 -> 105 (0x69).
  at(3, 5) = 5e-5f;  // below the floor: byte 105 again; 5e-5 * 2^22 = 209.7 -> 208 (0x75)
  at(4, 0) = 1.f;    // s = 1/448 in [2^-9, 2^-8): 118 + 1 = 119; 1 * 2^8 = 256 (0x78)
  at(5, 0) = 896.f;  // s = 2 exactly -> 128; 896 / 2 = 448 (0x7E)
  at(5, 1) = -3.f;   // -1.5 (0xBC)
  at(6, 0) = kInf;   // s = inf: biased 255 -> clamped to 254; inf * 2^-127 saturates (0x7E)
  at(6, 1) = 1e30f;  // 1e30 * 2^-127 = 5.9e-9 -> 0
  at(6, 2) = -1.f;   // -> -0 (0x80)
  at(7, 0) = kNan;   // skipped by amax, encodes as NaN (0x7F)
  at(7, 1) = 5.f;    // amax 5: s = 0.01116 in [2^-7, 2^-6): 120 + 1 = 121; 5 * 2^6 = 320 (0x7A)

  std::vector<uint8_t> q(256, 0xAA);
  std::vector<int32_t> scales(2, 0);
  ASSERT_TRUE(QuantizeMxfp8(View(DType::kF32, {1, 256}, x), View(DType::kE4M3, {1, 256}, q),
                            View(DType::kI32, {1, 2}, scales))
                  .ok());
  EXPECT_THAT(Bytes(scales), ElementsAre(127, 128, 105, 105, 119, 128, 254, 121));
  EXPECT_EQ(scales[0], 0x6969807F);  // byte g (least significant first) is group g
  EXPECT_EQ(scales[1], 0x79FE8077);

  std::vector<uint8_t> expected(256, 0x00);
  auto want = [&](int group, int j) -> uint8_t& { return expected[group * 32 + j]; };
  want(0, 0) = 0x7E;
  want(0, 1) = 0xB8;
  want(0, 2) = 0x30;
  want(1, 0) = 0x76;
  want(1, 1) = 0x38;
  want(3, 5) = 0x75;
  want(4, 0) = 0x78;
  want(5, 0) = 0x7E;
  want(5, 1) = 0xBC;
  want(6, 0) = 0x7E;
  want(6, 2) = 0x80;
  want(7, 0) = 0x7F;
  want(7, 1) = 0x7A;
  EXPECT_THAT(q, ElementsAreArray(expected));
}

TEST(QuantizeMxfp8Test, Bf16InputMatchesF32Input) {
  // 1, -2, 448, 3.140625 and 1e-3 (0x3A83 = 0.0009994507) in BF16.
  std::vector<uint16_t> bf16(128, 0);
  const uint16_t head[5] = {0x3F80, 0xC000, 0x43E0, 0x4049, 0x3A83};
  std::copy(head, head + 5, bf16.begin());
  std::vector<float> f32(128, 0.f);
  const float head_f32[5] = {1.f, -2.f, 448.f, 3.140625f, 0.0009994507f};
  std::copy(head_f32, head_f32 + 5, f32.begin());
  std::vector<uint8_t> q_bf16(128), q_f32(128);
  std::vector<int32_t> s_bf16(1), s_f32(1);
  ASSERT_TRUE(QuantizeMxfp8(View(DType::kBF16, {1, 128}, bf16),
                            View(DType::kE4M3, {1, 128}, q_bf16), View(DType::kI32, {1, 1}, s_bf16))
                  .ok());
  ASSERT_TRUE(QuantizeMxfp8(View(DType::kF32, {1, 128}, f32), View(DType::kE4M3, {1, 128}, q_f32),
                            View(DType::kI32, {1, 1}, s_f32))
                  .ok());
  EXPECT_EQ(q_bf16, q_f32);
  EXPECT_EQ(s_bf16, s_f32);
  EXPECT_THAT(Bytes(s_f32), ElementsAre(127, 105, 105, 105));
}

TEST(QuantizeMxfp8Test, RoundTripWithinE4m3Bound) {
  constexpr int64_t kT = 5, kH = 512;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(kT * kH);
  for (int64_t i = 0; i < kT * kH; ++i) x[i] = normal(rng) * std::pow(4.f, (i / kH) - 2);
  std::vector<uint8_t> q(kT * kH);
  std::vector<int32_t> scales(kT * kH / 128);
  std::vector<float> out(kT * kH);
  ASSERT_TRUE(QuantizeMxfp8(View(DType::kF32, {kT, kH}, x), View(DType::kE4M3, {kT, kH}, q),
                            View(DType::kI32, {kT, kH / 128}, scales))
                  .ok());
  ASSERT_TRUE(DequantizeMxfp8(View(DType::kE4M3, {kT, kH}, q),
                              View(DType::kI32, {kT, kH / 128}, scales),
                              View(DType::kF32, {kT, kH}, out))
                  .ok());
  for (int64_t i = 0; i < kT * kH; i += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[i + j]));
    // The power-of-two scale u satisfies amax/448 <= u < amax/224, so |x|/u <= 448: no
    // saturation. E4M3 rounding error: half a step, <= 2^-4 relative for normals and
    // 2^-10 * u below 2^-6 * u.
    const float u = std::max(amax, 1e-4f) / 224.f;
    for (int64_t j = i; j < i + 32; ++j) {
      EXPECT_LE(std::fabs(out[j] - x[j]), std::max(std::fabs(x[j]) / 16, u / 1024)) << j;
    }
  }
}

TEST(QuantizeMxfp8Fp32ScaleTest, StoresUnroundedScale) {
  std::vector<float> x(64, 0.f);
  x[0] = 448.f;  // group 0: s = 1
  x[1] = 3.f;
  x[32] = 1.f;  // group 1: s = 1/448; 1 / s rounds to 448 (0x7E)
  x[33] = -0.25f;
  std::vector<uint8_t> q(64);
  std::vector<float> scales(2);
  ASSERT_TRUE(QuantizeMxfp8Fp32Scale(View(DType::kF32, {1, 64}, x), View(DType::kE4M3, {1, 64}, q),
                                     View(DType::kF32, {1, 2}, scales))
                  .ok());
  EXPECT_THAT(scales, ElementsAre(1.f, 1.f / 448.f));
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0x44);  // 3 = 1.5 * 2^1: exponent field 8, mantissa 4
  EXPECT_EQ(q[32], 0x7E);
  EXPECT_EQ(q[33], 0xEE);  // -0.25 * 448 = -112 = -1.75 * 2^6: exponent 13, mantissa 6

  // All zero: s is the floor 1e-4 / 448 and every value is 0.
  std::fill(x.begin(), x.end(), 0.f);
  ASSERT_TRUE(QuantizeMxfp8Fp32Scale(View(DType::kF32, {1, 64}, x), View(DType::kE4M3, {1, 64}, q),
                                     View(DType::kF32, {1, 2}, scales))
                  .ok());
  EXPECT_THAT(scales, ElementsAre(1e-4f / 448.f, 1e-4f / 448.f));
  EXPECT_EQ(std::count(q.begin(), q.end(), 0), 64);
}

TEST(DequantizeMxfp8Test, HandBuiltPackedAndFp32Scales) {
  std::vector<uint8_t> q(128, 0);
  q[0] = 0x38;                                                        // 1.0, group 0
  q[33] = 0x38;                                                       // 1.0, group 1
  q[64] = 0xB0;                                                       // -0.5, group 2
  q[127] = 0x01;                                                      // 2^-9, group 3
  std::vector<int32_t> packed = {static_cast<int32_t>(0x827E807Fu)};  // bytes 127, 128, 126, 130
  std::vector<float> out(128, -1.f);
  ASSERT_TRUE(DequantizeMxfp8(View(DType::kE4M3, {1, 128}, q), View(DType::kI32, {1, 1}, packed),
                              View(DType::kF32, {1, 128}, out))
                  .ok());
  std::vector<float> expected(128, 0.f);
  expected[0] = 1.f;
  expected[33] = 2.f;
  expected[64] = -0.25f;
  expected[127] = 0.015625f;  // 2^-9 * 2^3
  EXPECT_EQ(out, expected);

  std::vector<float> fp32_scales = {0.1f, 3.f, 0.f, 1e-3f};
  ASSERT_TRUE(DequantizeMxfp8(View(DType::kE4M3, {1, 128}, q),
                              View(DType::kF32, {1, 4}, fp32_scales),
                              View(DType::kF32, {1, 128}, out))
                  .ok());
  expected[0] = 0.1f;
  expected[33] = 3.f;
  expected[64] = -0.f;
  expected[127] = 0.001953125f * 1e-3f;
  EXPECT_EQ(out, expected);
}

TEST(Mxfp8Test, RejectsBadArguments) {
  std::vector<float> x(2 * 256);
  std::vector<uint8_t> q(2 * 256);
  std::vector<int32_t> s32(8);
  std::vector<float> sf(16);
  std::vector<float> out(2 * 256);
  // H = 64 is not a multiple of 128.
  absl::Status s = QuantizeMxfp8(View(DType::kF32, {2, 64}, x), View(DType::kE4M3, {2, 64}, q),
                                 View(DType::kI32, {2, 0}, s32));
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_EQ(s.message(), "x: hidden size 64 is not a multiple of 128");
  EXPECT_EQ(QuantizeMxfp8(View(DType::kI32, {2, 128}, x), View(DType::kE4M3, {2, 128}, q),
                          View(DType::kI32, {2, 1}, s32))
                .code(),
            kInvalid);
  EXPECT_EQ(QuantizeMxfp8(View(DType::kF32, {2, 128}, x), View(DType::kU8, {2, 128}, q),
                          View(DType::kI32, {2, 1}, s32))
                .code(),
            kInvalid);
  EXPECT_EQ(QuantizeMxfp8(View(DType::kF32, {2, 128}, x), View(DType::kE4M3, {2, 128}, q),
                          View(DType::kI32, {2, 4}, s32))
                .code(),
            kInvalid);
  EXPECT_EQ(QuantizeMxfp8(View(DType::kF32, {2, 128}, x), View(DType::kE4M3, {2, 128}, q),
                          TensorView{DType::kI32, {2, 1}, nullptr})
                .code(),
            kInvalid);
  // Fp32-scale variant: H must be a multiple of 32.
  s = QuantizeMxfp8Fp32Scale(View(DType::kF32, {2, 48}, x), View(DType::kE4M3, {2, 48}, q),
                             View(DType::kF32, {2, 1}, sf));
  EXPECT_EQ(s.message(), "x: hidden size 48 is not a multiple of 32");
  EXPECT_EQ(QuantizeMxfp8Fp32Scale(View(DType::kF32, {2, 64}, x), View(DType::kE4M3, {2, 64}, q),
                                   View(DType::kI32, {2, 2}, s32))
                .code(),
            kInvalid);
  // Dequantize: packed scales need H % 128 == 0, NaN scale bytes and non-finite scales rejected.
  s = DequantizeMxfp8(View(DType::kE4M3, {2, 96}, q), View(DType::kI32, {2, 1}, s32),
                      View(DType::kF32, {2, 96}, out));
  EXPECT_THAT(s.message(), HasSubstr("q: hidden size 96 is not a multiple of 128"));
  s32[3] = 0x7F7FFF7F;  // token 1 word 1: group 5 byte is 255
  s = DequantizeMxfp8(View(DType::kE4M3, {2, 256}, q), View(DType::kI32, {2, 2}, s32),
                      View(DType::kF32, {2, 256}, out));
  EXPECT_EQ(s.message(), "scales: non-finite scale of token 1, group 5");
  sf[3] = kInf;
  s = DequantizeMxfp8(View(DType::kE4M3, {2, 64}, q), View(DType::kF32, {2, 2}, sf),
                      View(DType::kF32, {2, 64}, out));
  EXPECT_EQ(s.message(), "scales: non-finite scale of token 1, group 1");
  EXPECT_EQ(DequantizeMxfp8(View(DType::kE4M3, {2, 64}, q), View(DType::kI64, {2, 2}, s32),
                            View(DType::kF32, {2, 64}, out))
                .code(),
            kInvalid);
  EXPECT_EQ(DequantizeMxfp8(View(DType::kE4M3, {2, 64}, q), View(DType::kF32, {2, 3}, sf),
                            View(DType::kF32, {2, 64}, out))
                .code(),
            kInvalid);
}

// ---- NVFP4 per token ----------------------------------------------------------------------------

// Row 0 has amax 2688, so x_scale = 1 and every block scale is e4m3(amax16 / 6).
TEST(QuantizeNvfp4PerTokenTest, HandDerivedGroups) {
  std::vector<float> x(2 * 128, 0.f);
  auto set = [&](int group, std::vector<float> values) {
    std::copy(values.begin(), values.end(), x.begin() + group * 16);
  };
  set(0, {2688.f, -1344.f, 224.f, 100.f});  // sf 448 (0x7E): codes 7, D (-3), 1 (0.5), 0
  set(1, {6.f, 3.f, -1.5f, 0.5f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f, -0.f});  // sf 1
  // group 2 zero: sf 0.
  set(3, {0.001f, -0.0008f});  // 0.001 / 6 < 2^-10 -> sf 0, so q = 0 although x != 0
  set(4, {5.f, 7.f, -12.f});   // sf = e4m3(2) = 0x40: 2.5 -> 2 (4), 3.5 -> 4 (6), -6 (F)
  set(5, {7.f, 2.8125f});      // 7/6 -> 1.125 (0x39): 6.22 saturates (7), 2.5 -> 2 (4)
  set(6, {-2688.f});           // sf 0x7E, code F
  set(7, {0.01f, 0.004f});  // 0.01/6 * 2^9 = 0.85 -> sf 2^-9 (0x01): 5.12 -> 6 (7), 2.05 -> 2 (4)
  // Row 1 is all zero: x_scale = FLT_MIN / 2688, every sf and code 0.
  std::vector<uint8_t> q(2 * 64, 0xAA);
  std::vector<int32_t> block_scales(2 * 2, -1);
  std::vector<float> token_scale(2, -1.f);
  ASSERT_TRUE(QuantizeNvfp4PerToken(View(DType::kF32, {2, 128}, x), View(DType::kU8, {2, 64}, q),
                                    View(DType::kI32, {2, 2}, block_scales),
                                    View(DType::kF32, {2}, token_scale))
                  .ok());
  EXPECT_THAT(token_scale, ElementsAre(1.f, FLT_MIN / 2688.f));
  EXPECT_THAT(Bytes(block_scales), ElementsAre(0x7E, 0x38, 0x00, 0x00, 0x40, 0x39, 0x7E, 0x01,  //
                                               0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_EQ(block_scales[0], 0x0000387E);
  EXPECT_EQ(block_scales[1], 0x017E3940);
  std::vector<uint8_t> expected(2 * 64, 0);
  const std::vector<std::pair<int, uint8_t>> bytes = {
      {0, 0xD7},  {1, 0x01},                                                   // group 0
      {8, 0x57},  {9, 0x1B},  {10, 0x20}, {11, 0x42}, {12, 0x64}, {13, 0x06},  // group 1
      {32, 0x64}, {33, 0x0F},                                                  // group 4
      {40, 0x47},                                                              // group 5
      {48, 0x0F},                                                              // group 6
      {56, 0x47},                                                              // group 7
  };
  for (auto [i, b] : bytes) expected[i] = b;
  EXPECT_THAT(q, ElementsAreArray(expected));

  std::vector<float> out(2 * 128, -1.f);
  ASSERT_TRUE(
      DequantizeNvfp4PerToken(View(DType::kU8, {2, 64}, q), View(DType::kI32, {2, 2}, block_scales),
                              View(DType::kF32, {2}, token_scale), View(DType::kF32, {2, 128}, out))
          .ok());
  std::vector<float> want(2 * 128, 0.f);
  const std::vector<std::pair<int, float>> values = {
      {0, 2688.f},   {1, -1344.f},       {2, 224.f},         {16, 6.f},   {17, 3.f},   {18, -1.5f},
      {19, 0.5f},    {21, 1.f},          {22, 1.f},          {23, 2.f},   {24, 2.f},   {25, 4.f},
      {26, 4.f},     {64, 4.f},          {65, 8.f},          {66, -12.f}, {80, 6.75f}, {81, 2.25f},
      {96, -2688.f}, {112, 0.01171875f}, {113, 0.00390625f},
  };
  for (auto [i, v] : values) want[i] = v;
  EXPECT_EQ(out, want);
}

TEST(QuantizeNvfp4PerTokenTest, TokenScaleFollowsRowAmax) {
  std::vector<uint16_t> x(64, 0);
  x[0] = 0x3F80;   // 1.0 in BF16: x_scale = 1/2688; sf = e4m3(~448) = 0x7E; 1 / (448/2688) = 6
  x[20] = 0xBF00;  // -0.5 -> sf = e4m3(0.5 * 448) = 224 (0x76); -0.5 / (224/2688) = -6 (F)
  std::vector<uint8_t> q(32);
  std::vector<int32_t> block_scales(1);
  std::vector<float> token_scale(1);
  ASSERT_TRUE(QuantizeNvfp4PerToken(View(DType::kBF16, {1, 64}, x), View(DType::kU8, {1, 32}, q),
                                    View(DType::kI32, {1, 1}, block_scales),
                                    View(DType::kF32, {1}, token_scale))
                  .ok());
  EXPECT_EQ(token_scale[0], 1.f / 2688.f);
  EXPECT_THAT(Bytes(block_scales), ElementsAre(0x7E, 0x76, 0x00, 0x00));
  EXPECT_EQ(q[0], 0x07);
  EXPECT_EQ(q[10], 0x0F);
}

TEST(QuantizeNvfp4PerTokenTest, RoundTripWithinFp4Bound) {
  constexpr int64_t kT = 4, kH = 256;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(kT * kH);
  for (int64_t i = 0; i < kT * kH; ++i) x[i] = normal(rng) * std::pow(10.f, (i / kH) - 2);
  std::vector<uint8_t> q(kT * kH / 2);
  std::vector<int32_t> block_scales(kT * kH / 64);
  std::vector<float> token_scale(kT), out(kT * kH);
  ASSERT_TRUE(QuantizeNvfp4PerToken(View(DType::kF32, {kT, kH}, x),
                                    View(DType::kU8, {kT, kH / 2}, q),
                                    View(DType::kI32, {kT, kH / 64}, block_scales),
                                    View(DType::kF32, {kT}, token_scale))
                  .ok());
  ASSERT_TRUE(DequantizeNvfp4PerToken(
                  View(DType::kU8, {kT, kH / 2}, q), View(DType::kI32, {kT, kH / 64}, block_scales),
                  View(DType::kF32, {kT}, token_scale), View(DType::kF32, {kT, kH}, out))
                  .ok());
  for (int64_t i = 0; i < kT * kH; i += 16) {
    float amax = 0.f;
    for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(x[i + j]));
    // The unit u = sf * x_scale is within 1/16 of amax/6 (sf an E4M3 normal), so u < amax/5 and
    // |x|/u <= 6.4; the E2M1 error (saturation included) is <= 0.25 * max(1, |x|/u) units.
    for (int64_t j = i; j < i + 16; ++j) {
      EXPECT_LE(std::fabs(out[j] - x[j]), 0.26f * std::max(amax / 5, std::fabs(x[j]))) << j;
    }
  }
}

TEST(Nvfp4PerTokenTest, RejectsBadArguments) {
  std::vector<float> x(2 * 128);
  std::vector<uint8_t> q(2 * 64);
  std::vector<int32_t> bs(4);
  std::vector<float> ts(3), out(2 * 128);
  absl::Status s =
      QuantizeNvfp4PerToken(View(DType::kF32, {2, 96}, x), View(DType::kU8, {2, 48}, q),
                            View(DType::kI32, {2, 1}, bs), View(DType::kF32, {2}, ts));
  EXPECT_EQ(s.message(), "x: hidden size 96 is not a multiple of 64");
  EXPECT_EQ(QuantizeNvfp4PerToken(View(DType::kF32, {2, 128}, x), View(DType::kE4M3, {2, 64}, q),
                                  View(DType::kI32, {2, 2}, bs), View(DType::kF32, {2}, ts))
                .code(),
            kInvalid);
  EXPECT_EQ(QuantizeNvfp4PerToken(View(DType::kF32, {2, 128}, x), View(DType::kU8, {2, 64}, q),
                                  View(DType::kU8, {2, 8}, q), View(DType::kF32, {2}, ts))
                .code(),
            kInvalid);
  s = QuantizeNvfp4PerToken(View(DType::kF32, {2, 128}, x), View(DType::kU8, {2, 64}, q),
                            View(DType::kI32, {2, 2}, bs), View(DType::kF32, {3}, ts));
  EXPECT_THAT(s.message(), HasSubstr("token_scale: dimension 0 is 3, expected 2"));

  s = DequantizeNvfp4PerToken(View(DType::kU8, {2, 48}, q), View(DType::kI32, {2, 1}, bs),
                              View(DType::kF32, {2}, ts), View(DType::kF32, {2, 96}, out));
  EXPECT_EQ(s.message(), "q: hidden size 96 is not a multiple of 64");
  ts = {1.f, 1.f};
  bs = {0, 0, static_cast<int32_t>(0xFF000000u), 0};  // token 1, group 3: E4M3 0xFF is NaN
  s = DequantizeNvfp4PerToken(View(DType::kU8, {2, 64}, q), View(DType::kI32, {2, 2}, bs),
                              View(DType::kF32, {2}, ts), View(DType::kF32, {2, 128}, out));
  EXPECT_EQ(s.message(), "block_scales: NaN E4M3 scale of token 1, group 3");
  bs = {0, 0, 0, 0};
  ts = {1.f, kNan};
  s = DequantizeNvfp4PerToken(View(DType::kU8, {2, 64}, q), View(DType::kI32, {2, 2}, bs),
                              View(DType::kF32, {2}, ts), View(DType::kF32, {2, 128}, out));
  EXPECT_EQ(s.message(), "token_scale: non-finite at token 1");
  EXPECT_EQ(DequantizeNvfp4PerToken(View(DType::kU8, {2, 64}, q), View(DType::kI32, {2, 2}, bs),
                                    View(DType::kF32, {2}, ts), View(DType::kBF16, {2, 128}, out))
                .code(),
            kInvalid);
}

// ---- BF16 staging -------------------------------------------------------------------------------

TEST(StageBf16Test, RoundsF32AndCopiesBf16) {
  std::vector<uint32_t> bits = {0x3F800000, 0x3F808000, 0x3F818000, 0x7F800001};
  std::vector<float> x(4);
  std::memcpy(x.data(), bits.data(), 16);
  std::vector<uint16_t> out(4);
  ASSERT_TRUE(StageBf16(View(DType::kF32, {2, 2}, x), View(DType::kBF16, {2, 2}, out)).ok());
  EXPECT_THAT(out, ElementsAre(0x3F80, 0x3F80, 0x3F82, 0x7FC0));

  std::vector<uint16_t> in = {0x1234, 0xFFFF, 0x0001, 0x7F80};
  ASSERT_TRUE(StageBf16(View(DType::kBF16, {1, 4}, in), View(DType::kBF16, {1, 4}, out)).ok());
  EXPECT_EQ(out, in);

  EXPECT_EQ(StageBf16(View(DType::kF32, {2, 2}, x), View(DType::kF32, {2, 2}, x)).code(), kInvalid);
  EXPECT_EQ(StageBf16(View(DType::kF32, {2, 2}, x), View(DType::kBF16, {1, 4}, out)).code(),
            kInvalid);
  EXPECT_EQ(StageBf16(View(DType::kU8, {1, 4}, in), View(DType::kBF16, {1, 4}, out)).code(),
            kInvalid);
}

// ---- Shared-expert scales -----------------------------------------------------------------------

TEST(WriteSharedExpertScalesTest, HandEnumeratedRowsForBlock200) {
  // B = 200: aligned = 256; T = 250 needs ceil(250/200) * 256 = 512 rows.
  constexpr int64_t kT = 250, kW = 2;
  std::vector<int32_t> scales(kT * kW);
  for (int64_t t = 0; t < kT; ++t) {
    scales[t * kW] = static_cast<int32_t>(1000 + t);
    scales[t * kW + 1] = static_cast<int32_t>(-1000 - t);
  }
  std::vector<int32_t> out(512 * kW, 7);
  ASSERT_TRUE(WriteSharedExpertScales(View(DType::kI32, {kT, kW}, scales), 200,
                                      View(DType::kI32, {512, kW}, out))
                  .ok());
  // row = blk * 256 + (m / 128) * 128 + (m % 32) * 4 + (m % 128) / 32, worked out by hand.
  const std::pair<int, int> token_row[] = {
      {0, 0},     {1, 4},     {2, 8},     {31, 124},  {32, 1},    {33, 5},
      {64, 2},    {96, 3},    {127, 127}, {128, 128}, {129, 132}, {160, 129},
      {199, 158}, {200, 256}, {201, 260}, {232, 257}, {249, 325},
  };
  for (auto [t, row] : token_row) {
    EXPECT_EQ(out[row * kW], 1000 + t) << t;
    EXPECT_EQ(out[row * kW + 1], -1000 - t) << t;
  }
  // Every token lands on its own row; the rest is left untouched.
  EXPECT_EQ(std::count(out.begin(), out.end(), 7), (512 - kT) * kW);
}

TEST(WriteSharedExpertScalesTest, BlockOfOneAndExactMultiple) {
  std::vector<int32_t> scales = {11, 22, 33};
  std::vector<int32_t> out(3 * 128, 0);
  ASSERT_TRUE(WriteSharedExpertScales(View(DType::kI32, {3, 1}, scales), 1,
                                      View(DType::kI32, {384, 1}, out))
                  .ok());
  EXPECT_EQ(out[0], 11);  // B = 1: aligned = 128, token t -> row 128 t
  EXPECT_EQ(out[128], 22);
  EXPECT_EQ(out[256], 33);

  std::vector<int32_t> many(256);
  for (int i = 0; i < 256; ++i) many[i] = i + 1;
  std::vector<int32_t> out2(256, 0);
  ASSERT_TRUE(WriteSharedExpertScales(View(DType::kI32, {256, 1}, many), 128,
                                      View(DType::kI32, {256, 1}, out2))
                  .ok());
  EXPECT_EQ(out2[4], 2);          // t = 1
  EXPECT_EQ(out2[128 + 1], 161);  // t = 160: m = 32 -> 128 + 0 + 1
}

TEST(WriteSharedExpertScalesTest, RejectsBadArguments) {
  std::vector<int32_t> scales(250);
  std::vector<int32_t> out(512);
  const TensorView in = View(DType::kI32, {250, 1}, scales);
  for (int64_t b : {int64_t{0}, int64_t{-3}, int64_t{1} << 40}) {
    EXPECT_EQ(WriteSharedExpertScales(in, b, View(DType::kI32, {512, 1}, out)).code(), kInvalid)
        << b;
  }
  absl::Status s = WriteSharedExpertScales(in, 200, View(DType::kI32, {511, 1}, out));
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_EQ(s.message(),
            "out: 511 rows, needs at least ceil(T / B) * ceil(B / 128) * 128 = 512 for T = 250, "
            "B = 200");
  EXPECT_EQ(WriteSharedExpertScales(in, 200, View(DType::kI32, {256, 2}, out)).code(), kInvalid);
  EXPECT_EQ(WriteSharedExpertScales(in, 200, View(DType::kF32, {512, 1}, out)).code(), kInvalid);
  EXPECT_EQ(WriteSharedExpertScales(View(DType::kU8, {250, 1}, scales), 200,
                                    View(DType::kI32, {512, 1}, out))
                .code(),
            kInvalid);
}

// ---- L2 alpha -----------------------------------------------------------------------------------

TEST(ComputeL2AlphaTest, MultipliesEveryExpert) {
  const std::vector<float> w2 = {0.5f, 2.f, 3.f};
  std::vector<float> alpha(3, -1.f);
  ASSERT_TRUE(ComputeL2Alpha(w2, 0.25f, absl::MakeSpan(alpha)).ok());
  EXPECT_THAT(alpha, ElementsAre(0.125f, 0.5f, 0.75f));
  EXPECT_TRUE(ComputeL2Alpha({}, 0.25f, {}).ok());
  std::vector<float> short_alpha(2);
  EXPECT_EQ(ComputeL2Alpha(w2, 0.25f, absl::MakeSpan(short_alpha)).code(), kInvalid);
  EXPECT_EQ(ComputeL2Alpha(w2, kNan, absl::MakeSpan(alpha)).code(), kInvalid);
}

// ---- Top-k repack -------------------------------------------------------------------------------

TEST(RepackTopkTest, PaddingAndWidening) {
  std::vector<int64_t> ids = {0, 3, -1, 2, 5, 7};  // token 2 is padding: its routes are not read
  std::vector<float> weights = {0.5f, 0.25f, 1.f, 0.f, kNan, kInf};
  std::vector<uint8_t> padding = {0, 0, 1};
  std::vector<int32_t> out_ids(6, 9);
  std::vector<float> out_weights(6, 9.f);
  ASSERT_TRUE(RepackTopk(View(DType::kI64, {3, 2}, ids), View(DType::kF32, {3, 2}, weights),
                         View(DType::kBool, {3}, padding), 4, View(DType::kI32, {3, 2}, out_ids),
                         View(DType::kF32, {3, 2}, out_weights))
                  .ok());
  EXPECT_THAT(out_ids, ElementsAre(0, 3, -1, 2, -1, -1));
  EXPECT_THAT(out_weights, ElementsAre(0.5f, 0.25f, 1.f, 0.f, 0.f, 0.f));
}

TEST(RepackTopkTest, Int32IdsBf16WeightsNoPadding) {
  std::vector<int32_t> ids = {1, 0, 0, 1};
  std::vector<uint16_t> weights = {0x3F80, 0x3F00, 0xBE80, 0x0000};  // 1, 0.5, -0.25, 0
  std::vector<int32_t> out_ids(4);
  std::vector<float> out_weights(4);
  ASSERT_TRUE(RepackTopk(View(DType::kI32, {2, 2}, ids), View(DType::kBF16, {2, 2}, weights),
                         TensorView(), 2, View(DType::kI32, {2, 2}, out_ids),
                         View(DType::kF32, {2, 2}, out_weights))
                  .ok());
  EXPECT_THAT(out_ids, ElementsAre(1, 0, 0, 1));
  EXPECT_THAT(out_weights, ElementsAre(1.f, 0.5f, -0.25f, 0.f));
}

TEST(RepackTopkTest, RejectsBadArguments) {
  // A valid call, which each case breaks in one way.
  struct Args {
    std::vector<int64_t> ids = {0, 1, 2, 3};
    std::vector<float> weights = {1.f, 1.f, 1.f, 1.f};
    std::vector<uint8_t> padding;  // empty: absent
    DType ids_dtype = DType::kI64;
    DType weights_dtype = DType::kF32;
    Shape weights_shape = {2, 2};
    DType out_ids_dtype = DType::kI32;
    DType out_weights_dtype = DType::kF32;
    int32_t num_experts = 4;
  };
  struct Case {
    std::string label;
    std::function<void(Args&)> mutate;
    std::string message;
  };
  const Case cases[] = {
      {"id too large", [](Args& a) { a.ids[2] = 4; },
       "topk_ids: id 4 at [1, 0] is outside [-1, 4)"},
      {"id below -1", [](Args& a) { a.ids[1] = -2; },
       "topk_ids: id -2 at [0, 1] is outside [-1, 4)"},
      {"nan weight", [](Args& a) { a.weights[3] = kNan; },
       "topk_weights: non-finite weight at [1, 1]"},
      {"inf weight", [](Args& a) { a.weights[0] = -kInf; },
       "topk_weights: non-finite weight at [0, 0]"},
      {"shape mismatch",
       [](Args& a) {
         a.weights_shape = {2, 1};
       },
       "topk_weights: dimension 1 is 1, expected 2"},
      {"ids dtype", [](Args& a) { a.ids_dtype = DType::kF32; },
       "topk_ids: expected dtype one of {I32, I64}, got F32"},
      {"weights dtype", [](Args& a) { a.weights_dtype = DType::kI32; },
       "topk_weights: expected dtype one of {F32, BF16}, got I32"},
      {"out_ids dtype", [](Args& a) { a.out_ids_dtype = DType::kI64; },
       "out_ids: expected dtype I32, got I64"},
      {"out_weights dtype", [](Args& a) { a.out_weights_dtype = DType::kBF16; },
       "out_weights: expected dtype F32, got BF16"},
      {"padding length",
       [](Args& a) {
         a.padding = {0, 0, 0};
       },
       "is_padding: dimension 0 is 3, expected 2"},
      {"padding byte",
       [](Args& a) {
         a.padding = {0, 2};
       },
       "is_padding: byte at [1] is 2, expected 0 or 1"},
      {"no experts", [](Args& a) { a.num_experts = 0; }, "num_experts: must be at least 1, got 0"},
  };
  for (const Case& c : cases) {
    Args a;
    c.mutate(a);
    std::vector<int64_t> out_ids(4);
    std::vector<float> out_weights(4);
    const TensorView pad =
        a.padding.empty() ? TensorView()
                          : View(DType::kBool, {static_cast<int64_t>(a.padding.size())}, a.padding);
    absl::Status s = RepackTopk(View(a.ids_dtype, {2, 2}, a.ids),
                                View(a.weights_dtype, a.weights_shape, a.weights), pad,
                                a.num_experts, View(a.out_ids_dtype, {2, 2}, out_ids),
                                View(a.out_weights_dtype, {2, 2}, out_weights));
    EXPECT_EQ(s.code(), kInvalid) << c.label;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.label;
  }
}

TEST(RepackTopkTest, RejectsNullDataAndLeavesOutputUntouched) {
  std::vector<int32_t> ids = {0, 9};
  std::vector<float> weights = {1.f, 1.f};
  std::vector<int32_t> out_ids = {5, 5};
  std::vector<float> out_weights = {5.f, 5.f};
  EXPECT_EQ(RepackTopk(TensorView{DType::kI32, {1, 2}, nullptr}, View(DType::kF32, {1, 2}, weights),
                       TensorView(), 4, View(DType::kI32, {1, 2}, out_ids),
                       View(DType::kF32, {1, 2}, out_weights))
                .code(),
            kInvalid);
  // The bad id in position 1 is found before anything is written.
  EXPECT_EQ(
      RepackTopk(View(DType::kI32, {1, 2}, ids), View(DType::kF32, {1, 2}, weights), TensorView(),
                 4, View(DType::kI32, {1, 2}, out_ids), View(DType::kF32, {1, 2}, out_weights))
          .code(),
      kInvalid);
  EXPECT_THAT(out_ids, ElementsAre(5, 5));
  EXPECT_THAT(out_weights, ElementsAre(5.f, 5.f));
}

}  // namespace
}  // namespace moe
