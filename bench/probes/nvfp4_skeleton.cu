// Probe: what bounds NVFP4 staging at 4096 x 7168 (~30 us, 60% of copy bandwidth)? The kernel
// in kernels/cuda/staging.cu reads a row once (14 KB, BF16) and writes 3.5 KB of codes plus 448
// scale bytes; one block of 7 warps per row, ~18 instructions per element. This probe keeps the
// same bytes and the same launch shape but replaces the quantization by dummy work whose size is
// a template parameter, so that time can be read against instructions per element:
//   stream      grid-stride read of the rows and write of the outputs (no row structure)
//   rows        one block of 7 warps per row, 4 loads per lane, outputs from a few LOP3s
//   rows+bar    the same plus one block barrier after the loads (the row amax)
//   rows+bar+N  the same plus N dependent bf16x2 FMAs per 16-byte chunk and lane (N = 16, 32, 64)
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/nvfp4_skeleton bench/probes/nvfp4_skeleton.cu
//   /tmp/nvfp4_skeleton
//
// Every form runs as a CUDA graph of 4 launches over 4 input sets (235 MB, far over L2), median
// of 50 replays, microseconds per launch, next to a device-to-device copy of the same bytes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe.h"

constexpr int kTokens = 4096, kHidden = 7168, kChunks = kHidden / 8, kSets = 4;

struct Set {
  uint4* x;
  uint32_t* q;     // 4 bytes per chunk of 8 elements
  uint8_t* scale;  // 1 byte per group of 16
};

__device__ __forceinline__ uint32_t Fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__global__ void StreamKernel(Set s) {
  const int64_t n = int64_t{kTokens} * kChunks;
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < n;
       c += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(s.x + c);
    s.q[c] = v.x ^ v.y ^ v.z ^ v.w;
    if ((c & 1) == 0) s.scale[c / 2] = static_cast<uint8_t>(v.x >> 24);
  }
}

// One block of 224 threads per row; lane loads chunks tile + 32 j + lane, j < 4.
template <bool kBarrier, int kWork>
__global__ void __launch_bounds__(224) RowKernel(Set s) {
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint4* row = s.x + t * kChunks;
  uint4 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = __ldcs(row + warp * 128 + 32 * j + lane);
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) m = max(m, max(max(v[j].x, v[j].y), max(v[j].z, v[j].w)));
  if constexpr (kBarrier) {
    __shared__ uint32_t partial[7];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    m = partial[lane % 7];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a = v[j].x, b = v[j].y, c = v[j].z, d = v[j].w;
#pragma unroll
    for (int i = 0; i < kWork / 4; ++i) {
      a = Fma2(a, m, b);
      b = Fma2(b, m, c);
      c = Fma2(c, m, d);
      d = Fma2(d, m, a);
    }
    const int64_t chunk = t * kChunks + warp * 128 + 32 * j + lane;
    s.q[chunk] = a ^ b ^ c ^ d;
    if ((lane & 1) == 0) s.scale[chunk / 2] = static_cast<uint8_t>(a >> 24);
  }
}

int main() {
  std::vector<Set> sets(kSets);
  const size_t x_bytes = size_t{kTokens} * kHidden * 2;
  std::vector<uint16_t> host(size_t{kTokens} * kHidden);
  uint32_t r = 12345;
  for (auto& h : host) {
    r = r * 1664525u + 1013904223u;
    h = static_cast<uint16_t>(0x3C00 + (r >> 24));  // finite BF16 values near 0.008
  }
  for (Set& s : sets) {
    CHECK(cudaMalloc(&s.x, x_bytes));
    CHECK(cudaMalloc(&s.q, x_bytes / 4));
    CHECK(cudaMalloc(&s.scale, x_bytes / 32));
    CHECK(cudaMemcpy(s.x, host.data(), x_bytes, cudaMemcpyHostToDevice));
  }
  const double bytes = x_bytes + x_bytes / 4 + x_bytes / 32;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  auto time_us = [&](const std::function<void(const Set&)>& launch) {
    return GraphMedianUs(
        stream, [&] {
          for (const Set& x : sets) launch(x);
        },
        kSets);
  };
  auto report = [&](const char* name, double us, double ref) {
    std::printf("%-28s %8.2f us  %.3f TB/s  %5.1f%% of copy\n", name, us, bytes / us / 1e6,
                100 * ref / us);
  };

  // Copy of the same bytes (read + write), device to device: the reference.
  std::vector<void*> dst(kSets);
  for (auto& d : dst) CHECK(cudaMalloc(&d, size_t(bytes / 2)));
  int k = 0;
  const double copy = time_us([&](const Set& s) {
    CHECK(cudaMemcpyAsync(dst[k++ % kSets], s.x, size_t(bytes / 2), cudaMemcpyDeviceToDevice,
                          stream));
  });
  report("copy (same bytes)", copy, copy);
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d\n", round);
    report("stream", time_us([&](const Set& s) { StreamKernel<<<sms * 8, 256, 0, stream>>>(s); }),
           copy);
    const struct {
      const char* name;
      void (*kernel)(Set);
    } forms[] = {{"rows", RowKernel<false, 0>},          {"rows+bar", RowKernel<true, 0>},
                 {"rows+bar+16", RowKernel<true, 16>},   {"rows+bar+32", RowKernel<true, 32>},
                 {"rows+bar+64", RowKernel<true, 64>},   {"rows+bar+128", RowKernel<true, 128>},
                 {"rows+64 (no barrier)", RowKernel<false, 64>}};
    for (const auto& form : forms) {
      report(form.name,
             time_us([&](const Set& s) { form.kernel<<<kTokens, 224, 0, stream>>>(s); }), copy);
    }
  }
  return 0;
}
