// AVX2: eight hidden columns at a time; each route adds weight * y with a separate multiply and
// add, as the reference does.
#include "kernels/cpu/combine.h"

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/cpu_heuristics.h"

namespace moe::cpu {
namespace {

// fp32 -> BF16 bits, round-to-nearest-even; NaN becomes the quiet NaN 0x7FC0.
__m128i ToBf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i value =
      _mm256_blendv_epi8(_mm256_srli_epi32(rounded, 16), _mm256_set1_epi32(0x7FC0), is_nan);
  // Narrow the eight 32-bit lanes (each < 2^16) to 16 bits.
  const __m256i packed = _mm256_packus_epi32(value, value);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// acc = sum over token t's routes of weight * f(route's row); f loads a vector or a scalar.
template <typename V, typename Load, typename Madd>
V SumRoutes(const CombineParams& p, int64_t t, int64_t c, V acc, Load load, Madd madd) {
  for (int64_t k = 0; k < p.top_k; ++k) {
    const int32_t r = p.route_of[t * p.top_k + k];
    if (r >= 0) acc = madd(acc, p.weights[t * p.top_k + k], load(p.expert_out + r * p.hidden + c));
  }
  for (int64_t s = 0; s < p.shared; ++s) {
    const int32_t r = p.shared_route_of[t * p.shared + s];
    if (r >= 0) acc = madd(acc, 1.f, load(p.expert_out + r * p.hidden + c));
  }
  return acc;
}

}  // namespace

void CombineRoutes(const CombineParams& p, int thread_index, int thread_count) {
  const Range tokens = EvenSplit(p.tokens, thread_index, thread_count);
  const auto load8 = [](const float* x) { return _mm256_loadu_ps(x); };
  const auto madd8 = [](__m256 acc, float w, __m256 y) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(w), y));
  };
  const auto load1 = [](const float* x) { return *x; };
  const auto madd1 = [](float acc, float w, float y) { return acc + w * y; };
  for (int64_t t = tokens.begin; t < tokens.end; ++t) {
    // A token with no route on this shard (padding, or all its experts elsewhere) is zeros: one
    // memset instead of a sum over nothing per eight columns.
    bool routed = false;
    for (int64_t k = 0; k < p.top_k && !routed; ++k) routed = p.route_of[t * p.top_k + k] >= 0;
    for (int64_t s = 0; s < p.shared && !routed; ++s) routed = p.shared_route_of[t * p.shared + s] >= 0;
    if (!routed) {
      if (p.out_f32 != nullptr) {
        std::memset(p.out_f32 + t * p.hidden, 0, p.hidden * sizeof(float));
      } else {
        std::memset(p.out_bf16 + t * p.hidden, 0, p.hidden * sizeof(uint16_t));
      }
      continue;
    }
    int64_t c = 0;
    for (; c + 8 <= p.hidden; c += 8) {
      const __m256 acc = SumRoutes(p, t, c, _mm256_setzero_ps(), load8, madd8);
      if (p.out_f32 != nullptr) {
        _mm256_storeu_ps(p.out_f32 + t * p.hidden + c, acc);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p.out_bf16 + t * p.hidden + c), ToBf16x8(acc));
      }
    }
    for (; c < p.hidden; ++c) {
      const float acc = SumRoutes(p, t, c, 0.f, load1, madd1);
      if (p.out_f32 != nullptr) {
        p.out_f32[t * p.hidden + c] = acc;
      } else {
        p.out_bf16[t * p.hidden + c] = ToBf16(acc);
      }
    }
  }
}

}  // namespace moe::cpu
