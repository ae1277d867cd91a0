// Fused activation staging (see staging_kernels.h). The element codecs repeat formats.cc step by
// step with explicitly rounded operations (__fmul_rn / __fdiv_rn: no contraction, IEEE division,
// no flush to zero), so the bytes match the CPU reference exactly. Amax uses fmaxf from 0, which
// skips NaN exactly like the CPU's `if (|v| > amax)` loop, and max is order-independent.
//
// Grid: the quantization blocks first, then one thread per route for the EPLB remap and load
// recording. MXFP8: each thread owns 8 consecutive elements (one 16-byte load), four lanes a
// group of 32, sixteen lanes a packed scale word. NVFP4: one block per token row (the token scale
// needs the whole row's amax first), each lane one group of 16 in the second pass; E2M1 codes by
// exact threshold comparisons in double instead of a division per element.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/staging_kernels.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = kStagingThreads;
constexpr unsigned kFull = 0xFFFFFFFFu;
// MXFP8 element codes through the hardware conversion (cvt.rn.satfinite.e4m3x2.f32: round half to
// even, saturate to +-448 (infinities too), NaN -> 0x7F), which gives the bytes of FloatToE4m3;
// staging_cuda_test checks it. false: the software codec below, step by step as formats.cc.
constexpr bool kHardwareE4m3 = true;

// 2^n for n in [-126, 127].
__device__ __forceinline__ float Pow2(int n) { return __uint_as_float(static_cast<uint32_t>(n + 127) << 23); }

// Element i (0..7) of eight BF16 values in a uint4, as fp32.
__device__ __forceinline__ float Bf16At(const uint4& v, int i) {
  const uint32_t w = i < 2 ? v.x : (i < 4 ? v.y : (i < 6 ? v.z : v.w));
  return __uint_as_float((i & 1) != 0 ? (w & 0xFFFF0000u) : (w << 16));
}

// FloatToE4m3 of formats.cc: saturating, round half to even on the E4M3 grid, NaN -> 0x7F.
__device__ __forceinline__ uint32_t E4m3Encode(float x) {
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

// E4m3ToFloat of formats.cc.
__device__ __forceinline__ float E4m3Decode(uint32_t bits) {
  if ((bits & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  const float magnitude = exponent == 0 ? __fmul_rn(static_cast<float>(mantissa), Pow2(-9))
                                        : __fmul_rn(static_cast<float>(8 + mantissa), Pow2(exponent - 10));
  return (bits & 0x80u) != 0 ? -magnitude : magnitude;
}

// FloatToE2m1 of formats.cc counts the thresholds its argument passes (midpoints to the even
// code): > 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5. For its argument fl(q), the
// correctly rounded quotient q = |x| / unit: fl(q) > c iff q > c + ulp(c) / 2, and fl(q) >= c iff
// q >= c - ulp(c) / 2 (every threshold has an even last mantissa bit, so a tie rounds to c).
// Each bound has at most 26 significant bits and unit 24, so bound * unit is exact in double.
__device__ constexpr double kE2m1Bounds[7] = {
    0.25 + 0x1p-26, 0.75 - 0x1p-25, 1.25 + 0x1p-24, 1.75 - 0x1p-24,
    2.5 + 0x1p-23,  3.5 - 0x1p-23,  5.0 + 0x1p-22};

// FloatToE2m1(x / unit) given bound[k] = kE2m1Bounds[k] * unit (unit > 0): the same code for
// every x, NaN (no comparison holds: 0) and infinities (all hold: 7) included.
__device__ __forceinline__ uint32_t E2m1EncodeScaled(float x, const double (&bound)[7]) {
  const double a = fabs(static_cast<double>(x));
  const uint32_t m = (a > bound[0]) + (a >= bound[1]) + (a > bound[2]) + (a >= bound[3]) +
                     (a > bound[4]) + (a >= bound[5]) + (a > bound[6]);
  if (m == 0) return 0;
  return signbit(x) ? (0x8u | m) : m;
}

// Ue8m0RoundUp of staging.cc: biased exponent, +1 if any mantissa bit, clamped to [1, 254].
__device__ __forceinline__ uint32_t Ue8m0RoundUp(float s) {
  const uint32_t bits = __float_as_uint(s);
  const int e = static_cast<int>((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
  return static_cast<uint32_t>(min(max(e, 1), 254));
}

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

__global__ void __launch_bounds__(kThreads) StageMxfp8Kernel(const StagingParams p,
                                                             int quant_blocks) {
  if (static_cast<int>(blockIdx.x) >= quant_blocks) {
    RemapRoute(p, static_cast<int64_t>(blockIdx.x - quant_blocks) * kThreads + threadIdx.x);
    return;
  }
  // Chunks of 8 elements; a row holds H/8 (a multiple of 16), so every aligned 16-lane span is
  // one scale word of one row and lanes are valid or invalid in whole spans.
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t chunks = static_cast<int64_t>(p.tokens) * p.hidden_size / 8;
  const bool valid = chunk < chunks;
  uint4 raw = make_uint4(0, 0, 0, 0);
  if (valid) raw = __ldcs(reinterpret_cast<const uint4*>(p.x) + chunk);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(Bf16At(raw, i)));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
  const uint32_t e = Ue8m0RoundUp(__fdiv_rn(fmaxf(amax, 1e-4f), 448.f));
  // 2^(127 - e): e = 254 gives the subnormal 2^-127.
  const float inverse = e == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((254u - e) << 23);
  uint32_t lo = 0, hi = 0;
  if constexpr (kHardwareE4m3) {
    uint32_t pairs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = make_float2(__fmul_rn(Bf16At(raw, 2 * i), inverse),
                                   __fmul_rn(Bf16At(raw, 2 * i + 1), inverse));
      pairs[i] = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);  // .x in the low byte
    }
    lo = pairs[0] | pairs[1] << 16;
    hi = pairs[2] | pairs[3] << 16;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) lo |= E4m3Encode(__fmul_rn(Bf16At(raw, i), inverse)) << (8 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) hi |= E4m3Encode(__fmul_rn(Bf16At(raw, 4 + i), inverse)) << (8 * i);
  }
  const int lane = threadIdx.x & 31;
  const int span = lane & ~15;
  const uint32_t word = __shfl_sync(kFull, e, span) | __shfl_sync(kFull, e, span + 4) << 8 |
                        __shfl_sync(kFull, e, span + 8) << 16 | __shfl_sync(kFull, e, span + 12) << 24;
  if (!valid) return;
  __stcs(reinterpret_cast<uint2*>(p.q) + chunk, make_uint2(lo, hi));
  if ((lane & 15) == 0) p.scales[chunk / 16] = static_cast<int32_t>(word);
}

// Largest |x| of a BF16 row (block-wide; every thread gets it).
__device__ float RowAmax(const uint4* row, int chunks) {
  __shared__ float partial[kThreads / 32];
  float amax = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint4 v = __ldg(row + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(Bf16At(v, i)));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, partial[w]);
  return amax;
}

__global__ void __launch_bounds__(kThreads) StageNvfp4Kernel(const StagingParams p,
                                                             int quant_blocks) {
  if (static_cast<int>(blockIdx.x) >= quant_blocks) {
    RemapRoute(p, static_cast<int64_t>(blockIdx.x - quant_blocks) * kThreads + threadIdx.x);
    return;
  }
  const int64_t t = blockIdx.x;
  const int h = p.hidden_size;
  const uint4* row = reinterpret_cast<const uint4*>(p.x + t * h);
  const float x_scale = __fdiv_rn(fmaxf(RowAmax(row, h / 8), FLT_MIN), 2688.f);
  if (threadIdx.x == 0) p.token_scale[t] = x_scale;
  const float sf_denominator = __fmul_rn(6.f, x_scale);
  const int groups = h / 16;  // a multiple of 4: quads are valid or invalid together
  const int lane = threadIdx.x & 31;
  for (int base = threadIdx.x & ~31; base < groups; base += kThreads) {
    const int g = base + lane;
    const bool valid = g < groups;
    uint4 a = make_uint4(0, 0, 0, 0), b = a;
    if (valid) {
      a = __ldcs(row + 2 * g);  // second read of the row: from L1/L2
      b = __ldcs(row + 2 * g + 1);
    }
    float gmax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) gmax = fmaxf(gmax, fmaxf(fabsf(Bf16At(a, i)), fabsf(Bf16At(b, i))));
    const uint32_t sf_bits = E4m3Encode(__fdiv_rn(gmax, sf_denominator));
    const float sf = E4m3Decode(sf_bits);
    const float unit = __fmul_rn(sf, x_scale);
    uint32_t lo = 0, hi = 0;
    if (sf != 0.f) {
      // FloatToE2m1(x / unit) without the 16 IEEE divisions: the rounded quotient passes a
      // threshold exactly when |x| passes the threshold's rounding boundary times unit, and that
      // product is exact in double (kE2m1Bounds).
      double bound[7];
#pragma unroll
      for (int k = 0; k < 7; ++k) bound[k] = kE2m1Bounds[k] * static_cast<double>(unit);
#pragma unroll
      for (int i = 0; i < 8; ++i) lo |= E2m1EncodeScaled(Bf16At(a, i), bound) << (4 * i);
#pragma unroll
      for (int i = 0; i < 8; ++i) hi |= E2m1EncodeScaled(Bf16At(b, i), bound) << (4 * i);
    }
    const int quad = lane & ~3;
    const uint32_t word = __shfl_sync(kFull, sf_bits, quad) | __shfl_sync(kFull, sf_bits, quad + 1) << 8 |
                          __shfl_sync(kFull, sf_bits, quad + 2) << 16 |
                          __shfl_sync(kFull, sf_bits, quad + 3) << 24;
    if (!valid) continue;
    reinterpret_cast<uint2*>(p.q + t * (h / 2))[g] = make_uint2(lo, hi);
    if ((lane & 3) == 0) p.scales[t * (h / 64) + g / 4] = static_cast<int32_t>(word);
  }
}

}  // namespace

cudaError_t LaunchStaging(const StagingParams& p, cudaStream_t stream) {
  int quant_blocks = 0;
  if (p.x != nullptr && p.tokens > 0) {
    quant_blocks = p.format == StagingFormat::kNvfp4
                       ? p.tokens
                       : static_cast<int>((static_cast<int64_t>(p.tokens) * p.hidden_size / 8 +
                                           kThreads - 1) / kThreads);
  }
  const int64_t routes = p.topk_ids != nullptr ? static_cast<int64_t>(p.tokens) * p.top_k : 0;
  const int remap_blocks = static_cast<int>((routes + kThreads - 1) / kThreads);
  if (quant_blocks + remap_blocks == 0) return cudaSuccess;
  const dim3 grid(quant_blocks + remap_blocks);
  if (p.format == StagingFormat::kNvfp4) {
    StageNvfp4Kernel<<<grid, kThreads, 0, stream>>>(p, quant_blocks);
  } else {
    StageMxfp8Kernel<<<grid, kThreads, 0, stream>>>(p, quant_blocks);
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda
