// Expert GEMMs for large token tiles (items of up to 128 tokens, GemmLaunch::token_groups 16) on
// Hopper warpgroup MMA (sm_90a wgmma.mma_async, A from registers, B from shared memory).
//
// A CTA = 2 warpgroups x 2 m64 blocks = 256 weight rows (16 tiles of repack.h) of one item. Each
// warp streams its two tiles' packed E2M1 codes + scales through a register ring exactly as the
// mma.sync kernels do, and dequantizes one 64-element chunk into the A fragments of 4 k-steps
// (the wgmma A register fragment of a warp's 16 rows is the m16n8k16 one, fp4_fragment.h). The
// item's token rows (B, bf16, K-major) are gathered chunk by chunk into shared memory by cp.async
// into the 128-byte-swizzled layout wgmma reads (row n at n * 128 bytes, 16-byte vector v stored
// at vector v ^ (n % 8); stages 1024-byte aligned), kWgStages deep. The activations here are in
// natural K order (the prologue and this GEMM1's epilogue write them so when the plan uses this
// kernel; ExpertPrologueParams::natural_order). The item's token count picks the wgmma width
// N in {32, 64, 96, 128} once per CTA; token columns past the count hold stale shared memory and
// only feed accumulator columns the epilogue never writes.
//
// Per chunk i: wait for its B stage, barrier, refill the stage of chunk i - 2 (its wgmma groups
// finished: every warpgroup waited for them before the barrier), then per m64 block b: wait until
// at most one wgmma group is pending (the one of block b of chunk i - 1 is done, so its A
// registers may be rewritten), dequantize, fence, 4 wgmma (k-steps), commit. One group of the
// other block stays in flight while a block is dequantized.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"
#include "kernels/cuda/wgmma_ops.cuh"

namespace moe::cuda::detail {
namespace {

// CTA shapes (GemmLaunch::variant): 0: 4 warpgroups x 1 m64 block (512 threads, 128 registers
// each: twice the warps to hide each warp's dequant latency); 1: 2 warpgroups x 2 blocks (256
// threads, one block's wgmma group in flight while the other is dequantized). Both: 256 rows.
template <int V>
struct WgConfig {
  static constexpr int kGroups = V == 1 ? 2 : 4;   // warpgroups per CTA
  static constexpr int kBlocks = V == 1 ? 2 : 1;   // m64 blocks per warpgroup
  static constexpr int kThreads = kGroups * 128;
  static constexpr int kCtaRows = kGroups * kBlocks * 64;  // 256 weight rows
  static constexpr int kCtaTiles = kCtaRows / kTileRows;   // 16
};
constexpr int kWgMaxTokens = 128;
constexpr int kWgStages = 6;
constexpr int kWgRowBytes = kChunkK * 2;                    // one token's chunk: 128 bytes
constexpr uint32_t kWgStageBytes = kWgMaxTokens * kWgRowBytes;  // 16 KB
constexpr size_t kWgSmemBytes = kWgStages * kWgStageBytes + 1024;  // + alignment slack

template <class Fmt>
constexpr int WgPrefetch() {
  return std::is_same_v<Fmt, Mxfp4> ? 4 : 3;  // weight chunks in flight per warp
}

__device__ __forceinline__ void WgCpAsync16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void WgCpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgCpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// cp.async writes are generic-proxy writes; wgmma reads shared memory through the async proxy.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row core groups 1024 bytes apart
// (stride byte offset), leading byte offset unused for this layout (1), base offset 0.
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t addr) {
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>(1) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// Gathers one chunk of the item's first N token rows into a stage (swizzled); tokens past the
// item's count are not copied.
template <int N, int kThreads>
struct WgBLoader {
  static constexpr int kVectors = N * kActChunkVectors;
  static constexpr int kPerThread = (kVectors + kThreads - 1) / kThreads;
  const uint4* src[kPerThread];
  uint32_t dst[kPerThread];

  __device__ __forceinline__ void Init(const ExpertGemmParams& p, const ExpertItem& item) {
    const int64_t row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
    const uint4* base = reinterpret_cast<const uint4*>(p.b_rows);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int index = static_cast<int>(threadIdx.x) + k * kThreads;
      const int token = index / kActChunkVectors, v = index % kActChunkVectors;
      dst[k] = static_cast<uint32_t>(token * kWgRowBytes + ((v ^ (token & 7)) << 4));
      src[k] = nullptr;
      if (index < kVectors && token < item.count) {
        const int slot = item.slot_begin + token;
        const int row = p.b_row_of_slot != nullptr ? p.b_row_of_slot[slot] : slot;
        src[k] = base + row * row_vectors + v;
      }
    }
  }

  __device__ __forceinline__ void Load(uint32_t stage_addr, int chunk) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (src[k] != nullptr) WgCpAsync16(stage_addr + dst[k], src[k] + chunk * kActChunkVectors);
    }
  }
};

// GEMM1 epilogue (natural order act rows): acc[4q + e] = (row g (e < 2: gate) or g + 8 (up),
// token 8q + 2t + e % 2) of tile `tile`.
template <int N>
__device__ __forceinline__ void WgEpilogueAct(const ExpertGemmParams& p, const ExpertItem& item,
                                              int tile, int lane, const float (&acc)[N / 2]) {
  const int g = lane >> 2, t = lane & 3;
  if (tile * 8 >= p.out_cols) return;
  const float scale_gate = p.ep_scale[item.expert * 3 + 0];
  const float scale_up = p.ep_scale[item.expert * 3 + 1];
  const int j = tile * 8 + g;
  const bool real = j < p.out_valid;
  const int64_t bias_at = static_cast<int64_t>(item.expert) * p.out_valid + j;
  const float bias_gate = real ? p.bias_a[bias_at] : 0.f;
  const float bias_up = real ? p.bias_b[bias_at] : 0.f;
#pragma unroll
  for (int q = 0; q < N / 8; ++q) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = q * kTileTokens + 2 * t + e;
      if (col >= item.count) continue;
      const float value = real ? Activate(p.act, acc[4 * q + e] * scale_gate + bias_gate,
                                          acc[4 * q + 2 + e] * scale_up + bias_up)
                               : 0.f;
      const int64_t row = item.slot_begin + col;
      p.act_out[row * p.out_cols + j] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    }
  }
}

// GEMM2 epilogue: y[route, h] = acc * scale + b2[h].
template <int N>
__device__ __forceinline__ void WgEpilogueY(const ExpertGemmParams& p, const ExpertItem& item,
                                            int tile, int lane, const float (&acc)[N / 2]) {
  const int g = lane >> 2, t = lane & 3;
  const float scale = p.ep_scale[item.expert * 3 + 2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int h = tile * kTileRows + g + 8 * half;
    if (h >= p.out_valid) continue;
    const float bias = p.bias_a[static_cast<int64_t>(item.expert) * p.out_valid + h];
#pragma unroll
    for (int q = 0; q < N / 8; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = q * kTileTokens + 2 * t + e;
        if (col >= item.count) continue;
        const int64_t route = p.slot_route[item.slot_begin + col];
        p.y_out[route * p.out_cols + h] = acc[4 * q + 2 * half + e] * scale + bias;
      }
    }
  }
}

// Everything after the item is known, for wgmma width N.
template <class Fmt, bool kGemm1, int V, int N>
__device__ __forceinline__ void WgBody(const ExpertGemmParams& p, const ExpertItem& item,
                                       int row_block, uint32_t smem_base) {
  using Cfg = WgConfig<V>;
  constexpr int P = WgPrefetch<Fmt>(), MB = Cfg::kBlocks, S = kWgStages;
  using Scale = typename Fmt::Scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2;
  const int tile_base = row_block * Cfg::kCtaTiles + wg * (MB * 4) + wq;  // + 4 b: block b's tile

  WeightStream<Fmt, MB> stream;
#pragma unroll
  for (int b = 0; b < MB; ++b) {
    const int tile = tile_base + 4 * b < p.tiles ? tile_base + 4 * b : 0;  // past: unused
    const int64_t base = static_cast<int64_t>(tile) * p.chunks;
    stream.values[b] = static_cast<const uint4*>(p.values) +
                       item.expert * p.values_expert_stride + base * kWarpLanes + lane;
    stream.scales[b] = static_cast<const Scale*>(p.scales) +
                       item.expert * p.scales_expert_stride + base * 8 + g;
  }
  const int n = p.chunks;
  uint4 v[P][MB];
  Scale s[P][MB];
#pragma unroll
  for (int i = 0; i < P; ++i) stream.LoadIf(i < n, i, v[i], s[i]);
  if constexpr (!kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }

  WgBLoader<N, Cfg::kThreads> loader;
  loader.Init(p, item);
#pragma unroll
  for (int st = 0; st < S - 2; ++st) {
    if (st < n) loader.Load(smem_base + st * kWgStageBytes, st);
    WgCpAsyncCommit();
  }

  float acc[MB][N / 2];
#pragma unroll
  for (int b = 0; b < MB; ++b)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) acc[b][e] = 0.f;
  uint32_t a[MB][kStepsPerChunk][4];
  const uint64_t desc_base = SmemDescriptor(smem_base);

  int stage = 0;  // i % S
  for (int i0 = 0; i0 < n; i0 += P) {
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const int i = i0 + pp;
      if (i >= n) break;
      WgCpAsyncWait<S - 3>();
      FenceProxyAsync();
      __syncthreads();
      const int refill = i + S - 2;
      const int refill_stage = stage >= 2 ? stage - 2 : stage + S - 2;  // (i + S - 2) % S
      if (refill < n) loader.Load(smem_base + refill_stage * kWgStageBytes, refill);
      WgCpAsyncCommit();
      const uint64_t stage_desc = desc_base + stage * (kWgStageBytes >> 4);
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        WgmmaWait<MB - 1>();
#pragma unroll
        for (int step = 0; step < kStepsPerChunk; ++step) {
          DequantStep<Fmt>(v[pp][b], s[pp][b], step, a[b][step]);
        }
        WgmmaFence();
#pragma unroll
        for (int step = 0; step < kStepsPerChunk; ++step) {
          WgmmaRs<N>::Run(acc[b], a[b][step], stage_desc + step * (32 >> 4));
        }
        WgmmaCommit();
      }
      stream.LoadIf(i + P < n, i + P, v[pp], s[pp]);
      stage = stage == S - 1 ? 0 : stage + 1;
    }
  }
  WgmmaWait<0>();
#pragma unroll
  for (int b = 0; b < MB; ++b) {
    if constexpr (kGemm1) {
      WgEpilogueAct<N>(p, item, tile_base + 4 * b, lane, acc[b]);
    } else {
      WgEpilogueY<N>(p, item, tile_base + 4 * b, lane, acc[b]);
    }
  }
}

// blockIdx.x = row block + row_blocks * item, as in the other GEMM kernels, and the same
// programmatic launch protocol (GEMM1 waits first; GEMM2 issues its first weight loads, then
// waits).
template <class Fmt, bool kGemm1, int V>
__global__ void __launch_bounds__(WgConfig<V>::kThreads, 1)
    WgmmaGemmKernel(const ExpertGemmParams p, int row_blocks) {
  extern __shared__ uint8_t wg_smem[];
  if constexpr (kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }
  const int item_index = static_cast<int>(blockIdx.x / row_blocks);
  const int row_block = static_cast<int>(blockIdx.x % row_blocks);
  if (item_index >= *p.num_items) return;  // whole CTA, before any barrier
  const ExpertItem item = p.items[item_index];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint32_t smem_base = (raw + 1023u) & ~1023u;
  if (item.count <= 32) {
    WgBody<Fmt, kGemm1, V, 32>(p, item, row_block, smem_base);
  } else if (item.count <= 64) {
    WgBody<Fmt, kGemm1, V, 64>(p, item, row_block, smem_base);
  } else if (item.count <= 96) {
    WgBody<Fmt, kGemm1, V, 96>(p, item, row_block, smem_base);
  } else {
    WgBody<Fmt, kGemm1, V, 128>(p, item, row_block, smem_base);
  }
}

using WgKernel = void (*)(ExpertGemmParams, int);
// [variant][nvfp4][gemm2]
constexpr int kWgVariants = 2;
constexpr WgKernel kWgKernels[kWgVariants][2][2] = {
    {{&WgmmaGemmKernel<Mxfp4, true, 0>, &WgmmaGemmKernel<Mxfp4, false, 0>},
     {&WgmmaGemmKernel<Nvfp4, true, 0>, &WgmmaGemmKernel<Nvfp4, false, 0>}},
    {{&WgmmaGemmKernel<Mxfp4, true, 1>, &WgmmaGemmKernel<Mxfp4, false, 1>},
     {&WgmmaGemmKernel<Nvfp4, true, 1>, &WgmmaGemmKernel<Nvfp4, false, 1>}}};
constexpr int kWgThreadsOf[kWgVariants] = {WgConfig<0>::kThreads, WgConfig<1>::kThreads};
constexpr int kWgRowsOf[kWgVariants] = {WgConfig<0>::kCtaRows, WgConfig<1>::kCtaRows};

// Devices whose kernels already allow kWgSmemBytes of dynamic shared memory (bit per device).
std::atomic<uint64_t> g_smem_configured{0};

cudaError_t ConfigureSharedMemory() {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (g_smem_configured.load(std::memory_order_acquire) & bit) != 0) {
    return cudaSuccess;
  }
  for (const auto& table : kWgKernels) {
    for (const auto& row : table) {
      for (WgKernel k : row) {
      if (cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kWgSmemBytes));
          e != cudaSuccess) {
          return e;
        }
      }
    }
  }
  g_smem_configured.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchWgmmaGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream) {
  if (cudaError_t e = ConfigureSharedMemory(); e != cudaSuccess) return e;
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int v = launch.variant == 1 ? 1 : 0;
  const int64_t row_blocks = (rows + kWgRowsOf[v] - 1) / kWgRowsOf[v];
  const int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const WgKernel kernel =
      kWgKernels[v][launch.format == Fp4Format::kNvfp4 ? 1 : 0][launch.gemm1 ? 0 : 1];
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kWgThreadsOf[v]);
  config.dynamicSmemBytes = kWgSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = launch.programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p, static_cast<int>(row_blocks));
}

}  // namespace moe::cuda::detail
