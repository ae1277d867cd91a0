// AVX2 (the baseline ISA): one block is two or four vectors; the amax, the non-finite check and
// the rounding all stay in registers.
#include "kernels/cpu/quantize_rows.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/fp4_gemm.h"

namespace moe::cpu {
namespace {

__m256 Bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Largest |v[i]| of one block, or a negative value when the block holds NaN or Inf.
float BlockMax(const __m256* v, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  __m256 unordered = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) {
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float block_max = _mm_cvtss_f32(m);
  return _mm256_movemask_ps(unordered) != 0 || !std::isfinite(block_max) ? -1.f : block_max;
}

// Quantizes one block held in v[0, n) (n = block / 8 vectors) to int16.
void QuantizeBlock(const __m256* v, int n, int16_t* q, float* scale) {
  const float block_max = BlockMax(v, n);
  if (block_max < 0.f) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < 8 * n; ++i) q[i] = 0;
    return;
  }
  *scale = block_max / kActQuantMax;
  const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? kActQuantMax / block_max : 0.f);
  for (int i = 0; i < n; i += 2) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inverse));
    // packs works per 128-bit lane; the permute restores column order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), packed);
  }
}

// Same to int8, with the block sum of q.
void QuantizeBlock8(const __m256* v, int n, int8_t* q, float* scale, int32_t* bias) {
  const float block_max = BlockMax(v, n);
  if (block_max < 0.f) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < 8 * n; ++i) q[i] = 0;
    *bias = 0;
    return;
  }
  *scale = block_max / kActQuantMax8;
  const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? kActQuantMax8 / block_max : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < n; i += 2) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inverse));
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(lo, hi));
    const __m256i words = _mm256_packs_epi32(lo, hi);  // lanes: lo0-3 hi0-3 | lo4-7 hi4-7
    const __m128i bytes =
        _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    // bytes: lo0-3 hi0-3 lo4-7 hi4-7; restore column order.
    const __m128i ordered = _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8 * i), ordered);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  *bias = kInt8WeightBias * _mm_cvtsi128_si32(s4);
}

}  // namespace

void QuantizeRowInt8(const float* x, int64_t cols, int block, int8_t* q, float* scales,
                     int32_t* bias) {
  const int n = block / 8;
  __m256 v[4];
  for (int64_t b = 0; b < cols / block; ++b) {
    for (int i = 0; i < n; ++i) v[i] = _mm256_loadu_ps(x + b * block + 8 * i);
    QuantizeBlock8(v, n, q + b * block, scales + b, bias + b);
  }
}

void QuantizeRowInt16(const float* x, int64_t cols, int block, int16_t* q, float* scales) {
  const int n = block / 8;
  __m256 v[4];
  for (int64_t b = 0; b < cols / block; ++b) {
    for (int i = 0; i < n; ++i) v[i] = _mm256_loadu_ps(x + b * block + 8 * i);
    QuantizeBlock(v, n, q + b * block, scales + b);
  }
}

void QuantizeBf16RowInt16(const uint16_t* x, int64_t cols, int block, int16_t* q, float* scales) {
  const int n = block / 8;
  __m256 v[4];
  for (int64_t b = 0; b < cols / block; ++b) {
    for (int i = 0; i < n; ++i) v[i] = Bf16x8(x + b * block + 8 * i);
    QuantizeBlock(v, n, q + b * block, scales + b);
  }
}

void Bf16RowToFloat(const uint16_t* x, int64_t cols, float* out) {
  int64_t k = 0;
  for (; k + 8 <= cols; k += 8) _mm256_storeu_ps(out + k, Bf16x8(x + k));
  for (; k < cols; ++k) {
    const uint32_t bits = static_cast<uint32_t>(x[k]) << 16;
    std::memcpy(&out[k], &bits, sizeof(float));
  }
}

}  // namespace moe::cpu
