// AVX2 vector primitives of the FP4 kernels (fp4_gemm_impl.h), one 16-row group in two 256-bit
// halves of 8 rows. Included only by per-ISA translation units, inside the namespace
// moe::cpu::MOE_CPU_ISA that the including unit names, so that no inline function is shared with
// units compiled for another instruction set.
#ifndef MOE_KERNELS_CPU_SIMD_AVX2_H_
#define MOE_KERNELS_CPU_SIMD_AVX2_H_

#include <immintrin.h>

#include <cstdint>

#ifndef MOE_CPU_ISA
#error "define MOE_CPU_ISA (the namespace of this instruction set) before including"
#endif

namespace moe::cpu::MOE_CPU_ISA {

struct Simd {
  static constexpr int kHalves = 2;  // vectors per 16-row group
  static constexpr int kVecBytes = 32;
  static constexpr int kLanes = 8;        // int32 / fp32 lanes
  static constexpr int kPanelTokens = 4;  // register tile of the panel path (16 registers)
  using VI = __m256i;
  using VF = __m256;

  // A hint only: an address past the end of a buffer is allowed and never faults.
  static void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static VI LoadI(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
  static void StoreI(void* p, VI v) { _mm256_store_si256(static_cast<__m256i*>(p), v); }
  static VI ZeroI() { return _mm256_setzero_si256(); }
  static VI LowNibbleMask() { return _mm256_set1_epi8(0x0F); }
  // 2 * E2M1 value of each code, per 128-bit lane as vpshufb wants it.
  static VI CodeTable() {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,  //
                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  }
  static VI And(VI a, VI b) { return _mm256_and_si256(a, b); }
  static VI ShiftRight4(VI v) { return _mm256_srli_epi16(v, 4); }
  static VI Lookup(VI table, VI index) { return _mm256_shuffle_epi8(table, index); }
  // Bytes 0-7 (8-15) of each 128-bit lane into the high bytes of int16 lanes.
  static VI HighBytesLow(VI v) { return _mm256_unpacklo_epi8(_mm256_setzero_si256(), v); }
  static VI HighBytesHigh(VI v) { return _mm256_unpackhi_epi8(_mm256_setzero_si256(), v); }
  // The int16 pair at p in every int32 lane.
  static VI BroadcastPair(const int16_t* p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }
  // acc + pairwise int16 dot products.
  static VI DotAcc(VI acc, VI a, VI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

  // ---- int8 activations (W4A8 panel path) ----
  // 2 * E2M1 value + 12 (kInt8WeightBias) of each code: unsigned bytes for vpmaddubsw.
  static VI BiasedCodeTable() {
    return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  //
                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  }
  // Reorders a looked-up half (see fp4_pack.h) so that each int32 lane holds one row's 4
  // consecutive columns: output byte 4j + k takes input byte 8 * (k / 2) + 2j + k % 2.
  static VI RowQuads(VI v) {
    const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,  //
                                           0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm256_shuffle_epi8(v, order);
  }
  // The 4 int8 activations at p in every int32 lane.
  static VI BroadcastQuad(const int8_t* p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }
  static VI Set1I32(int32_t v) { return _mm256_set1_epi32(v); }
  static VI AddI32(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static VI SubI32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
  // No fused byte dot product: the kernels sum up to 4 vpmaddubsw results in int16 (each lane
  // at most 2 * 24 * 127 = 6096) and widen once, which halves the multiplier-port work.
  static constexpr bool kFusedDot8 = false;
  static VI BytePairs(VI w, VI x) { return _mm256_maddubs_epi16(w, x); }
  static VI AddI16(VI a, VI b) { return _mm256_add_epi16(a, b); }
  // acc + the int16 lanes of v summed in pairs.
  static VI AccumulatePairs(VI acc, VI v) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi16(1)));
  }
  // acc + per int32 lane the dot product of 4 unsigned bytes of w with 4 signed bytes of x.
  static VI DotAccU8S8(VI acc, VI w, VI x) { return AccumulatePairs(acc, BytePairs(w, x)); }

  static VF ZeroF() { return _mm256_setzero_ps(); }
  static VF Set1F(float v) { return _mm256_set1_ps(v); }
  static VF LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreF(float* p, VF v) { _mm256_storeu_ps(p, v); }
  static VF ToFloat(VI v) { return _mm256_cvtepi32_ps(v); }
  static VF Mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static VF Fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }

  // kLanes raw UE8M0 bytes as floats 2^(b - 127) (byte 0 gives 0 instead of 2^-127).
  static VF Ue8m0(const uint8_t* p) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 23));
  }
  // kLanes raw E4M3 bytes as floats: the 7 magnitude bits placed at the top of an fp32 exponent
  // and mantissa read as 2^-120 times the value (subnormals included), hence the product.
  static VF E4m3(const uint8_t* p) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i magnitude =
        _mm256_slli_epi32(_mm256_and_si256(wide, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(wide, _mm256_set1_epi32(0x80)), 24);
    const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
  }
};

}  // namespace moe::cpu::MOE_CPU_ISA

#endif  // MOE_KERNELS_CPU_SIMD_AVX2_H_
