// Probe: would an E2M1 decode through the hardware E4M3 -> F16 unpack (F2FP.F16.E4M3.UNPACK_B)
// be cheaper than the BF16 shift-and-mask decode of kernels/cuda/fp4_fragment.h? The decode points
// of the expert GEMMs (problem A 1-512 tokens, B 64) spend most of their instructions turning
// packed E2M1 words into MMA fragments, 11 bit operations per word of 8 codes plus 4 block-scale
// multiplies (NOTES-cuda.md, "Static SASS budget"). The E4M3 route places 4 codes per register in
// E4M3 bit positions (sign at 7, exponent and mantissa at 4..2: one mask for half the codes, two
// shifts and a merge for the other half), unpacks pairs with one conversion each, multiplies in
// f16 (activations would be staged as f16 with a per-token power of two) and applies the block
// scale to the fp32 accumulator, once per 32-element block.
//
// Each form decodes words that sit in L1 (64 KB, read over and over) at full occupancy, with and
// without the MMA that consumes them, and reports the time per word and SM:
//   bf16          UnpackFragmentWordMul + mul.bf16x2 by the scale pair (today's decode)
//   bf16+mma      ... + one mma.m16n8k16 bf16 per word (one k-step of one 16-row tile, 8 tokens)
//   e4m3          mask/shift placement + 4 cvt.rn.f16x2.e4m3x2
//   e4m3+mma      ... + one mma.m16n8k16 f16 per word, the block scale as 4 FFMA per 2 words
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/decode_unpack bench/probes/decode_unpack.cu
//   /tmp/decode_unpack          (two rounds, median of 10 launches per form)
//   /tmp/decode_unpack once     (one launch per form, for ncu)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe.h"

constexpr int kVectors = 4096;  // uint4 words of codes: 64 KB
constexpr uint32_t kMagMask = 0x01C001C0u, kSignMask = 0x80008000u;

struct Params {
  const uint4* codes;
  uint32_t* out;
  uint32_t m0, m1, m2, m3;  // the shift multipliers {2, 4, 8, 64}, opaque to the compiler
  uint32_t scale;           // a bf16x2 / f16x2 scale pair
  float fscale;
  int iters;
};

__device__ __forceinline__ uint32_t Mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t UnpackE4m3(uint32_t v) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<uint16_t>(v)));
  return d;
}
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// Today's decode (fp4_fragment.h, UnpackFragmentWordMul) and the scale multiply.
__device__ __forceinline__ void DecodeBf16(uint32_t w, const Params& p, uint32_t (&r)[4]) {
  r[0] = w & (kMagMask | kSignMask);
  r[1] = (w * p.m2) & (kMagMask | kSignMask);
  r[2] = ((w * p.m3) & kMagMask) | ((w * p.m1) & kSignMask);
  r[3] = ((w >> 3) & kMagMask) | ((w * p.m0) & kSignMask);
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = Mul2(r[j], p.scale);
}

// The E4M3 route: codes of registers 0-1 at E4M3 positions {7, 4, 3, 2} of each byte (one
// mask), those of registers 2-3 at {6, 5, 1, 0} (sign to 7 by one shift, the other three bits
// to 4..2 by another, merged), the upper halves shifted down, each pair unpacked.
__device__ __forceinline__ void DecodeE4m3(uint32_t w, const Params& p, uint32_t (&r)[4]) {
  const uint32_t lo = w & 0x9C9C9C9Cu;
  const uint32_t hi = ((w * p.m0) & 0x80808080u) | ((w * p.m1) & 0x1C1C1C1Cu);
  r[0] = UnpackE4m3(lo);
  r[1] = UnpackE4m3(lo >> 16);
  r[2] = UnpackE4m3(hi);
  r[3] = UnpackE4m3(hi >> 16);
}

template <bool kE4m3, bool kMma>
__global__ void __launch_bounds__(256) DecodeKernel(Params p) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  uint32_t x = 0;
  const uint32_t b0 = p.scale ^ 0x11111111u, b1 = p.scale ^ 0x22222222u;
  int index = tid % kVectors;
  for (int it = 0; it < p.iters; ++it) {
    const uint4 v = p.codes[index];
    index = (index + 97) & (kVectors - 1);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tmp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t r[4];
        if constexpr (kE4m3) {
          DecodeE4m3(words[2 * half + j], p, r);
        } else {
          DecodeBf16(words[2 * half + j], p, r);
        }
        if constexpr (!kMma) {
          x ^= r[0] ^ r[1] ^ r[2] ^ r[3];
        } else if constexpr (kE4m3) {
          float d[4];
          MmaF16(d, r, b0, b1, tmp);
#pragma unroll
          for (int e = 0; e < 4; ++e) tmp[e] = d[e];
        } else {
          MmaBf16(acc, r, b0, b1);
        }
      }
      if constexpr (kMma && kE4m3) {
        // The block scale of these 32 K elements, applied to the accumulator.
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = fmaf(tmp[e], p.fscale, acc[e]);
      }
    }
  }
  p.out[tid] = x ^ __float_as_uint(acc[0] + acc[1] + acc[2] + acc[3]);
}

int main(int argc, char** argv) {
  const bool once = argc > 1;
  std::vector<uint32_t> host(kVectors * 4);
  uint32_t r = 7;
  for (auto& h : host) {
    r = r * 1664525u + 1013904223u;
    h = r;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = sms * 8, threads = 256;
  Params p{};
  CHECK(cudaMalloc(&p.codes, host.size() * 4));
  CHECK(cudaMemcpy(const_cast<uint4*>(p.codes), host.data(), host.size() * 4,
                   cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&p.out, size_t(blocks) * threads * 4));
  p.m0 = 2;
  p.m1 = 4;
  p.m2 = 8;
  p.m3 = 64;
  p.scale = 0x3F803F80u;
  p.fscale = 1.f;
  p.iters = 2048;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  auto time = [&](void (*kernel)(Params), const char* name) {
    std::vector<double> us;
    for (int rep = 0; rep < (once ? 1 : 12); ++rep) {
      CHECK(cudaEventRecord(a));
      kernel<<<blocks, threads>>>(p);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (once || rep >= 2) us.push_back(ms * 1e3);
    }
    std::sort(us.begin(), us.end());
    const double med = us[us.size() / 2];
    const double words = double(blocks) * threads * p.iters * 4;
    std::printf("%-10s %9.1f us  %.3f ns per word and SM  (%.2f words per SM and ns)\n", name,
                med, med * 1e3 * sms / words, words / (med * 1e3 * sms));
  };
  for (int round = 0; round < (once ? 1 : 2); ++round) {
    std::printf("round %d (%d blocks x %d threads, %d iterations of 4 words)\n", round, blocks,
                threads, p.iters);
    time(DecodeKernel<false, false>, "bf16");
    time(DecodeKernel<true, false>, "e4m3");
    time(DecodeKernel<false, true>, "bf16+mma");
    time(DecodeKernel<true, true>, "e4m3+mma");
  }
  return 0;
}
