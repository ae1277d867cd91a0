// AVX-512 (F, BW, VL; VNNI when the unit is compiled with -mavx512vnni) vector primitives of the
// FP4 kernels (fp4_gemm_impl.h): one 16-row group in one 512-bit vector. Included only by per-ISA
// translation units, inside the namespace moe::cpu::MOE_CPU_ISA that the including unit names.
#ifndef MOE_KERNELS_CPU_SIMD_AVX512_H_
#define MOE_KERNELS_CPU_SIMD_AVX512_H_

#include <immintrin.h>

#include <cstdint>

#ifndef MOE_CPU_ISA
#error "define MOE_CPU_ISA (the namespace of this instruction set) before including"
#endif

namespace moe::cpu::MOE_CPU_ISA {

struct Simd {
  static constexpr int kHalves = 1;
  static constexpr int kVecBytes = 64;
  static constexpr int kLanes = 16;
  static constexpr int kPanelTokens = 8;
  using VI = __m512i;
  using VF = __m512;

  // A hint only: an address past the end of a buffer is allowed and never faults.
  static void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static VI LoadI(const void* p) { return _mm512_load_si512(p); }
  static void StoreI(void* p, VI v) { _mm512_store_si512(p, v); }
  static VI ZeroI() { return _mm512_setzero_si512(); }
  static VI LowNibbleMask() { return _mm512_set1_epi8(0x0F); }
  static VI CodeTable() {
    const __m128i lane = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm512_broadcast_i32x4(lane);
  }
  static VI And(VI a, VI b) { return _mm512_and_si512(a, b); }
  static VI ShiftRight4(VI v) { return _mm512_srli_epi16(v, 4); }
  static VI Lookup(VI table, VI index) { return _mm512_shuffle_epi8(table, index); }
  static VI HighBytesLow(VI v) { return _mm512_unpacklo_epi8(_mm512_setzero_si512(), v); }
  static VI HighBytesHigh(VI v) { return _mm512_unpackhi_epi8(_mm512_setzero_si512(), v); }
  static VI BroadcastPair(const int16_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }
#if defined(__AVX512VNNI__)
  static VI DotAcc(VI acc, VI a, VI b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
  static VI DotAcc(VI acc, VI a, VI b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif

  static VI BiasedCodeTable() {
    const __m128i lane = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return _mm512_broadcast_i32x4(lane);
  }
  static VI RowQuads(VI v) {
    const __m128i lane = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(lane));
  }
  static VI BroadcastQuad(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }
  static VI Set1I32(int32_t v) { return _mm512_set1_epi32(v); }
  static VI AddI32(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static VI SubI32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
  // acc + per int32 lane the dot product of 4 unsigned bytes of w with 4 signed bytes of x.
#if defined(__AVX512VNNI__)
  static constexpr bool kFusedDot8 = true;
  static VI DotAccU8S8(VI acc, VI w, VI x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
  static constexpr bool kFusedDot8 = false;
  static VI DotAccU8S8(VI acc, VI w, VI x) { return AccumulatePairs(acc, BytePairs(w, x)); }
#endif
  static VI BytePairs(VI w, VI x) { return _mm512_maddubs_epi16(w, x); }
  static VI AddI16(VI a, VI b) { return _mm512_add_epi16(a, b); }
  static VI AccumulatePairs(VI acc, VI v) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(v, _mm512_set1_epi16(1)));
  }

  static VF ZeroF() { return _mm512_setzero_ps(); }
  static VF Set1F(float v) { return _mm512_set1_ps(v); }
  static VF LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreF(float* p, VF v) { _mm512_storeu_ps(p, v); }
  static VF ToFloat(VI v) { return _mm512_cvtepi32_ps(v); }
  static VF Mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static VF Fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }

  static VF Ue8m0(const uint8_t* p) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 23));
  }
  static VF E4m3(const uint8_t* p) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i magnitude =
        _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x7F)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x80)), 24);
    const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
  }
};

}  // namespace moe::cpu::MOE_CPU_ISA

#endif  // MOE_KERNELS_CPU_SIMD_AVX512_H_
