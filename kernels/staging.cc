// Activation staging (staging.h; numerics.md section 3). Scalar reference code: the element
// codecs come from formats.h, so every backend rounds exactly as the contract says.
#include "kernels/staging.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"

namespace moe {
namespace {

constexpr int64_t kMxfp8WordSpan = 4 * kMxfp8Group;     // hidden elements per packed int32
constexpr int64_t kNvfp4WordSpan = 4 * kNvfp4ActGroup;  // hidden elements per packed int32
constexpr float kE4m3Max = 448.f;
constexpr float kE2m1Max = 6.f;
// The NVFP4 token-scale floor "tiny" of numerics.md: the smallest normal fp32, so an all-zero row
// gets a positive (subnormal) x_scale instead of a division by zero.
constexpr float kNvfp4TokenAmaxFloor = FLT_MIN;
constexpr int64_t kMaxSharedBlockM = std::numeric_limits<int32_t>::max();

// x is F32 or BF16 [T, H] with H a multiple of `multiple`.
absl::Status CheckHidden(const TensorView& x, absl::string_view name, int64_t multiple) {
  if (absl::Status s = CheckTensorOneOf(x, name, {DType::kF32, DType::kBF16}, {kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  if (x.dim(1) % multiple != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": hidden size ", x.dim(1), " is not a multiple of ", multiple));
  }
  return absl::OkStatus();
}

// Row t of an F32 or BF16 [T, H] tensor, as fp32.
void LoadRow(const TensorView& x, int64_t t, float* out) {
  const int64_t h = x.dim(1);
  if (x.dtype == DType::kF32) {
    std::copy_n(x.As<const float>() + t * h, h, out);
    return;
  }
  const uint16_t* row = x.As<const uint16_t>() + t * h;
  for (int64_t k = 0; k < h; ++k) out[k] = Bf16ToFloat(row[k]);
}

// Largest |v|; NaN elements are skipped (they stay NaN through the codecs).
float AbsMax(const float* v, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(v[i]) > amax) amax = std::fabs(v[i]);
  }
  return amax;
}

int32_t PackFourBytes(const uint8_t* bytes) {
  const uint32_t word = static_cast<uint32_t>(bytes[0]) | static_cast<uint32_t>(bytes[1]) << 8 |
                        static_cast<uint32_t>(bytes[2]) << 16 |
                        static_cast<uint32_t>(bytes[3]) << 24;
  return std::bit_cast<int32_t>(word);
}

// Byte j (least significant first) of a packed word: the scale of group 4w + j.
uint8_t UnpackByte(int32_t word, int64_t j) {
  return static_cast<uint8_t>(std::bit_cast<uint32_t>(word) >> (8 * j));
}

void PackRow(const std::vector<uint8_t>& bytes, int32_t* words) {
  for (size_t w = 0; w < bytes.size() / 4; ++w) words[w] = PackFourBytes(&bytes[4 * w]);
}

// Scale rounded up to a power of two: biased exponent plus one if any mantissa bit is set,
// clamped to [1, 254] (only an infinite s reaches the clamp, since amax >= 1e-4).
uint8_t Ue8m0RoundUp(float s) {
  const uint32_t bits = std::bit_cast<uint32_t>(s);
  const int biased = static_cast<int>((bits >> 23) & 0xFF);
  const int round_up = (bits & 0x7FFFFF) != 0 ? 1 : 0;
  return static_cast<uint8_t>(std::clamp(biased + round_up, 1, 254));
}

float Mxfp8GroupScale(const float* x) {
  return std::max(AbsMax(x, kMxfp8Group), kMxfp8AmaxFloor) / kE4m3Max;
}

// Quantizes one group of 32 with a UE8M0 scale; returns the scale byte.
uint8_t QuantizeMxfp8Group(const float* x, uint8_t* q) {
  const uint8_t e = Ue8m0RoundUp(Mxfp8GroupScale(x));
  const float inverse = std::ldexp(1.f, 127 - e);
  for (int64_t j = 0; j < kMxfp8Group; ++j) q[j] = FloatToE4m3(x[j] * inverse);
  return e;
}

// Quantizes one group of 16 against the token scale; returns the E4M3 scale byte.
uint8_t QuantizeNvfp4Group(const float* x, float x_scale, uint8_t* packed) {
  const uint8_t sf_bits = FloatToE4m3(AbsMax(x, kNvfp4ActGroup) / (kE2m1Max * x_scale));
  const float sf = E4m3ToFloat(sf_bits);
  const float unit = sf * x_scale;
  for (int64_t j = 0; j < kNvfp4ActGroup; j += 2) {
    const uint8_t even = sf == 0.f ? 0 : FloatToE2m1(x[j] / unit);
    const uint8_t odd = sf == 0.f ? 0 : FloatToE2m1(x[j + 1] / unit);
    packed[j / 2] = static_cast<uint8_t>(even | odd << 4);
  }
  return sf_bits;
}

// Group scales of row t of MXFP8 scales (I32 packed UE8M0 or F32), as fp32.
void Mxfp8RowScales(const TensorView& scales, int64_t t, int64_t groups, float* out) {
  if (scales.dtype == DType::kF32) {
    std::copy_n(scales.As<const float>() + t * groups, groups, out);
    return;
  }
  const int32_t* words = scales.As<const int32_t>() + t * scales.dim(1);
  for (int64_t g = 0; g < groups; ++g) out[g] = Ue8m0ToFloat(UnpackByte(words[g / 4], g % 4));
}

absl::Status CheckMxfp8Scales(const TensorView& q, const TensorView& scales) {
  const int64_t t_count = q.dim(0);
  const int64_t h = q.dim(1);
  if (absl::Status s =
          CheckTensorOneOf(scales, "scales", {DType::kI32, DType::kF32}, {t_count, kAnyDim});
      !s.ok()) {
    return s;
  }
  const bool packed = scales.dtype == DType::kI32;
  const int64_t span = packed ? kMxfp8WordSpan : kMxfp8Group;
  if (h % span != 0) {
    return absl::InvalidArgumentError(absl::StrCat("q: hidden size ", h, " is not a multiple of ",
                                                   span, " (scales are ", DTypeName(scales.dtype),
                                                   ")"));
  }
  if (absl::Status s = CheckTensor(scales, "scales", scales.dtype, {t_count, h / span}); !s.ok()) {
    return s;
  }
  std::vector<float> row(h / kMxfp8Group);
  for (int64_t t = 0; t < t_count; ++t) {
    Mxfp8RowScales(scales, t, h / kMxfp8Group, row.data());
    for (size_t g = 0; g < row.size(); ++g) {
      if (!std::isfinite(row[g])) {
        return absl::InvalidArgumentError(
            absl::StrCat("scales: non-finite scale of token ", t, ", group ", g));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNvfp4Scales(const TensorView& block_scales, const TensorView& token_scale) {
  const int32_t* words = block_scales.As<const int32_t>();
  for (int64_t i = 0; i < block_scales.NumElements(); ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      if ((UnpackByte(words[i], j) & 0x7F) == 0x7F) {
        return absl::InvalidArgumentError(absl::StrCat("block_scales: NaN E4M3 scale of token ",
                                                       i / block_scales.dim(1), ", group ",
                                                       (i % block_scales.dim(1)) * 4 + j));
      }
    }
  }
  for (int64_t t = 0; t < token_scale.NumElements(); ++t) {
    if (!std::isfinite(token_scale.As<const float>()[t])) {
      return absl::InvalidArgumentError(absl::StrCat("token_scale: non-finite at token ", t));
    }
  }
  return absl::OkStatus();
}

// Row of the shared-expert scale buffer that token t goes to (numerics.md section 3).
int64_t SharedExpertRow(int64_t t, int64_t block_m, int64_t aligned) {
  const int64_t blk = t / block_m;
  const int64_t m = t % block_m;
  return blk * aligned + (m / 128) * 128 + (m % 32) * 4 + (m % 128) / 32;
}

bool IsPadded(const TensorView& is_padding, int64_t t) {
  return is_padding.present() && is_padding.As<const uint8_t>()[t] != 0;
}

int64_t ReadId(const TensorView& ids, int64_t i) {
  return ids.dtype == DType::kI32 ? ids.As<const int32_t>()[i] : ids.As<const int64_t>()[i];
}

float ReadWeight(const TensorView& weights, int64_t i) {
  return weights.dtype == DType::kF32 ? weights.As<const float>()[i]
                                      : Bf16ToFloat(weights.As<const uint16_t>()[i]);
}

absl::Status CheckTopkLayout(const TensorView& ids, const TensorView& weights,
                             const TensorView& is_padding, int32_t num_experts,
                             const TensorView& out_ids, const TensorView& out_weights) {
  if (num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts: must be at least 1, got ", num_experts));
  }
  if (absl::Status s =
          CheckTensorOneOf(ids, "topk_ids", {DType::kI32, DType::kI64}, {kAnyDim, kAnyDim});
      !s.ok()) {
    return s;
  }
  const int64_t t_count = ids.dim(0);
  const int64_t k = ids.dim(1);
  absl::Status s =
      CheckTensorOneOf(weights, "topk_weights", {DType::kF32, DType::kBF16}, {t_count, k});
  // Absent means a default view: no data and no shape.
  if (s.ok() && (is_padding.present() || is_padding.rank() != 0)) {
    s = CheckTensor(is_padding, "is_padding", DType::kBool, {t_count});
  }
  if (s.ok()) s = CheckTensor(out_ids, "out_ids", DType::kI32, {t_count, k});
  if (s.ok()) s = CheckTensor(out_weights, "out_weights", DType::kF32, {t_count, k});
  return s;
}

absl::Status CheckTopkValues(const TensorView& ids, const TensorView& weights,
                             const TensorView& is_padding, int32_t num_experts) {
  const int64_t k = ids.dim(1);
  for (int64_t t = 0; t < ids.dim(0); ++t) {
    if (is_padding.present() && is_padding.As<const uint8_t>()[t] > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("is_padding: byte at [", t, "] is ",
                       static_cast<int>(is_padding.As<const uint8_t>()[t]), ", expected 0 or 1"));
    }
    if (IsPadded(is_padding, t)) continue;  // a padded token's routes are never read
    for (int64_t i = t * k; i < (t + 1) * k; ++i) {
      const int64_t id = ReadId(ids, i);
      if (id < -1 || id >= num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("topk_ids: id ", id, " at [", t, ", ",
                                                       i - t * k, "] is outside [-1, ", num_experts,
                                                       ")"));
      }
      if (!std::isfinite(ReadWeight(weights, i))) {
        return absl::InvalidArgumentError(
            absl::StrCat("topk_weights: non-finite weight at [", t, ", ", i - t * k, "]"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeMxfp8(const TensorView& x, TensorView q, TensorView scales) {
  if (absl::Status s = CheckHidden(x, "x", kMxfp8WordSpan); !s.ok()) return s;
  const int64_t t_count = x.dim(0);
  const int64_t h = x.dim(1);
  if (absl::Status s = CheckTensor(q, "q", DType::kE4M3, {t_count, h}); !s.ok()) return s;
  if (absl::Status s = CheckTensor(scales, "scales", DType::kI32, {t_count, h / kMxfp8WordSpan});
      !s.ok()) {
    return s;
  }
  std::vector<float> row(h);
  std::vector<uint8_t> exponents(h / kMxfp8Group);
  for (int64_t t = 0; t < t_count; ++t) {
    LoadRow(x, t, row.data());
    uint8_t* q_row = q.As<uint8_t>() + t * h;
    for (size_t g = 0; g < exponents.size(); ++g) {
      exponents[g] = QuantizeMxfp8Group(&row[g * kMxfp8Group], q_row + g * kMxfp8Group);
    }
    PackRow(exponents, scales.As<int32_t>() + t * (h / kMxfp8WordSpan));
  }
  return absl::OkStatus();
}

absl::Status QuantizeMxfp8Fp32Scale(const TensorView& x, TensorView q, TensorView scales) {
  if (absl::Status s = CheckHidden(x, "x", kMxfp8Group); !s.ok()) return s;
  const int64_t t_count = x.dim(0);
  const int64_t h = x.dim(1);
  if (absl::Status s = CheckTensor(q, "q", DType::kE4M3, {t_count, h}); !s.ok()) return s;
  if (absl::Status s = CheckTensor(scales, "scales", DType::kF32, {t_count, h / kMxfp8Group});
      !s.ok()) {
    return s;
  }
  std::vector<float> row(h);
  for (int64_t t = 0; t < t_count; ++t) {
    LoadRow(x, t, row.data());
    for (int64_t g = 0; g < h / kMxfp8Group; ++g) {
      const float* group = &row[g * kMxfp8Group];
      const float s = Mxfp8GroupScale(group);
      scales.As<float>()[t * (h / kMxfp8Group) + g] = s;
      uint8_t* q_group = q.As<uint8_t>() + t * h + g * kMxfp8Group;
      for (int64_t j = 0; j < kMxfp8Group; ++j) q_group[j] = FloatToE4m3(group[j] / s);
    }
  }
  return absl::OkStatus();
}

absl::Status DequantizeMxfp8(const TensorView& q, const TensorView& scales, TensorView out) {
  if (absl::Status s = CheckTensor(q, "q", DType::kE4M3, {kAnyDim, kAnyDim}); !s.ok()) return s;
  if (absl::Status s = CheckMxfp8Scales(q, scales); !s.ok()) return s;
  const int64_t t_count = q.dim(0);
  const int64_t h = q.dim(1);
  if (absl::Status s = CheckTensor(out, "out", DType::kF32, {t_count, h}); !s.ok()) return s;
  std::vector<float> group_scales(h / kMxfp8Group);
  for (int64_t t = 0; t < t_count; ++t) {
    Mxfp8RowScales(scales, t, h / kMxfp8Group, group_scales.data());
    const uint8_t* q_row = q.As<const uint8_t>() + t * h;
    float* out_row = out.As<float>() + t * h;
    for (int64_t k = 0; k < h; ++k) {
      out_row[k] = E4m3ToFloat(q_row[k]) * group_scales[k / kMxfp8Group];
    }
  }
  return absl::OkStatus();
}

absl::Status QuantizeNvfp4PerToken(const TensorView& x, TensorView q, TensorView block_scales,
                                   TensorView token_scale) {
  if (absl::Status s = CheckHidden(x, "x", kNvfp4WordSpan); !s.ok()) return s;
  const int64_t t_count = x.dim(0);
  const int64_t h = x.dim(1);
  absl::Status s = CheckTensor(q, "q", DType::kU8, {t_count, h / 2});
  if (s.ok()) {
    s = CheckTensor(block_scales, "block_scales", DType::kI32, {t_count, h / kNvfp4WordSpan});
  }
  if (s.ok()) s = CheckTensor(token_scale, "token_scale", DType::kF32, {t_count});
  if (!s.ok()) return s;
  std::vector<float> row(h);
  std::vector<uint8_t> sf_bits(h / kNvfp4ActGroup);
  for (int64_t t = 0; t < t_count; ++t) {
    LoadRow(x, t, row.data());
    const float x_scale =
        std::max(AbsMax(row.data(), h), kNvfp4TokenAmaxFloor) / kNvfp4TokenDivisor;
    token_scale.As<float>()[t] = x_scale;
    uint8_t* q_row = q.As<uint8_t>() + t * (h / 2);
    for (size_t g = 0; g < sf_bits.size(); ++g) {
      sf_bits[g] =
          QuantizeNvfp4Group(&row[g * kNvfp4ActGroup], x_scale, q_row + g * kNvfp4ActGroup / 2);
    }
    PackRow(sf_bits, block_scales.As<int32_t>() + t * (h / kNvfp4WordSpan));
  }
  return absl::OkStatus();
}

absl::Status DequantizeNvfp4PerToken(const TensorView& q, const TensorView& block_scales,
                                     const TensorView& token_scale, TensorView out) {
  if (absl::Status s = CheckTensor(q, "q", DType::kU8, {kAnyDim, kAnyDim}); !s.ok()) return s;
  const int64_t t_count = q.dim(0);
  const int64_t h = 2 * q.dim(1);
  if (h % kNvfp4WordSpan != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q: hidden size ", h, " is not a multiple of ", kNvfp4WordSpan));
  }
  absl::Status s =
      CheckTensor(block_scales, "block_scales", DType::kI32, {t_count, h / kNvfp4WordSpan});
  if (s.ok()) s = CheckTensor(token_scale, "token_scale", DType::kF32, {t_count});
  if (s.ok()) s = CheckTensor(out, "out", DType::kF32, {t_count, h});
  if (s.ok()) s = CheckNvfp4Scales(block_scales, token_scale);
  if (!s.ok()) return s;
  for (int64_t t = 0; t < t_count; ++t) {
    const uint8_t* q_row = q.As<const uint8_t>() + t * (h / 2);
    const int32_t* words = block_scales.As<const int32_t>() + t * (h / kNvfp4WordSpan);
    const float x_scale = token_scale.As<const float>()[t];
    float* out_row = out.As<float>() + t * h;
    for (int64_t k = 0; k < h; ++k) {
      const int64_t g = k / kNvfp4ActGroup;
      const float sf = E4m3ToFloat(UnpackByte(words[g / 4], g % 4));
      const uint8_t code = k % 2 == 0 ? q_row[k / 2] & 0x0F : q_row[k / 2] >> 4;
      out_row[k] = E2m1ToFloat(code) * sf * x_scale;
    }
  }
  return absl::OkStatus();
}

absl::Status StageBf16(const TensorView& x, TensorView out) {
  if (absl::Status s = CheckHidden(x, "x", 1); !s.ok()) return s;
  if (absl::Status s = CheckTensor(out, "out", DType::kBF16, {x.dim(0), x.dim(1)}); !s.ok()) {
    return s;
  }
  const int64_t n = x.NumElements();
  uint16_t* dst = out.As<uint16_t>();
  if (x.dtype == DType::kBF16) {
    std::copy_n(x.As<const uint16_t>(), n, dst);
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(x.As<const float>()[i]);
  return absl::OkStatus();
}

absl::Status WriteSharedExpertScales(const TensorView& scales, int64_t block_m, TensorView out) {
  if (absl::Status s = CheckTensor(scales, "scales", DType::kI32, {kAnyDim, kAnyDim}); !s.ok()) {
    return s;
  }
  if (block_m < 1 || block_m > kMaxSharedBlockM) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_m: must be in [1, ", kMaxSharedBlockM, "], got ", block_m));
  }
  const int64_t t_count = scales.dim(0);
  const int64_t words = scales.dim(1);
  if (absl::Status s = CheckTensor(out, "out", DType::kI32, {kAnyDim, words}); !s.ok()) return s;
  const int64_t aligned = (block_m + 127) / 128 * 128;
  const int64_t rows_needed = (t_count + block_m - 1) / block_m * aligned;
  if (out.dim(0) < rows_needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "out: ", out.dim(0), " rows, needs at least ceil(T / B) * ceil(B / 128) * 128 = ",
        rows_needed, " for T = ", t_count, ", B = ", block_m));
  }
  for (int64_t t = 0; t < t_count; ++t) {
    std::copy_n(scales.As<const int32_t>() + t * words, words,
                out.As<int32_t>() + SharedExpertRow(t, block_m, aligned) * words);
  }
  return absl::OkStatus();
}

absl::Status ComputeL2Alpha(absl::Span<const float> w2_global_scale, float l2_activation_scale,
                            absl::Span<float> l2_alpha) {
  if (w2_global_scale.size() != l2_alpha.size()) {
    return absl::InvalidArgumentError(absl::StrCat("l2_alpha: has ", l2_alpha.size(),
                                                   " entries, w2_global_scale has ",
                                                   w2_global_scale.size()));
  }
  if (!std::isfinite(l2_activation_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("l2_activation_scale: not finite: ", l2_activation_scale));
  }
  for (size_t e = 0; e < l2_alpha.size(); ++e) {
    l2_alpha[e] = w2_global_scale[e] * l2_activation_scale;
  }
  return absl::OkStatus();
}

absl::Status RepackTopk(const TensorView& ids, const TensorView& weights,
                        const TensorView& is_padding, int32_t num_experts, TensorView out_ids,
                        TensorView out_weights) {
  if (absl::Status s = CheckTopkLayout(ids, weights, is_padding, num_experts, out_ids, out_weights);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckTopkValues(ids, weights, is_padding, num_experts); !s.ok()) return s;
  const int64_t k = ids.dim(1);
  for (int64_t t = 0; t < ids.dim(0); ++t) {
    const bool padded = IsPadded(is_padding, t);
    for (int64_t i = t * k; i < (t + 1) * k; ++i) {
      out_ids.As<int32_t>()[i] = padded ? -1 : static_cast<int32_t>(ReadId(ids, i));
      out_weights.As<float>()[i] = padded ? 0.f : ReadWeight(weights, i);
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
