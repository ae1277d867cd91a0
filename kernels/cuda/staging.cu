// Fused activation staging (see staging_kernels.h). The element codecs reproduce formats.cc
// exactly (no contraction, IEEE division, no flush to zero), so the bytes match the CPU reference;
// where an arithmetic shortcut replaces a step of the CPU code, the comment beside it says why the
// result is the same. Amax skips NaN exactly like the CPU's `if (|v| > amax)` loop (max.bf16x2 and
// fmaxf return the non-NaN operand), and max is order-independent.
//
// Grid: the remap blocks first (one thread per route: EPLB remap and load recording, done while
// the quantization blocks stream), then the quantization blocks.
// MXFP8: each thread owns kMxfp8ThreadChunks chunks of 8 elements (16-byte loads, all issued
// before any arithmetic), one block-sized stride apart so that every load instruction of a warp
// reads 512 contiguous bytes; four lanes form a group of 32, sixteen lanes a packed scale word.
// NVFP4: one block per token row (the token scale needs the whole row's amax first). A warp covers
// 224 chunks of the row per tile with seven coalesced loads per lane; a lane holds half of each of
// its groups, swaps only the half maxima with its partner lane, and encodes and stores its own
// chunks. The row stays in registers between the amax and the encode (one read of the row, two
// block barriers: the amax and a per-row table of thresholds). E2M1 codes come from comparisons
// per element pair against per-group thresholds (the seven rounding boundaries: one masked
// comparison, then three counted in half-precision arithmetic; rows with an amax below 2^121
// compare the BF16 bit patterns as FP16, which orders them alike there and lets the comparisons
// take |x| as an operand) instead of a division per element;
// the group scale quotients from a per-row reciprocal and two FMAs instead of a division; the
// table's thresholds from fp32 FMAs with directed rounding (double products only for extreme
// token scales). Rows of exactly one block tile (the common widths) run a kernel instance of
// their own, without load predicates or loops over further tiles.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/staging_kernels.h"

namespace moe::cuda {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;
// MXFP8 quantization blocks (H200, NOTES-cuda.md): 1024 threads for large inputs, launched
// without programmatic serialization (4096 x 7168: 25.90-25.98 us against 26.21-26.40 with it and
// 26.64-26.79 for 256-thread blocks with it), 256 below a wave of 1024-thread blocks (T = 64,
// H = 7168: 4.42-4.48 us for a graph of one launch against 4.74-4.86).
constexpr int kMxfp8Threads = 256;
constexpr int kMxfp8LargeThreads = 1024;
constexpr int64_t kMxfp8LargeChunks = int64_t{1} << 19;  // 256 blocks of 1024 x 2 chunks
// MXFP8 chunks per thread: 2 measured best on the H200 (1: the same, 4 and 8: slower).
constexpr int kMxfp8ThreadChunks = 2;
// NVFP4: C chunks of 8 elements per lane and row tile (Nvfp4Shape): a warp covers 32 C chunks of
// a row and a block at most kMaxWarps warps (the most its register cap allows in one block);
// longer rows loop over tiles (and read the row twice). C = 7 gives H = 7168 blocks of 4 warps
// and, with the register cap of 72 (no spills), 7 blocks (rows) per SM: 26.6-26.9 us at 4096 x
// 7168 on the H200 (before the redux BlockMax; 26.0 with it), against 28.8-29.2 for C = 4 (7
// warps per row, cap 56, 5 rows per SM), 28.0-28.3 for 14 (2 warps per row, 9 rows per SM), 27.4
// for 8 and 29.6-29.9 for two rows per block with the second prefetched into shared memory
// (NOTES-cuda.md, "Session of 2026-12-02, fourth"). The launcher takes C = 4 where it pads a row
// less (H = 2048: 12.5 us against 15.3 with 7, which would leave 43% of the lanes idle).
// Rows of exactly one tile (StageNvfp4Kernel<C, true>) fit kOneTileRegisters without spills (no
// loop over further tiles), which holds 8 rows of H = 7168 per SM instead of 7, and 10 of H = 4096
// instead of 9: on an H100, 30.95-31.07 us against 31.88-31.91 at 4096 x 7168 (56 registers, 9
// rows with an 8-byte spill: 30.30-30.46; NOTES-cuda.md, "Session of 2026-12-07, second"). The
// launcher's kMaxWarps stays that of the larger cap (a bound for both). Such rows now go to
// StageNvfp4SharedKernel by default (StagingParams::nvfp4_shared_rows), which holds more rows per
// SM still: 29.85-29.87 us on that H100 against 31.00-31.03 for the 64-register kernel
// and 30.24-30.34 for 56 (NOTES-cuda.md, "Session of 2026-12-07, third").
template <int kLaneChunks>
struct Nvfp4Shape {
  static constexpr int kRegisters = kLaneChunks == 7 ? 72 : 56;
  static constexpr int kOneTileRegisters = kLaneChunks == 7 ? 64 : 48;
  static constexpr int kMaxWarps = std::min(32, 65536 / (kRegisters * 32));
};
constexpr int kNvfp4MaxWarps = 32;  // of any shape (BlockMax's partials)
// StageNvfp4SharedKernel (4, 7 or 14 lane chunks) compiles at 40 registers without spills.
constexpr int kNvfp4SharedRowRegisters = 40;
// MXFP8 element codes and E4M3 block scales of NVFP4 through the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32: round half to even, saturate to +-448 (infinities too),
// NaN -> 0x7F), which gives the bytes of FloatToE4m3; staging_cuda_test checks it. false: the
// software codec below, step by step as formats.cc.
constexpr bool kHardwareE4m3 = true;

// 2^n for n in [-126, 127].
__device__ __forceinline__ float Pow2(int n) {
  return __uint_as_float(static_cast<uint32_t>(n + 127) << 23);
}

// Element i (0..7) of eight BF16 values in a uint4, as fp32.
__device__ __forceinline__ float Bf16At(const uint4& v, int i) {
  const uint32_t w = i < 2 ? v.x : (i < 4 ? v.y : (i < 6 ? v.z : v.w));
  return __uint_as_float((i & 1) != 0 ? (w & 0xFFFF0000u) : (w << 16));
}

// ---- bf16x2 primitives (two BF16 values in a uint32_t, element 0 in the low half).

__device__ __forceinline__ uint32_t AbsBf16x2(uint32_t w) { return w & 0x7FFF7FFFu; }

__device__ __forceinline__ uint32_t MaxBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Comparisons and the FMA of the NVFP4 encode, on BF16 bit patterns read either as BF16 or, with
// kF16, as FP16: both formats are sign and magnitude, so two magnitudes order alike under either
// reading wherever neither is an FP16 NaN or infinity (BF16 magnitude below 2^121, bit pattern
// below 0x7C00; BF16 NaN and infinity patterns read as FP16 NaN). FP16 lets ptxas fold |x| into
// the HSET2 (it does not for BF16), which saves the abs of every element pair. The intrinsics
// compile to one set / fma / abs instruction each (abs.bf16x2 issues as an HFMA2 with |x|: the
// FMA pipe rather than the ALU pipe, which limits the NVFP4 encode).
template <bool kF16>
using Half2 = std::conditional_t<kF16, __half2, __nv_bfloat162>;

template <bool kF16>
__device__ __forceinline__ Half2<kF16> AsHalf2(uint32_t w) {
  Half2<kF16> h;
  memcpy(&h, &w, sizeof(h));
  return h;
}

template <bool kF16>
__device__ __forceinline__ uint32_t Bits(Half2<kF16> h) {
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

// 0xFFFF in each half where a >= b (a <= b); false for NaN.
template <bool kF16>
__device__ __forceinline__ uint32_t GeMask(uint32_t a, uint32_t b) {
  return __hge2_mask(AsHalf2<kF16>(a), AsHalf2<kF16>(b));
}

template <bool kF16>
__device__ __forceinline__ uint32_t LeMask(uint32_t a, uint32_t b) {
  return __hle2_mask(AsHalf2<kF16>(a), AsHalf2<kF16>(b));
}

// 1.0 (in the format read) in each half where a >= b (a <= b), else 0.0; NaN compares false.
template <bool kF16>
__device__ __forceinline__ uint32_t GeOne(uint32_t a, uint32_t b) {
  return Bits<kF16>(__hge2(AsHalf2<kF16>(a), AsHalf2<kF16>(b)));
}

template <bool kF16>
__device__ __forceinline__ uint32_t LeOne(uint32_t a, uint32_t b) {
  return Bits<kF16>(__hle2(AsHalf2<kF16>(a), AsHalf2<kF16>(b)));
}

template <bool kF16>
__device__ __forceinline__ uint32_t Fma2(uint32_t a, uint32_t b, uint32_t c) {
  return Bits<kF16>(__hfma2(AsHalf2<kF16>(a), AsHalf2<kF16>(b), AsHalf2<kF16>(c)));
}

// |x| per half (ptxas folds the FP16 one into the comparisons that read it).
template <bool kF16>
__device__ __forceinline__ uint32_t Abs2(uint32_t w) {
  return Bits<kF16>(__habs2(AsHalf2<kF16>(w)));
}

// Bitwise mask ? a : b (one LOP3).
__device__ __forceinline__ uint32_t Select(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & mask) | (b & ~mask);
}

// Larger of the two halves of a bf16x2 of magnitudes, as fp32; NaN only when both are NaN.
__device__ __forceinline__ float LargerHalf(uint32_t m) {
  return fmaxf(__uint_as_float(m << 16), __uint_as_float(m & 0xFFFF0000u));
}

// Largest magnitude of the eight BF16 values of a chunk (a bf16x2: one per half).
__device__ __forceinline__ uint32_t ChunkAbsMax(const uint4& v) {
  return MaxBf16x2(MaxBf16x2(AbsBf16x2(v.x), AbsBf16x2(v.y)),
                   MaxBf16x2(AbsBf16x2(v.z), AbsBf16x2(v.w)));
}

// 16-byte load of data read once (evict-first).
__device__ __forceinline__ uint4 LoadOnce(const uint4* p) { return __ldcs(p); }

// ---- E4M3.

// FloatToE4m3 of formats.cc: saturating, round half to even on the E4M3 grid, NaN -> 0x7F.
__device__ __forceinline__ uint32_t E4m3EncodeSoftware(float x) {
  if (isnan(x)) return 0x7Fu;
  const uint32_t sign = signbit(x) ? 0x80u : 0u;
  const float a = fabsf(x);
  if (a >= 448.f) return sign | 0x7Eu;
  int e = -6;
  if (a >= 0.015625f) e = static_cast<int>((__float_as_uint(a) >> 23) & 0xFF) - 127;
  // Multiplying by a power of two is exact here (the result is >= 8 or scaled up), so the
  // round-half-even conversion is the only rounding, as nearbyint on the CPU.
  const int steps = __float2int_rn(__fmul_rn(a, Pow2(3 - e)));
  return sign | static_cast<uint32_t>((e + 6) * 8 + steps);
}

// Two E4M3 codes (x in the low byte) of FloatToE4m3.
__device__ __forceinline__ uint32_t E4m3x2(float x, float y) {
  if constexpr (kHardwareE4m3) {
    return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
  } else {
    return E4m3EncodeSoftware(x) | E4m3EncodeSoftware(y) << 8;
  }
}

// E4M3 code of x (FloatToE4m3) in the low byte, 0 above. The packing move tells ptxas that the
// upper half is 0 (the conversion's merge operand), which saves the mask E4m3x2(x, 0.f) needs.
__device__ __forceinline__ uint32_t E4m3Byte(float x) {
  if constexpr (kHardwareE4m3) {
    uint32_t d;
    asm("{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, %2, %1; mov.b32 %0, {h, %3}; }"
        : "=r"(d)
        : "f"(x), "f"(0.f), "h"(static_cast<unsigned short>(0)));
    return d;
  } else {
    return E4m3EncodeSoftware(x);
  }
}

// E4m3ToFloat of formats.cc (every E4M3 value is exact in fp16).
__device__ __forceinline__ float E4m3Decode(uint32_t bits) {
  if constexpr (kHardwareE4m3) {
    return __half2float(
        __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), __NV_E4M3)));
  } else {
    if ((bits & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
    const int exponent = (bits >> 3) & 0xF;
    const int mantissa = bits & 0x7;
    const float magnitude = exponent == 0
                                ? __fmul_rn(static_cast<float>(mantissa), Pow2(-9))
                                : __fmul_rn(static_cast<float>(8 + mantissa), Pow2(exponent - 10));
    return (bits & 0x80u) != 0 ? -magnitude : magnitude;
  }
}

// ---- EPLB remap.

// One thread per (t, k) route: remap and load recording (MapLogicalToPhysical + RecordLoad).
__device__ void RemapRoute(const StagingParams& p, int64_t route) {
  if (route >= static_cast<int64_t>(p.tokens) * p.top_k) return;
  const int64_t t = route / p.top_k;
  const int64_t index = p.token_indices != nullptr ? p.token_indices[t] : t;
  const uint32_t h = static_cast<uint32_t>(static_cast<uint64_t>(index) * 2654435769ull);
  const int32_t logical = p.topk_ids[route];
  int32_t physical = -1;
  if (logical >= 0 && logical < p.num_logical) {
    const uint32_t replicas = static_cast<uint32_t>(max(p.replica_count[logical], 1));
    physical = p.logical_to_physical[static_cast<int64_t>(logical) * p.max_replicas + h % replicas];
  }
  p.physical_ids[route] = physical;
  if (p.load != nullptr && t < p.num_unpadded && physical >= 0 && physical < p.load_size &&
      (p.hosted == nullptr || p.hosted[physical] != 0)) {
    atomicAdd(p.load + physical, 1ull);
  }
}

// ---- MXFP8.

// Ue8m0RoundUp(max(amax, 1e-4) / 448) of staging.cc without the division, for amax a BF16
// magnitude (or NaN, read as 0). With A = max(amax, 1e-4f) = 2^E * M, M in [1, 2):
// 2^j >= fl(A / 448) iff 2^j >= A / 448 (448 * 2^j has three significant bits, so the BF16 A and
// the fp32 floor lie at least 1/224 relatively away from it when above it, far beyond the
// rounding), and A / 448 = 2^(E-8) * M / 1.75, so the scale exponent is E - 8, plus 1 when
// M > 1.75. The result lies in [105, 247]: no clamping; an infinite amax gives 254 like the
// saturated CPU value.
__device__ __forceinline__ uint32_t Mxfp8ScaleExponent(float amax) {
  const uint32_t bits = __float_as_uint(fmaxf(amax, 1e-4f));
  if (bits >= 0x7F800000u) return 254;
  return (bits >> 23) - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
}

// Quantizes chunk `chunk` (8 elements of group chunk / 4), raw its BF16 values. All 32 lanes of
// the warp call it together (shuffles); chunks at or past `chunks` write nothing.
__device__ __forceinline__ void QuantizeMxfp8Chunk(const StagingParams& p, const uint4& raw,
                                                   int64_t chunk, int64_t chunks) {
  float amax = LargerHalf(ChunkAbsMax(raw));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
  const uint32_t e = Mxfp8ScaleExponent(amax);
  // 2^(127 - e): e = 254 gives the subnormal 2^-127.
  const float inverse = e == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((254u - e) << 23);
  uint32_t pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    pairs[i] =
        E4m3x2(__fmul_rn(Bf16At(raw, 2 * i), inverse), __fmul_rn(Bf16At(raw, 2 * i + 1), inverse));
  }
  const int lane = threadIdx.x & 31;
  const int span = lane & ~15;
  const uint32_t word = __shfl_sync(kFull, e, span) | __shfl_sync(kFull, e, span + 4) << 8 |
                        __shfl_sync(kFull, e, span + 8) << 16 |
                        __shfl_sync(kFull, e, span + 12) << 24;
  if (chunk >= chunks) return;
  __stcs(reinterpret_cast<uint2*>(p.q) + chunk,
         make_uint2(pairs[0] | pairs[1] << 16, pairs[2] | pairs[3] << 16));
  if ((lane & 15) == 0) p.scales[chunk / 16] = static_cast<int32_t>(word);
}

// Programmatic dependent launch (StagingParams::programmatic): wait for the previous kernel's
// completion and visible writes, then let the next kernel start launching. No-ops when the kernel
// was launched without the attribute.
__device__ __forceinline__ void ProgrammaticStart() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// How every staging kernel starts: the programmatic wait, then the first remap_blocks blocks remap
// routes (one per thread) and are done. True for the blocks that go on to quantize.
__device__ __forceinline__ bool QuantizationBlock(const StagingParams& p, int remap_blocks) {
  ProgrammaticStart();
  if (static_cast<int>(blockIdx.x) < remap_blocks) {
    RemapRoute(p, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
    return false;
  }
  return true;
}

// Chunks are numbered over the whole [T, H] input (H / 8 per row, a multiple of 16, so every
// aligned 16-lane span is one scale word of one row and is valid or invalid as a whole).
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    StageMxfp8Kernel(const StagingParams p, int remap_blocks) {
  if (!QuantizationBlock(p, remap_blocks)) return;
  const int64_t chunks = static_cast<int64_t>(p.tokens) * p.hidden_size / 8;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x - remap_blocks) * kThreads * kMxfp8ThreadChunks + threadIdx.x;
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  uint4 raw[kMxfp8ThreadChunks];
#pragma unroll
  for (int j = 0; j < kMxfp8ThreadChunks; ++j) {
    const int64_t c = first + j * kThreads;
    raw[j] = c < chunks ? LoadOnce(x + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int j = 0; j < kMxfp8ThreadChunks; ++j) {
    QuantizeMxfp8Chunk(p, raw[j], first + j * kThreads, chunks);
  }
}

// ---- NVFP4.

// FloatToE2m1 of formats.cc counts the thresholds its argument passes (midpoints to the even
// code): > 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5. For its argument fl(q), the
// correctly rounded quotient q = |x| / unit: fl(q) > c iff q > c + ulp(c) / 2, and fl(q) >= c iff
// q >= c - ulp(c) / 2 (every threshold has an even last mantissa bit, so a tie rounds to c).
// Each bound has at most 26 significant bits and unit 24, so bound * unit is exact in double.
__device__ constexpr double kE2m1Bounds[7] = {0.25 + 0x1p-26, 0.75 - 0x1p-25, 1.25 + 0x1p-24,
                                              1.75 - 0x1p-24, 2.5 + 0x1p-23,  3.5 - 0x1p-23,
                                              5.0 + 0x1p-22};

// Per group of 16: v[k] = the smallest BF16 magnitude whose E2M1 code (for this group's unit)
// exceeds k, in both halves; a code is then the number of v[k] that |x| reaches.
struct E2m1Thresholds {
  uint32_t v[7];
  uint32_t negative_v0;  // -v[0]: x <= it iff x is negative with a nonzero code
};

// For a BF16 magnitude a and the exact double P = bound * unit: a > P iff a >= the successor of
// fl_down(P) (an fp32, so a >= it iff a >= its BF16 ceiling), and a >= P iff a >= the BF16
// ceiling of fl_up(P). unit > 0 gives P below FLT_MAX (unit <= 448 * BF16 max / 2688).
__device__ __forceinline__ E2m1Thresholds GroupThresholds(float unit) {
  E2m1Thresholds u;
  const double unit_d = unit;
#pragma unroll
  for (int k = 0; k < 7; ++k) {
    const double bound = kE2m1Bounds[k] * unit_d;
    const uint32_t f = k % 2 == 0 ? __float_as_uint(__double2float_rd(bound)) + 1
                                  : __float_as_uint(__double2float_ru(bound));
    u.v[k] = __byte_perm(f + 0xFFFFu, 0, 0x3232);  // BF16 ceiling (upper half), in both halves
  }
  u.negative_v0 = u.v[0] | 0x80008000u;
  return u;
}

// GroupThresholds with fp32 FMAs: bound * unit = c + delta times unit with c in kE2m1Mid (exact
// in fp32) and delta = +-2^-m, so fma(c, unit, delta * unit) rounded down (up) is fl_rd(P)
// (fl_ru(P)) whenever delta * unit is exact, i.e. does not underflow: the same bits as the double
// products, at an FMUL per distinct 2^-m and an FFMA per bound instead of a DMUL and an F2F
// conversion. BuildScaleTable takes it for x_scale in [2^-91, FLT_MAX] (unit >= 2^-100); every
// such row amax and scale byte, and eight whole binades of units, are checked against the double
// path by bench/probes/nvfp4_thresholds.cc.
__device__ constexpr float kE2m1Mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
__device__ constexpr float kE2m1Delta[7] = {0x1p-26f, -0x1p-25f, 0x1p-24f, -0x1p-24f,
                                            0x1p-23f, -0x1p-23f, 0x1p-22f};
constexpr float kFmaThresholdsMinScale = 0x1p-91f;

__device__ __forceinline__ E2m1Thresholds GroupThresholdsFma(float unit) {
  E2m1Thresholds u;
#pragma unroll
  for (int k = 0; k < 7; ++k) {
    const float tail = __fmul_rn(kE2m1Delta[k], unit);
    const uint32_t f = k % 2 == 0 ? __float_as_uint(__fmaf_rd(kE2m1Mid[k], unit, tail)) + 1
                                  : __float_as_uint(__fmaf_ru(kE2m1Mid[k], unit, tail));
    u.v[k] = __byte_perm(f + 0xFFFFu, 0, 0x3232);
  }
  u.negative_v0 = u.v[0] | 0x80008000u;
  return u;
}

// The E2M1 code of |x| is the number of thresholds v[k] it reaches (kE2m1Bounds, in order). Per
// element pair: m2 = code >= 4 (one masked comparison), then the three thresholds of m2's half,
// picked by LOP3 selects, are counted in half-precision arithmetic. A tally starts at a base
// whose ulp is 1 (128.0 in BF16, 1024.0 in FP16) and adds the 1.0 / 0.0 comparison results times
// a weight that puts each count at its bits: every partial sum is the base plus an integer below
// its ulp-1 range (128 in BF16, 1024 in FP16), so exact, and the low bits of each half then hold
// the counts (the base's low byte is 0 in both formats). The FMA pipe thus does part of what LOP3
// selects did in a pure binary search (three masked comparisons per pair), which was ~1.8%
// slower on the H200, as was counting all seven thresholds (more instructions and registers).
template <bool kF16>
struct Tally {
  static constexpr uint32_t kBase = kF16 ? 0x64006400u : 0x43004300u;   // 1024.0 / 128.0
  static constexpr uint32_t kOne = kF16 ? 0x3C003C00u : 0x3F803F80u;    // 1.0
  static constexpr uint32_t kEight = kF16 ? 0x48004800u : 0x41004100u;  // 8.0
  // The second pair's weight: 16.0 (bits 4-5), 256.0 in FP16 (bits 8-9, EncodeE2m1ChunkF16).
  static constexpr uint32_t kSecond = kF16 ? 0x5C005C00u : 0x41804180u;
};

// One pair: the tally gains the count of the three thresholds of m2's half (code & 3) times
// `weight`.
template <bool kF16>
__device__ __forceinline__ uint32_t TallyHalf(uint32_t s, uint32_t a, uint32_t m2,
                                              const E2m1Thresholds& u, uint32_t weight) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    s = Fma2<kF16>(GeOne<kF16>(a, Select(m2, u.v[4 + k], u.v[k])), weight, s);
  }
  return s;
}

// Packed E2M1 codes of one chunk of eight BF16 values (element j in nibble j); the sign bit only
// where the code is nonzero (-0 encodes as 0). BF16 comparisons, for any row: the chunk is
// re-paired as (e0, e4), (e1, e5), (e2, e6), (e3, e7) so that the codes of a pair land in nibbles
// j and j + 4, which the tally's 8 bits per half can hold.
__device__ __forceinline__ uint32_t EncodeE2m1ChunkBf16(const uint4& raw, const E2m1Thresholds& u) {
  using T = Tally<false>;
  const uint32_t w[4] = {__byte_perm(raw.x, raw.z, 0x5410), __byte_perm(raw.x, raw.z, 0x7632),
                         __byte_perm(raw.y, raw.w, 0x5410), __byte_perm(raw.y, raw.w, 0x7632)};
  uint32_t tally[2], bits = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t x0 = w[2 * h], x1 = w[2 * h + 1];
    const uint32_t a0 = Abs2<false>(x0), a1 = Abs2<false>(x1);
    const uint32_t m2_0 = GeMask<false>(a0, u.v[3]), m2_1 = GeMask<false>(a1, u.v[3]);
    uint32_t s = TallyHalf<false>(T::kBase, a0, m2_0, u, T::kOne);
    s = Fma2<false>(LeOne<false>(x0, u.negative_v0), T::kEight, s);
    tally[h] = TallyHalf<false>(s, a1, m2_1, u, T::kSecond);
    // code >= 4 of both pairs, the odd pair's sign.
    const int at = 8 * h;
    bits |= (m2_0 & (0x00040004u << at)) | (m2_1 & (0x00400040u << at)) |
            (LeMask<false>(x1, u.negative_v0) & (0x00800080u << at));
  }
  // Tally bits: pair 2h's code & 3 and sign (bits 0, 1, 3), pair 2h + 1's code & 3 (4, 5).
  return (tally[0] & 0x003B003Bu) | (tally[1] & 0x003B003Bu) << 8 | bits;
}

// The same with FP16 comparisons (GeMask), exact only for rows whose amax is below 2^121 (then
// every threshold a group reads is too). The FP16 tally holds 10 bits per half, so the chunk's
// own pairs serve: word W_h (pairs (e4h, e4h+1) and (e4h+2, e4h+3)) gets the nibble of e4h at
// bits 0-3, e4h+2 at 8-11, e4h+1 at 16-19 and e4h+3 at 24-27, and three instructions interleave
// the two words (W_0 + W_0 >> 12 for e0..e3, W_1 * 0x10010 for e4..e7, one PRMT) where the
// re-pairing took four.
__device__ __forceinline__ uint32_t EncodeE2m1ChunkF16(const uint4& raw, const E2m1Thresholds& u) {
  using T = Tally<true>;
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t x0 = h == 0 ? raw.x : raw.z, x1 = h == 0 ? raw.y : raw.w;
    const uint32_t a0 = Abs2<true>(x0), a1 = Abs2<true>(x1);
    const uint32_t m2_0 = GeMask<true>(a0, u.v[3]), m2_1 = GeMask<true>(a1, u.v[3]);
    uint32_t s = TallyHalf<true>(T::kBase, a0, m2_0, u, T::kOne);
    s = Fma2<true>(LeOne<true>(x0, u.negative_v0), T::kEight, s);
    s = TallyHalf<true>(s, a1, m2_1, u, T::kSecond);
    // Tally bits: x0's code & 3 and sign (0, 1, 3), x1's code & 3 (8, 9); code >= 4 of both
    // pairs (2, 10) and x1's sign (11).
    word[h] = (s & 0x030B030Bu) | (m2_0 & 0x00040004u) | (m2_1 & 0x04000400u) |
              (LeMask<true>(x1, u.negative_v0) & 0x08000800u);
  }
  return __byte_perm(word[0] + (word[0] >> 12), word[1] * 0x10010u, 0x7610);
}

// Largest of every thread's `v` (block-wide; every thread gets it; NaN counts as 0, as in the
// CPU's amax loop). One barrier; call once. Non-negative floats order as their bit patterns, so
// each stage is one integer warp reduction (redux.sync) instead of five shuffles and maxima.
__device__ __forceinline__ float BlockMax(float v) {
  __shared__ uint32_t partial[kNvfp4MaxWarps];
  const int lane = threadIdx.x & 31;
  // fmaxf returns 0 for NaN; v is a magnitude, so never -0.
  const uint32_t m = __reduce_max_sync(kFull, __float_as_uint(fmaxf(v, 0.f)));
  if (lane == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  return __uint_as_float(
      __reduce_max_sync(kFull, lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0u));
}

// What a lane holds of one warp tile: chunks tile + 32j + lane, j < kLaneChunks (every load
// instruction of the warp reads 512 contiguous bytes). Chunk c is half c % 2 of group c / 2, so
// lanes 2p and 2p + 1 hold the two halves of each group and swap only their half maxima (one
// shuffle per two chunks: the maxima of chunks 2i and 2i + 1 travel as one bf16x2). Each lane
// then works out the group's scale byte itself (both halves compute the same one) and writes its
// chunk's four code bytes.
template <int kLaneChunks>
struct Nvfp4Tile {
  static constexpr int kPairs = (kLaneChunks + 1) / 2;
  uint4 raw[kLaneChunks];
  // Largest magnitude of chunk 2i (low half) and 2i + 1 (high half; chunk 2i again for an odd
  // last one), as BF16 magnitudes; NaN only for an all-NaN chunk.
  uint32_t half_max[kPairs];
};

// max(|a|, |b|) per half, the sign bit the XOR of the signs (NaN operands as in max.bf16x2).
__device__ __forceinline__ uint32_t MaxAbsXorsignBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Per half: the largest magnitude of a chunk's even (low) and odd (high) elements; the sign bits
// are XORs, not magnitudes' signs.
__device__ __forceinline__ uint32_t ChunkHalvesMax(const uint4& v) {
  return MaxAbsXorsignBf16x2(MaxAbsXorsignBf16x2(v.x, v.y), MaxAbsXorsignBf16x2(v.z, v.w));
}

// The largest magnitudes of two chunks (a low, b high) from their ChunkHalvesMax: one more
// max.xorsign.abs over the re-paired halves and a mask of the sign bits, three instructions for
// two chunks where two fp32 extractions and an fmaxf per chunk took six.
__device__ __forceinline__ uint32_t PairMax(uint32_t ma, uint32_t mb) {
  return MaxAbsXorsignBf16x2(__byte_perm(ma, mb, 0x5410), __byte_perm(ma, mb, 0x7632)) &
         0x7FFF7FFFu;
}

// Load stage of a lane's chunks of the tile starting at chunk `tile` (zeros past the row's end).
// Called by whole warps. kWhole: every chunk of the warp's tile exists (plain loads from one
// address, no per-chunk predicates and zero fills). kShared: `row` is the row's copy in shared
// memory (StageNvfp4SharedKernel; whole tiles only).
template <int kLaneChunks, bool kWhole = false, bool kShared = false>
__device__ __forceinline__ Nvfp4Tile<kLaneChunks> LoadNvfp4Tile(const uint4* row, int tile,
                                                                int chunks) {
  static_assert(kWhole || !kShared);
  const int lane = threadIdx.x & 31;
  const uint4* p = row + tile + lane;
  const int valid = chunks - tile - lane;  // chunks j with 32 j < valid exist
  Nvfp4Tile<kLaneChunks> r;
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
    if constexpr (kShared) {
      r.raw[j] = p[32 * j];
    } else {
      r.raw[j] = kWhole || 32 * j < valid ? LoadOnce(p + 32 * j) : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int i = 0; i < Nvfp4Tile<kLaneChunks>::kPairs; ++i) {
    const uint32_t ma = ChunkHalvesMax(r.raw[2 * i]);
    r.half_max[i] = PairMax(ma, 2 * i + 1 < kLaneChunks ? ChunkHalvesMax(r.raw[2 * i + 1]) : ma);
  }
  return r;
}

// Largest magnitude of the lane's chunks (NaN only if all are NaN).
template <int kLaneChunks>
__device__ __forceinline__ float TileMax(const Nvfp4Tile<kLaneChunks>& r) {
  uint32_t m = r.half_max[0];
#pragma unroll
  for (int i = 1; i < Nvfp4Tile<kLaneChunks>::kPairs; ++i) m = MaxBf16x2(m, r.half_max[i]);
  return LargerHalf(m);
}

// The group scale quotient fl(amax16 / d) without a division per group: with r = fl(1 / d),
// q0 = fl(amax16 * r) and the exact remainder amax16 - d * q0 (one FMA), q0 + remainder * r
// rounds to the correctly rounded quotient (Markstein) where nothing underflows. Checked for
// every pair of a BF16 row amax A (d = fl(6 * fl(A / 2688)) >= 2^-110) and a BF16 group amax
// G <= A by bench/probes/nvfp4_division.cc: the E4M3 bytes of both agree (the quotients differ
// only where both are far below E4M3's smallest step). Rows with a smaller or infinite d take
// the IEEE division.
struct Nvfp4Divisor {
  float d, r;
  bool fast;
};

__device__ __forceinline__ Nvfp4Divisor MakeNvfp4Divisor(float d) {
  return {d, __frcp_rn(d), d >= 0x1p-110f && d <= FLT_MAX};
}

template <bool kFast>
__device__ __forceinline__ float DivideGroupMax(float g, const Nvfp4Divisor& v) {
  if constexpr (!kFast) {
    return __fdiv_rn(g, v.d);
  } else {
    const float q0 = __fmul_rn(g, v.r);
    return __fmaf_rn(__fmaf_rn(-v.d, q0, g), v.r, q0);
  }
}

// Thresholds of every block-scale byte, for the row's token scale: entry b holds
// GroupThresholds(E4M3(b) * x_scale), or NaN thresholds (no element reaches them: every code 0,
// no sign) where that unit is not positive (sf = 0, or NaN from an infinite token scale or a NaN
// sf), exactly where the CPU writes code 0. Scale bytes are never above 0x7F here (the quotient
// is never negative). The whole block calls it (one barrier at the end).
struct Nvfp4ScaleTable {
  E2m1Thresholds u[128];
};

__device__ __forceinline__ E2m1Thresholds NanThresholds() {
  E2m1Thresholds u;
#pragma unroll
  for (int k = 0; k < 7; ++k) u.v[k] = 0x7FFF7FFFu;
  u.negative_v0 = 0xFFFFFFFFu;
  return u;
}

__device__ __forceinline__ void BuildScaleTable(Nvfp4ScaleTable& table, float x_scale) {
  // Uniform over the block. Fast rows: every byte but 0 (unit 0) and 0x7F (NaN) has a unit in
  // [2^-100, FLT_MAX / 5.1]; those two are overwritten after the store (cheaper than selects).
  const bool fast = x_scale >= kFmaThresholdsMinScale && x_scale <= FLT_MAX;
  for (int b = threadIdx.x; b < 128; b += blockDim.x) {
    const float unit = __fmul_rn(E4m3Decode(static_cast<uint32_t>(b)), x_scale);
    if (fast) {
      table.u[b] = GroupThresholdsFma(unit);
      if (b == 0 || b == 127) table.u[b] = NanThresholds();
    } else {
      table.u[b] = unit > 0.f ? GroupThresholds(unit) : NanThresholds();
    }
  }
  __syncthreads();
}

// Where row t's outputs go.
struct Nvfp4RowOut {
  uint32_t* q;     // 4 bytes per chunk
  uint8_t* scale;  // 1 byte per group
};

// Encode and store stage of a lane's chunks. Called by whole warps. kFast: the row's divisor is
// fast (DivideGroupMax) and its amax below 2^121, so whole tiles take EncodeE2m1ChunkF16 (partial
// ones keep the BF16 encode, which spares the 72-register kernel of several tiles a spill); kWhole:
// every chunk of the warp's tile exists (no checks, no divergence around the shuffles).
// kShared (StageNvfp4SharedKernel): the lane's chunks are read here from its copy of the row in
// shared memory (chunk j at shared_own[32 j]) instead of from r.raw, which is then unused.
template <int kLaneChunks, bool kFast, bool kWhole, bool kShared = false>
__device__ __forceinline__ void QuantizeNvfp4Tile(const Nvfp4RowOut& out,
                                                  const Nvfp4Tile<kLaneChunks>& r, int tile,
                                                  int chunks, const Nvfp4ScaleTable& table,
                                                  const Nvfp4Divisor& divisor,
                                                  const uint4* shared_own = nullptr) {
  const int lane = threadIdx.x & 31;
  uint32_t* q = out.q + tile + lane;
  uint8_t* scale = out.scale + (tile + lane) / 2;  // tile is even
  const int valid = chunks - tile - lane;
  uint32_t group_max2 = 0;
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
    if (j % 2 == 0) {
      // Both halves' group maxima: max(own, partner, 0), NaN (both halves all NaN) -> 0, which
      // is the CPU's amax then. max.bf16x2 returns the non-NaN operand, as fmaxf.
      const uint32_t m = r.half_max[j / 2];
      group_max2 = MaxBf16x2(MaxBf16x2(m, __shfl_xor_sync(kFull, m, 1)), 0u);
    }
    const uint4 raw = kShared ? shared_own[32 * j] : r.raw[j];
    const float group_max =
        __uint_as_float(j % 2 == 0 ? group_max2 << 16 : group_max2 & 0xFFFF0000u);
    // The code of a non-negative quotient or NaN (0x7F) in the low byte, the rest 0.
    const uint32_t sf_bits = E4m3Byte(DivideGroupMax<kFast>(group_max, divisor));
    const uint32_t code = kFast && kWhole ? EncodeE2m1ChunkF16(raw, table.u[sf_bits])
                                          : EncodeE2m1ChunkBf16(raw, table.u[sf_bits]);
    if (!kWhole && 32 * j >= valid) continue;
    __stcs(q + 32 * j, code);
    if ((lane & 1) == 0) scale[16 * j] = static_cast<uint8_t>(sf_bits);
  }
}

template <int kLaneChunks, bool kFast, bool kOneTile>
__device__ __forceinline__ void QuantizeNvfp4Tiles(const Nvfp4RowOut& out,
                                                   const Nvfp4Tile<kLaneChunks>& first,
                                                   const uint4* row, int warp_tile, int tile_chunks,
                                                   int chunks, const Nvfp4ScaleTable& table,
                                                   const Nvfp4Divisor& divisor) {
  if (kOneTile || warp_tile + 32 * kLaneChunks <= chunks) {
    QuantizeNvfp4Tile<kLaneChunks, kFast, true>(out, first, warp_tile, chunks, table, divisor);
  } else {
    QuantizeNvfp4Tile<kLaneChunks, kFast, false>(out, first, warp_tile, chunks, table, divisor);
  }
  if constexpr (!kOneTile) {
    for (int base = tile_chunks; base < chunks; base += tile_chunks) {
      QuantizeNvfp4Tile<kLaneChunks, kFast, false>(
          out, LoadNvfp4Tile<kLaneChunks>(row, base + warp_tile, chunks), base + warp_tile, chunks,
          table, divisor);
    }
  }
}

// What the encode of row t needs once its amax is known: the token scale (written out), the
// group-scale divisor, the scale table (built; one barrier) and where the outputs go.
struct Nvfp4RowScale {
  Nvfp4Divisor divisor;
  Nvfp4RowOut out;
  bool f16;  // the fast path compares as FP16 (EncodeE2m1ChunkF16)
};

// `amax`: the largest magnitude of the thread's chunks of row t. Called by the whole block (two
// barriers: BlockMax and BuildScaleTable).
__device__ __forceinline__ Nvfp4RowScale BeginNvfp4Row(const StagingParams& p, int64_t t,
                                                       float amax, Nvfp4ScaleTable& table) {
  const int chunks = p.hidden_size / 8;
  const float row_amax = BlockMax(amax);
  const float x_scale = __fdiv_rn(fmaxf(row_amax, FLT_MIN), 2688.f);
  if (threadIdx.x == 0) p.token_scale[t] = x_scale;
  const Nvfp4Divisor divisor = MakeNvfp4Divisor(__fmul_rn(6.f, x_scale));
  BuildScaleTable(table, x_scale);
  // Uniform over the block: the fast path also compares as FP16, exact below 2^121 (NaN elements
  // are not in the amax and compare false either way).
  return {divisor,
          {reinterpret_cast<uint32_t*>(p.q + t * (chunks * 4)),
           reinterpret_cast<uint8_t*>(p.scales + t * (chunks / 8))},
          divisor.fast && row_amax < 0x1p121f};
}

// Row t, the warp's part of its first tile already in `first`. Called by the whole block.
// kOneTile: the row is exactly one tile (every warp's chunks exist, no further tiles).
template <int kLaneChunks, bool kOneTile>
__device__ __forceinline__ void QuantizeNvfp4Row(const StagingParams& p, int64_t t,
                                                 const Nvfp4Tile<kLaneChunks>& first,
                                                 Nvfp4ScaleTable& table) {
  const int chunks = p.hidden_size / 8;
  const uint4* row = reinterpret_cast<const uint4*>(p.x) + t * chunks;
  const int tile_chunks = static_cast<int>(blockDim.x / 32) * 32 * kLaneChunks;
  const int warp_tile = static_cast<int>(threadIdx.x / 32) * 32 * kLaneChunks;
  float amax = TileMax(first);
  if constexpr (!kOneTile) {
    for (int base = tile_chunks; base < chunks; base += tile_chunks) {
      amax = fmaxf(amax, TileMax(LoadNvfp4Tile<kLaneChunks>(row, base + warp_tile, chunks)));
    }
  }
  const Nvfp4RowScale rs = BeginNvfp4Row(p, t, amax, table);
  const Nvfp4Divisor& divisor = rs.divisor;
  const Nvfp4RowOut& out = rs.out;
  if (!rs.f16) {
    QuantizeNvfp4Tiles<kLaneChunks, false, kOneTile>(out, first, row, warp_tile, tile_chunks,
                                                     chunks, table, divisor);
  } else {
    QuantizeNvfp4Tiles<kLaneChunks, true, kOneTile>(out, first, row, warp_tile, tile_chunks, chunks,
                                                    table, divisor);
  }
}

// One block per token row (the token scale needs the whole row's amax first), one warp per
// 32 * kLaneChunks chunks of it, at most Nvfp4Shape::kMaxWarps warps (longer rows loop over
// tiles and read the row twice). kOneTile (the launcher's choice): a row is exactly one tile
// (H = 7168 at 7 lane chunks, 2048 and 4096 at 4), so the loads need no predicates and there are
// no further tiles. Its own kernel rather than a branch in one: with both paths in one kernel the
// hot path sat behind ~70 KB of the other's code and, on an H100, stalled ~5x as often waiting
// for instructions (ncu "no instruction" 2.52 against 0.44 per issued instruction).
// kRegisters: the register cap (Nvfp4Shape's unless StagingParams::nvfp4_one_tile_registers says
// otherwise).
template <int kLaneChunks, bool kOneTile, int kRegisters>
__global__ void __maxnreg__(kRegisters) StageNvfp4Kernel(const StagingParams p, int remap_blocks) {
  if (!QuantizationBlock(p, remap_blocks)) return;
  const int64_t t = blockIdx.x - remap_blocks;
  const int chunks = p.hidden_size / 8;
  const int warp_tile = static_cast<int>(threadIdx.x / 32) * 32 * kLaneChunks;
  const uint4* row = reinterpret_cast<const uint4*>(p.x) + t * chunks;
  __shared__ Nvfp4ScaleTable table;
  QuantizeNvfp4Row<kLaneChunks, kOneTile>(
      p, t, LoadNvfp4Tile<kLaneChunks, kOneTile>(row, warp_tile, chunks), table);
}

// An L2 policy for bytes read once: evict first, as the register kernels' streaming loads
// (ld.global.cs).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Starts the lane's copies of its chunks of a row (row[32 j] -> own[32 j], j < kLaneChunks) into
// shared memory, bypassing L1 (cp.async.cg) under `policy`; not committed or waited for here.
template <int kLaneChunks>
__device__ __forceinline__ void CopyLaneChunksAsync(uint4* own, const uint4* row, uint64_t policy) {
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(own + 32 * j))),
                 "l"(row + 32 * j), "l"(policy)
                 : "memory");
  }
}

// The rest of a shared-row kernel's row t once the lane's copies of its chunks have arrived in
// `shared_row` (the row's copy): the maxima (the chunks themselves are dropped until after the
// barriers), BeginNvfp4Row's two barriers, and the encode, which reads the chunks again.
template <int kLaneChunks>
__device__ __forceinline__ void QuantizeSharedRow(const StagingParams& p, int64_t t,
                                                  const uint4* shared_row, int warp_tile,
                                                  Nvfp4ScaleTable& table) {
  const int chunks = p.hidden_size / 8;
  const Nvfp4Tile<kLaneChunks> maxima =
      LoadNvfp4Tile<kLaneChunks, true, true>(shared_row, warp_tile, chunks);
  const Nvfp4RowScale rs = BeginNvfp4Row(p, t, TileMax(maxima), table);
  const uint4* own = shared_row + warp_tile + (threadIdx.x & 31);
  if (!rs.f16) {
    QuantizeNvfp4Tile<kLaneChunks, false, true, true>(rs.out, maxima, warp_tile, chunks, table,
                                                      rs.divisor, own);
  } else {
    QuantizeNvfp4Tile<kLaneChunks, true, true, true>(rs.out, maxima, warp_tile, chunks, table,
                                                     rs.divisor, own);
  }
}

// The one-tile kernel with the row staged through shared memory (StagingParams::
// nvfp4_shared_rows): each lane copies its own chunks of the row into the block's shared memory
// (cp.async, L2 only), waits for its own copies (no barrier: it reads back only what it copied),
// reads them once for the maxima and, after the row's two barriers, again for the encode. No
// register holds the row while its bytes arrive or across the barriers, so the kernel fits
// kNvfp4SharedRowRegisters and more rows stay resident per SM (bounded by shared memory:
// 16 bytes per chunk, 14 KiB at H = 7168, plus the 4.1 KiB scale table). Lane chunks: the
// launcher's 7 or 4, or 14 (StagingParams::nvfp4_shared_lane_chunks: a row's fixed work spread
// over twice the elements per lane, two warps per row at H = 7168).
template <int kLaneChunks>
__global__ void __maxnreg__(kNvfp4SharedRowRegisters)
    StageNvfp4SharedKernel(const StagingParams p, int remap_blocks) {
  if (!QuantizationBlock(p, remap_blocks)) return;
  extern __shared__ uint4 shared_row[];
  __shared__ Nvfp4ScaleTable table;
  const int64_t t = blockIdx.x - remap_blocks;
  const int chunks = p.hidden_size / 8;
  const int lane = threadIdx.x & 31;
  const int warp_tile = static_cast<int>(threadIdx.x / 32) * 32 * kLaneChunks;
  const uint4* row = reinterpret_cast<const uint4*>(p.x) + t * chunks + warp_tile + lane;
  // The row is read once.
  CopyLaneChunksAsync<kLaneChunks>(shared_row + warp_tile + lane, row, EvictFirstPolicy());
  asm volatile("cp.async.wait_all;" ::: "memory");
  QuantizeSharedRow<kLaneChunks>(p, t, shared_row, warp_tile, table);
}

// The shared-row kernel as one wave of blocks that loop over rows (blockIdx - remap_blocks, then
// every quantization block count further), each row's copy in one of two shared buffers: a lane
// starts copying its chunks of the block's next row, then waits only for its copies of the
// current one (cp.async groups), so the loads of the next row proceed while the block finds the
// current row's maxima, passes its two barriers and encodes it. Each lane reads back only the
// chunks it copied, so a buffer is rewritten (two rows later) only by the lane that last read it.
// The row scale table is rewritten for a row only after BlockMax's barrier, which every warp
// reaches after encoding the previous row. Hypothesis under test: the single-row kernel's blocks
// load together and then only compute (3.00 waves at 4096 x 7168 on an H100).
template <int kLaneChunks>
__global__ void __maxnreg__(kNvfp4SharedRowRegisters)
    StageNvfp4SharedPipelineKernel(const StagingParams p, int remap_blocks) {
  if (!QuantizationBlock(p, remap_blocks)) return;
  extern __shared__ uint4 shared_rows[];  // two rows
  __shared__ Nvfp4ScaleTable table;
  const int chunks = p.hidden_size / 8;
  const int lane = threadIdx.x & 31;
  const int warp_tile = static_cast<int>(threadIdx.x / 32) * 32 * kLaneChunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) - remap_blocks;
  const uint4* x = reinterpret_cast<const uint4*>(p.x) + warp_tile + lane;
  const uint64_t policy = EvictFirstPolicy();
  // Starts the lane's copies of row t into buffer b, as one cp.async group.
  auto copy_row = [&](int64_t t, int b) {
    CopyLaneChunksAsync<kLaneChunks>(shared_rows + b * chunks + warp_tile + lane, x + t * chunks,
                                     policy);
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  int64_t t = static_cast<int64_t>(blockIdx.x) - remap_blocks;
  copy_row(t, 0);
  for (int b = 0; t < p.tokens; t += stride, b ^= 1) {
    if (t + stride < p.tokens) {
      copy_row(t + stride, b ^ 1);
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    QuantizeSharedRow<kLaneChunks>(p, t, shared_rows + b * chunks, warp_tile, table);
  }
}

using StagingKernel = void (*)(StagingParams, int);

// StageNvfp4SharedKernel's rows (H <= 20480) and its static 4.2 KiB fit the 48 KiB of shared memory
// a block gets without opting in.
constexpr size_t kMaxSharedRowBytes = 40 * 1024;

// Asks for as much shared memory per SM as the SM allows for StageNvfp4SharedKernel<lane_chunks>,
// so that rows rather than the L1 / shared split bound its blocks per SM (the default split can
// be smaller than 11 rows of H = 7168 need). The preference belongs to the function on the current
// device: set once per kernel and device (first 64 devices; beyond, on every launch).
cudaError_t PreferSharedCarveout(StagingKernel kernel, int lane_chunks, bool pipeline = false) {
  // Bit d: set on device d; per kernel (single-row or pipeline) and lane-chunk count 4, 7, 14.
  static std::atomic<uint64_t> done[2][3];
  std::atomic<uint64_t>& mask = done[pipeline][lane_chunks == 4 ? 0 : lane_chunks == 7 ? 1 : 2];
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (mask.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess) mask.fetch_or(bit, std::memory_order_relaxed);
  return e;
}

template <int kLaneChunks, bool kOneTile>
constexpr StagingKernel kNvfp4Default =
    StageNvfp4Kernel<kLaneChunks, kOneTile,
                     kOneTile ? Nvfp4Shape<kLaneChunks>::kOneTileRegisters
                              : Nvfp4Shape<kLaneChunks>::kRegisters>;

// one_tile_registers: StagingParams::nvfp4_one_tile_registers (0, 56, 64 or 72); null for another
// value.
StagingKernel Nvfp4Kernel(int lane_chunks, bool one_tile, int one_tile_registers) {
  if (lane_chunks != 7) return one_tile ? kNvfp4Default<4, true> : kNvfp4Default<4, false>;
  if (!one_tile) return kNvfp4Default<7, false>;
  switch (one_tile_registers) {
    case 0:
      return kNvfp4Default<7, true>;
    case 56:
      return StageNvfp4Kernel<7, true, 56>;
    case 64:
      return StageNvfp4Kernel<7, true, 64>;
    case 72:
      return StageNvfp4Kernel<7, true, 72>;
    default:
      return nullptr;
  }
}

}  // namespace

cudaError_t LaunchStaging(const StagingParams& p, cudaStream_t stream) {
  const bool nvfp4 = p.format == StagingFormat::kNvfp4;
  const bool quantize = p.x != nullptr && p.tokens > 0;
  const int64_t mx_chunks = static_cast<int64_t>(p.tokens) * p.hidden_size / 8;
  const int mx_threads = p.mxfp8_block_threads != 0       ? p.mxfp8_block_threads
                         : mx_chunks >= kMxfp8LargeChunks ? kMxfp8LargeThreads
                                                          : kMxfp8Threads;
  if (mx_threads != 256 && mx_threads != 512 && mx_threads != 1024) return cudaErrorInvalidValue;
  int threads = mx_threads;
  int64_t quant_blocks = 0;
  int nvfp4_lane_chunks = 7;
  bool nvfp4_one_tile = false;
  bool nvfp4_shared = false;    // StageNvfp4SharedKernel
  bool nvfp4_pipeline = false;  // StageNvfp4SharedPipelineKernel instead
  if (nvfp4) {
    // Warps per block and chunks per row padded to whole tiles, for a lane-chunk count; the count
    // that pads a row less wins (7 on a tie). At least one warp: a remap-only launch
    // (x null) may carry hidden_size 0.
    struct Fit {
      int warps, padded;
    };
    const int chunks = p.hidden_size / 8;
    auto fit = [chunks](int lane_chunks, int max_warps) {
      const int per_warp = 32 * lane_chunks;
      const int warps = std::min(std::max((chunks + per_warp - 1) / per_warp, 1), max_warps);
      const int tile = warps * per_warp;
      return Fit{warps, (chunks + tile - 1) / tile * tile};
    };
    const Fit seven = fit(7, Nvfp4Shape<7>::kMaxWarps);
    const Fit four = fit(4, Nvfp4Shape<4>::kMaxWarps);
    nvfp4_lane_chunks = seven.padded <= four.padded ? 7 : 4;
    threads = 32 * (nvfp4_lane_chunks == 7 ? seven.warps : four.warps);
    nvfp4_one_tile = threads / 32 * 32 * nvfp4_lane_chunks == chunks;
    const int forced = p.nvfp4_shared_lane_chunks;
    if (p.nvfp4_shared_rows && quantize && static_cast<size_t>(chunks) * 16 <= kMaxSharedRowBytes) {
      if (forced == 0) {
        nvfp4_shared = nvfp4_one_tile;
      } else if (chunks % (32 * forced) == 0 && chunks / (32 * forced) <= kNvfp4MaxWarps) {
        // A forced lane-chunk count that makes the row one tile of whole warps.
        nvfp4_shared = nvfp4_one_tile = true;
        nvfp4_lane_chunks = forced;
        threads = chunks / forced;
      }
    }
    if (quantize) quant_blocks = p.tokens;
    // Not at 14 lane chunks, where the looping kernel spilled (16 bytes) at the 40-register cap.
    nvfp4_pipeline = nvfp4_shared && p.nvfp4_shared_pipeline && nvfp4_lane_chunks != 14 &&
                     static_cast<size_t>(chunks) * 32 <= kMaxSharedRowBytes;
  } else if (quantize) {
    const int64_t per_block = static_cast<int64_t>(mx_threads) * kMxfp8ThreadChunks;
    quant_blocks = (mx_chunks + per_block - 1) / per_block;
  }
  const int64_t routes = p.topk_ids != nullptr ? static_cast<int64_t>(p.tokens) * p.top_k : 0;
  const int remap_blocks = static_cast<int>((routes + threads - 1) / threads);
  if (quant_blocks + remap_blocks == 0) return cudaSuccess;
  StagingKernel pipeline = nullptr;
  if (nvfp4_pipeline) {
    // One wave: as many looping blocks as fit on the device at once (fewer when rows are few).
    pipeline = nvfp4_lane_chunks == 7 ? StageNvfp4SharedPipelineKernel<7>
                                      : StageNvfp4SharedPipelineKernel<4>;
    const size_t smem = static_cast<size_t>(p.hidden_size) * 4;
    int device = 0, sms = 0, per_sm = 0;
    if (const cudaError_t e = PreferSharedCarveout(pipeline, nvfp4_lane_chunks, true);
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pipeline, threads, smem);
        e != cudaSuccess) {
      return e;
    }
    quant_blocks = std::min<int64_t>(quant_blocks, static_cast<int64_t>(std::max(per_sm, 1)) * sms);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(quant_blocks + remap_blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  // 1024-thread MXFP8 blocks measured faster without it (a waiting block holds half an SM).
  config.numAttrs = p.programmatic && (nvfp4 || mx_threads != 1024) ? 1 : 0;
  StagingKernel kernel =
      nvfp4_shared ? (nvfp4_lane_chunks == 14  ? StageNvfp4SharedKernel<14>
                      : nvfp4_lane_chunks == 7 ? StageNvfp4SharedKernel<7>
                                               : StageNvfp4SharedKernel<4>)
      : nvfp4      ? Nvfp4Kernel(nvfp4_lane_chunks, nvfp4_one_tile, p.nvfp4_one_tile_registers)
      : mx_threads == 1024 ? StageMxfp8Kernel<1024>
      : mx_threads == 512  ? StageMxfp8Kernel<512>
                           : StageMxfp8Kernel<256>;
  if (kernel == nullptr) return cudaErrorInvalidValue;
  if (pipeline != nullptr) {
    config.dynamicSmemBytes = static_cast<size_t>(p.hidden_size) * 4;
    return cudaLaunchKernelEx(&config, pipeline, p, remap_blocks);
  }
  if (nvfp4_shared) {
    config.dynamicSmemBytes = static_cast<size_t>(p.hidden_size) * 2;
    if (const cudaError_t e = PreferSharedCarveout(kernel, nvfp4_lane_chunks); e != cudaSuccess) {
      return e;
    }
  }
  return cudaLaunchKernelEx(&config, kernel, p, remap_blocks);
}

}  // namespace moe::cuda
