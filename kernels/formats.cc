// Element codecs and weight-matrix validation, dequantization and quantization (formats.h).
//
// Everything here is scalar and exact where the formats allow it: decoding is exact, encoding
// rounds once (round-to-nearest-even in the default floating-point environment).
#include "kernels/formats.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace moe {
namespace {

constexpr float kE2m1Magnitudes[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
constexpr float kE2m1Max = 6.f;
constexpr float kE4m3Max = 448.f;
constexpr uint8_t kE4m3MaxBits = 0x7E;
constexpr uint8_t kE4m3NanBits = 0x7F;
constexpr float kE4m3MinNormal = 0.015625f;  // 2^-6
constexpr uint8_t kUe8m0Nan = 255;
constexpr int kUe8m0Bias = 127;

// Magnitude code of `a` >= 0 on the E2M1 grid. The thresholds are the midpoints between grid
// values; a midpoint goes to the even code (numerics.md section 1).
uint8_t E2m1MagnitudeCode(float a) {
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.f) return 6;
  return 7;
}

int64_t BlockSize(WeightFormat f) {
  switch (f) {
    case WeightFormat::kMxfp4:
      return kMxfp4Block;
    case WeightFormat::kNvfp4:
      return kNvfp4Block;
    case WeightFormat::kBf16:
      return 1;
  }
  return 1;
}

bool IsFp4(WeightFormat f) { return f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4; }

void SetNibble(uint8_t* packed, int64_t k, uint8_t code) {
  uint8_t& byte = packed[k / 2];
  byte = k % 2 == 0 ? (byte & 0xF0) | code : (byte & 0x0F) | (code << 4);
}

// Decoded block scale (block `b` of row `r`) of an FP4 matrix.
float BlockScale(const WeightMatrix& w, int64_t r, int64_t b) {
  const int64_t blocks_per_row = w.cols / BlockSize(w.format);
  const uint8_t bits = w.scales.As<const uint8_t>()[r * blocks_per_row + b];
  return w.format == WeightFormat::kMxfp4 ? Ue8m0ToFloat(bits) : E4m3ToFloat(bits);
}

// Dtypes and shapes of `w`'s views, without reading their contents.
absl::Status CheckLayout(const WeightMatrix& w, int64_t rows, int64_t cols,
                         absl::string_view name) {
  if (w.rows != rows || w.cols != cols || rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", WeightFormatName(w.format),
                                                   " matrix is [", w.rows, ", ", w.cols,
                                                   "], expected [", rows, ", ", cols, "]"));
  }
  const int64_t block = BlockSize(w.format);
  if (cols % block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": cols = ", cols, " is not a multiple of the ",
                     WeightFormatName(w.format), " block of ", block));
  }
  const std::string values = absl::StrCat(name, ".values");
  const std::string scales = absl::StrCat(name, ".scales");
  switch (w.format) {
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4: {
      const DType scale_dtype = w.format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3;
      if (absl::Status s = CheckTensor(w.values, values, DType::kU8, {rows, cols / 2}); !s.ok()) {
        return s;
      }
      return CheckTensor(w.scales, scales, scale_dtype, {rows, cols / block});
    }
    case WeightFormat::kBf16:
      if (w.scales.present()) {
        return absl::InvalidArgumentError(absl::StrCat(scales, ": a BF16 matrix has no scales"));
      }
      return CheckTensor(w.values, values, DType::kBF16, {rows, cols});
  }
  return absl::InvalidArgumentError(absl::StrCat(name, ": unknown weight format"));
}

// INVALID_ARGUMENT naming the first element of `t` (2-D, elements of type T) for which `bad`
// holds, or OK.
template <typename T>
absl::Status RejectFirst(const TensorView& t, const std::string& what,
                         const std::function<bool(T)>& bad) {
  const T* p = t.As<const T>();
  const int64_t n = t.NumElements();
  for (int64_t i = 0; i < n; ++i) {
    if (bad(p[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " at [", i / t.dim(1), ", ", i % t.dim(1), "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckContents(const WeightMatrix& w, absl::string_view name) {
  switch (w.format) {
    case WeightFormat::kMxfp4:
      return RejectFirst<uint8_t>(w.scales, absl::StrCat(name, ".scales: NaN UE8M0 scale"),
                                  [](uint8_t b) { return b == kUe8m0Nan; });
    case WeightFormat::kNvfp4:
      return RejectFirst<uint8_t>(w.scales, absl::StrCat(name, ".scales: NaN E4M3 scale"),
                                  [](uint8_t b) { return (b & 0x7F) == kE4m3NanBits; });
    case WeightFormat::kBf16:
      return RejectFirst<uint16_t>(w.values, absl::StrCat(name, ".values: non-finite BF16 value"),
                                   [](uint16_t b) { return (b & 0x7F80) == 0x7F80; });
  }
  return absl::OkStatus();
}

// Smallest e with 6 * 2^e >= amax > 0, computed against the exact product so that rounding in
// amax / 6 cannot make a block saturate.
int SmallestCoveringExponent(float amax) {
  int e = 0;
  std::frexp(amax / kE2m1Max, &e);
  while (std::ldexp(kE2m1Max, e - 1) >= amax) --e;
  while (std::ldexp(kE2m1Max, e) < amax) ++e;
  return e;
}

// Scale bits for a block whose largest magnitude is `amax` (already divided by the global scale
// for MXFP4). An all-zero MXFP4 block gets 2^0: any scale represents it exactly.
uint8_t BlockScaleBits(WeightFormat f, float amax, float global_scale) {
  if (f == WeightFormat::kNvfp4) return FloatToE4m3(amax / kE2m1Max / global_scale);
  if (amax == 0.f) return kUe8m0Bias;
  const int e = std::clamp(SmallestCoveringExponent(amax / global_scale), -kUe8m0Bias, kUe8m0Bias);
  return static_cast<uint8_t>(e + kUe8m0Bias);
}

void QuantizeFp4Row(const float* in, float global_scale, const WeightMatrix& w, int64_t r) {
  const int64_t block = BlockSize(w.format);
  uint8_t* packed = w.values.As<uint8_t>() + r * (w.cols / 2);
  uint8_t* scales = w.scales.As<uint8_t>() + r * (w.cols / block);
  for (int64_t b = 0; b < w.cols / block; ++b) {
    const float* x = in + b * block;
    float amax = 0.f;
    for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(x[j]));
    scales[b] = BlockScaleBits(w.format, amax, global_scale);
    const float unit = BlockScale(w, r, b) * global_scale;
    for (int64_t j = 0; j < block; ++j) {
      SetNibble(packed, b * block + j, unit == 0.f ? 0 : FloatToE2m1(x[j] / unit));
    }
  }
}

void QuantizeBf16Row(const float* in, float global_scale, const WeightMatrix& w, int64_t r) {
  uint16_t* out = w.values.As<uint16_t>() + r * w.cols;
  for (int64_t k = 0; k < w.cols; ++k) out[k] = FloatToBf16(in[k] / global_scale);
}

void DequantizeRow(const WeightMatrix& w, int64_t r, float global_scale, float* out) {
  if (!IsFp4(w.format)) {
    const uint16_t* v = w.values.As<const uint16_t>() + r * w.cols;
    for (int64_t k = 0; k < w.cols; ++k) out[k] = Bf16ToFloat(v[k]) * global_scale;
    return;
  }
  // The block scale is decoded once per block and the 16 E2M1 values come from a table; the
  // product keeps the order (value * block scale) * global scale, whose first step is exact.
  float table[16];
  for (int c = 0; c < 16; ++c) table[c] = E2m1ToFloat(static_cast<uint8_t>(c));
  const int64_t block = BlockSize(w.format);
  const uint8_t* packed = w.values.As<const uint8_t>() + r * (w.cols / 2);
  for (int64_t b = 0; b < w.cols / block; ++b) {
    const float scale = BlockScale(w, r, b);
    for (int64_t k = b * block; k < (b + 1) * block; k += 2) {
      const uint8_t byte = packed[k / 2];
      out[k] = (table[byte & 0x0F] * scale) * global_scale;
      out[k + 1] = (table[byte >> 4] * scale) * global_scale;
    }
  }
}

absl::Status CheckGlobalScale(float global_scale) {
  if (std::isfinite(global_scale) && global_scale > 0.f) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("global_scale: must be finite and positive, got ", global_scale));
}

}  // namespace

float E2m1ToFloat(uint8_t code) {
  const float magnitude = kE2m1Magnitudes[code & 0x7];
  return (code & 0x8) != 0 ? -magnitude : magnitude;
}

uint8_t FloatToE2m1(float x) {
  if (std::isnan(x)) return 0;
  const uint8_t magnitude = E2m1MagnitudeCode(std::fabs(x));
  // Anything that rounds to zero, -0.0 included, is the canonical code 0.
  if (magnitude == 0) return 0;
  return std::signbit(x) ? (0x8 | magnitude) : magnitude;
}

float E4m3ToFloat(uint8_t bits) {
  if ((bits & 0x7F) == kE4m3NanBits) return std::numeric_limits<float>::quiet_NaN();
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  // Subnormal: m * 2^-9; normal: (1 + m/8) * 2^(e-7) = (8 + m) * 2^(e-10).
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa), -9)
                              : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return (bits & 0x80) != 0 ? -magnitude : magnitude;
}

uint8_t FloatToE4m3(float x) {
  if (std::isnan(x)) return kE4m3NanBits;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kE4m3Max) return sign | kE4m3MaxBits;
  // Count grid steps of a's binade (step 2^(e-3); below 2^-6 the subnormal step 2^-9). Scaling by
  // a power of two is exact, so nearbyint is the only rounding. A step count of 16 carries into
  // the next binade, which the code arithmetic below handles by itself.
  int e = -6;
  if (a >= kE4m3MinNormal) {
    std::frexp(a, &e);
    e -= 1;
  }
  const int steps = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));
  return sign | static_cast<uint8_t>((e + 6) * 8 + steps);
}

float Ue8m0ToFloat(uint8_t bits) {
  if (bits == kUe8m0Nan) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.f, static_cast<int>(bits) - kUe8m0Bias);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  // Truncating a NaN could leave only zero mantissa bits (an infinity): force the quiet bit.
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040);
  const uint32_t round_nearest_even = 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + round_nearest_even) >> 16);
}

void Bf16ToFloatN(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16);
    const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 8), hi);
  }
#endif
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

void FloatToBf16N(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  // Eight values per half: round to nearest even on the integer bits, quiet NaNs as the scalar
  // path does, then narrow 2 x 8 x 32 -> 16 x 16 bits (packus works per 128-bit lane, hence the
  // permute that puts the lanes back in order).
  const auto round8 = [](const float* p) {
    const __m256 x = _mm256_loadu_ps(p);
    const __m256i u = _mm256_castps_si256(x);
    const __m256i upper = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(upper, _mm256_set1_epi32(0x0040));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, nan);
  };
  for (; i + 16 <= n; i += 16) {
    const __m256i packed = _mm256_packus_epi32(round8(in + i), round8(in + i + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
#endif
  for (; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

absl::string_view WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kMxfp4:
      return "MXFP4";
    case WeightFormat::kNvfp4:
      return "NVFP4";
    case WeightFormat::kBf16:
      return "BF16";
  }
  return "UNKNOWN";
}

absl::Status ValidateWeightMatrix(const WeightMatrix& w, int64_t rows, int64_t cols,
                                  absl::string_view name) {
  if (absl::Status s = CheckLayout(w, rows, cols, name); !s.ok()) return s;
  return CheckContents(w, name);
}

void DequantizeRows(const WeightMatrix& w, int64_t row_begin, int64_t row_end, float global_scale,
                    float* out) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    DequantizeRow(w, r, global_scale, out + (r - row_begin) * w.cols);
  }
}

absl::Status DequantizeMatrix(const WeightMatrix& w, float global_scale, TensorView out) {
  if (absl::Status s = ValidateWeightMatrix(w, w.rows, w.cols, "w"); !s.ok()) return s;
  if (absl::Status s = CheckGlobalScale(global_scale); !s.ok()) return s;
  if (absl::Status s = CheckTensor(out, "out", DType::kF32, {w.rows, w.cols}); !s.ok()) return s;
  DequantizeRows(w, 0, w.rows, global_scale, out.As<float>());
  return absl::OkStatus();
}

absl::Status QuantizeMatrix(const float* in, int64_t rows, int64_t cols, float global_scale,
                            const WeightMatrix& w) {
  if (absl::Status s = CheckLayout(w, rows, cols, "w"); !s.ok()) return s;
  if (absl::Status s = CheckGlobalScale(global_scale); !s.ok()) return s;
  const TensorView input = MakeView(DType::kF32, {rows, cols}, in);
  if (absl::Status s = CheckTensor(input, "in", DType::kF32, {rows, cols}); !s.ok()) return s;
  if (absl::Status s = RejectFirst<float>(input, "in: non-finite value",
                                          [](float v) { return !std::isfinite(v); });
      !s.ok()) {
    return s;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (IsFp4(w.format)) {
      QuantizeFp4Row(in + r * cols, global_scale, w, r);
    } else {
      QuantizeBf16Row(in + r * cols, global_scale, w, r);
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
