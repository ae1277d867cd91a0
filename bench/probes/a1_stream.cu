// Probe: the streaming floor of problem A at one token. The layer reads 4 experts' weights:
// GEMM1 8.81 MB each (35.2 MB), then GEMM2 4.41 MB each (17.6 MB), 12.5 us at the 4.23 TB/s copy
// rate. kernel_bench takes 30.5 us for the whole layer (two grids, programmatic launch), its GEMM1
// alone 21.4 us and GEMM2 alone 15.7 us. What do the same bytes cost with no arithmetic at all,
// read by grids of the same shape?
//   g1 / g2       one grid reading GEMM1's (GEMM2's) bytes of 4 experts
//   g1;g2         the two grids in stream order
//   g1;g2 pdl     the second launched programmatically: it reads its weights while the first
//                 finishes and waits (griddepcontrol.wait) only before its final store
//   fused         one grid reading both
// Each grid: 1-8 CTAs of 128 threads per SM, every thread keeps 4, 8 or 16 16-byte loads in
// flight (streaming, evict-first), one 4-byte store per thread. Experts are drawn at random
// from 128 (1.69 GB), 16 passes per graph, so L2 (60 MB) never holds them; median of 50
// replays, us per pass.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/a1_stream bench/probes/a1_stream.cu
//   /tmp/a1_stream          (the steady-state sweep, then the one-token forms)
//   /tmp/a1_stream large    (the steady-state sweep only: A 64's 1.47 GB in one grid)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <type_traits>
#include <vector>

#include "probe.h"

constexpr int kExperts = 128, kActive = 4, kPasses = 16, kThreads = 128;
constexpr int64_t kW13 = 8810 * 1024, kW2 = 4410 * 1024;  // bytes per expert (multiples of 16)

struct Pass {
  const uint4* part[2 * kActive];  // GEMM1's bytes of the 4 experts, then GEMM2's
};

// Thread i of the grid reads 16-byte vectors i, i + n, ... of `total` (kInFlight loads issued
// before any is used; load(j) returns vector j) and folds them into one word.
template <int kInFlight, class Load>
__device__ __forceinline__ uint32_t GridStream(int64_t total, const Load& load) {
  const int64_t n = int64_t{gridDim.x} * blockDim.x;
  uint32_t x = 0;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; base < total;
       base += n * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const int64_t i = base + k * n;
      v[k] = i < total ? load(i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) x ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  return x;
}

// GridStream over parts [first, first + count) of the pass, one after another (GEMM1's parts
// kW13 bytes each, GEMM2's kW2).
template <int kInFlight>
__device__ __forceinline__ uint32_t StreamParts(const Pass& pass, int first, int count) {
  constexpr int64_t v1 = kW13 / 16, v2 = kW2 / 16;
  int64_t total = 0;
  for (int p = first; p < first + count; ++p) total += p < kActive ? v1 : v2;
  return GridStream<kInFlight>(total, [&](int64_t i) {
    int p = first;
    for (;;) {
      const int64_t len = p < kActive ? v1 : v2;
      if (i < len) break;
      i -= len;
      ++p;
    }
    return __ldcs(pass.part[p] + i);
  });
}

template <int kGemm, bool kWait, int kInFlight>
__global__ void __launch_bounds__(kThreads) StreamGemm(Pass pass, uint32_t* out) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint32_t x = StreamParts<kInFlight>(pass, kGemm * kActive, kActive);
  if constexpr (kWait) asm volatile("griddepcontrol.wait;" ::: "memory");
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

// Steady state: one grid reading `vectors` 16-byte vectors from one large buffer.
template <int kInFlight>
__global__ void __launch_bounds__(kThreads) StreamLarge(const uint4* data, int64_t vectors,
                                                       uint32_t* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] =
      GridStream<kInFlight>(vectors, [&](int64_t i) { return __ldcs(data + i); });
}

template <int kInFlight>
__global__ void __launch_bounds__(kThreads) StreamFused(Pass pass, uint32_t* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = StreamParts<kInFlight>(pass, 0, 2 * kActive);
}

int main(int argc, char** argv) {
  (void)argv;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<uint4*> w13(kExperts), w2(kExperts);
  for (int e = 0; e < kExperts; ++e) {
    CHECK(cudaMalloc(&w13[e], kW13));
    CHECK(cudaMalloc(&w2[e], kW2));
    CHECK(cudaMemset(w13[e], e, kW13));
    CHECK(cudaMemset(w2[e], e, kW2));
  }
  std::mt19937 rng(5);
  std::vector<Pass> passes(kPasses);
  for (Pass& p : passes) {
    std::vector<int> ids(kExperts);
    for (int e = 0; e < kExperts; ++e) ids[e] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int a = 0; a < kActive; ++a) {
      p.part[a] = w13[ids[a]];
      p.part[kActive + a] = w2[ids[a]];
    }
  }
  uint32_t* out;
  CHECK(cudaMalloc(&out, size_t{1} << 24));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  auto time_us = [&](const std::function<void(const Pass&)>& launch) {
    return GraphMedianUs(
        stream, [&] {
          for (const Pass& x : passes) launch(x);
        },
        kPasses);
  };
  auto launch = [&](auto kernel, int blocks, bool programmatic, const Pass& p) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = programmatic ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, kernel, p, out));
  };
  const double bytes1 = 4.0 * kW13, bytes2 = 4.0 * kW2;
  auto report = [&](const char* name, double us, double bytes) {
    std::printf("%-34s %7.2f us  %.2f TB/s\n", name, us, bytes / us / 1e6);
  };
  auto sweep = [&](auto in_flight) {
    constexpr int F = decltype(in_flight)::value;
    for (int per_sm : {1, 2, 4, 8}) {
      const int blocks = sms * per_sm;
      std::printf("%d CTAs of %d threads per SM, %d 16-byte loads in flight per thread (%d KB per "
                  "SM)\n",
                  per_sm, kThreads, F, per_sm * kThreads * F * 16 / 1024);
      report("  g1",
             time_us([&](const Pass& p) { launch(StreamGemm<0, false, F>, blocks, false, p); }),
             bytes1);
      report("  g2",
             time_us([&](const Pass& p) { launch(StreamGemm<1, false, F>, blocks, false, p); }),
             bytes2);
      report("  g1;g2", time_us([&](const Pass& p) {
               launch(StreamGemm<0, false, F>, blocks, false, p);
               launch(StreamGemm<1, false, F>, blocks, false, p);
             }),
             bytes1 + bytes2);
      report("  g1;g2 pdl", time_us([&](const Pass& p) {
               launch(StreamGemm<0, false, F>, blocks, false, p);
               launch(StreamGemm<1, true, F>, blocks, true, p);
             }),
             bytes1 + bytes2);
      report("  fused", time_us([&](const Pass& p) { launch(StreamFused<F>, blocks, false, p); }),
             bytes1 + bytes2);
    }
  };
  // Steady state, the bytes of problem A at 64 tokens (111 experts' GEMM1 and GEMM2: 1.47 GB)
  // from one buffer, one grid per replay: what a long decode-point stream can reach.
  const int64_t large_bytes = int64_t{111} * (kW13 + kW2);
  uint4* large;
  CHECK(cudaMalloc(&large, large_bytes));
  CHECK(cudaMemset(large, 1, large_bytes));
  auto time_large = [&](auto kernel, int blocks) {
    std::vector<double> us;
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 23; ++i) {
      CHECK(cudaEventRecord(a, stream));
      kernel<<<blocks, kThreads, 0, stream>>>(large, large_bytes / 16, out);
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 3) us.push_back(ms * 1e3);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  auto sweep_large = [&](auto in_flight) {
    constexpr int F = decltype(in_flight)::value;
    for (int per_sm : {2, 4, 8, 16}) {
      const double us = time_large(StreamLarge<F>, sms * per_sm);
      std::printf("large (%.2f GB), %2d CTAs/SM x %2d loads in flight (%3d KB per SM): %7.1f us  "
                  "%.2f TB/s\n",
                  large_bytes / 1e9, per_sm, F, per_sm * kThreads * F * 16 / 1024, us,
                  large_bytes / us / 1e6);
    }
  };
  for (int round = 0; round < 2; ++round) {
    sweep_large(std::integral_constant<int, 4>());
    sweep_large(std::integral_constant<int, 8>());
    sweep_large(std::integral_constant<int, 16>());
  }
  if (argc > 1) return 0;  // "large": the steady-state sweep only
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d (%d SMs)\n", round, sms);
    sweep(std::integral_constant<int, 4>());
    sweep(std::integral_constant<int, 8>());
    sweep(std::integral_constant<int, 16>());
  }
  return 0;
}
