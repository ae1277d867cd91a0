// Expert GEMMs for many tokens per expert (token groups 4 and 8: items of up to 32 / 64 tokens;
// also a few-token configuration). A CTA of W warps covers 32 W weight rows (2 tiles per warp)
// for one item, so each activation chunk is fetched from L2 once per 32 W rows. The item's
// activations (B) are staged chunk by chunk in shared memory by cp.async, S stages deep and
// zero-filled past the item's tokens; every warp reads its B fragments with conflict-free
// LDS.128 (rows padded by 16 bytes) instead of waiting on L1/L2 per chunk, while its weights
// stream through a P-deep register ring exactly as in the few-token kernel (expert_gemm.cu).
// No K split: no cross-warp reduction. (W, S, P) per variant: TiledConfig.
// Stages: BTileLoader (cp.async) -> WeightStream -> DequantStep -> Mma -> epilogues
// (expert_gemm_stages.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda::detail {
namespace {

constexpr int kRowStride = kChunkK * 2 + 16;  // bytes per token row of a stage

// (token groups G, variant V) -> warps W, 16-row tiles per warp RW, B stages S, weight chunks
// in flight P, CTAs per SM the registers must allow. Measured on problem A (NOTES-cuda.md):
// G >= 4: V 0: W4 RW2 S4 P8|4, two CTAs per SM (best at 512-8192 tokens); 1: W8 RW2 S3 P6|4;
// 2: W8 RW1 S4 P6|4, two CTAs per SM (16 warps, fewer registers). G <= 2: W8 RW2 S4 P8.
template <int G, int V>
struct TiledConfig {
  static constexpr int kWarps = G <= 2 ? 8 : (V == 0 ? 4 : 8);
  static constexpr int kRw = G >= 4 && V == 2 ? 1 : 2;
  static constexpr int kStages = G >= 4 && V == 1 ? 3 : 4;
  static constexpr int kPrefetch =
      G <= 2 ? 8 : kRw == 1 ? (G == 4 ? 6 : 4) : (G == 4 ? (V == 1 ? 6 : 8) : 4);
  static constexpr int kMinBlocks = G >= 4 && V != 1 ? 2 : 1;
  static constexpr int kThreads = kWarps * kWarpLanes;
  static constexpr int kCtaRows = kWarps * kRw * kTileRows;
};

__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copies one chunk of the item's B rows (8 G tokens x 8 vectors of 16 bytes) into a stage; each
// thread owns fixed vectors, so the gathered row addresses are computed once.
template <int G, int kThreads>
struct BTileLoader {
  static constexpr int kVectors = kTileTokens * G * kActChunkVectors;
  static constexpr int kPerThread = (kVectors + kThreads - 1) / kThreads;
  const uint4* src[kPerThread];  // row + vector, or null for a token past the item
  uint32_t dst[kPerThread];      // byte offset inside a stage
  bool active[kPerThread];       // the vector exists (fewer vectors than threads for small G)
  const uint4* fallback;         // any valid address for zero-filling copies

  __device__ __forceinline__ void Init(const ExpertGemmParams& p, const ExpertItem& item) {
    const int64_t row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
    fallback = reinterpret_cast<const uint4*>(p.b_rows);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int index = static_cast<int>(threadIdx.x) + k * kThreads;
      const int token = index / kActChunkVectors, v = index % kActChunkVectors;
      dst[k] = static_cast<uint32_t>(token * kRowStride + v * 16);
      src[k] = nullptr;
      active[k] = index < kVectors;
      if (active[k] && token < item.count) {
        const int slot = item.slot_begin + token;
        const int row = p.b_row_of_slot != nullptr ? p.b_row_of_slot[slot] : slot;
        src[k] = fallback + row * row_vectors + v;
      }
    }
  }

  __device__ __forceinline__ void Load(uint32_t stage_addr, int chunk) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (!active[k]) continue;
      const bool valid = src[k] != nullptr;
      CpAsync16(stage_addr + dst[k], valid ? src[k] + chunk * kActChunkVectors : fallback, valid);
    }
  }
};

// One chunk: B fragments of the G groups from the stage (lane (g, t) reads token row 8q + g,
// vectors 2t and 2t + 1), 4 k-steps, both tiles.
template <class Fmt, int kRw, int G>
__device__ __forceinline__ void MultiplyChunkShared(const uint4 (&v)[kRw],
                                                    const typename Fmt::Scale (&s)[kRw],
                                                    const uint8_t* stage, int g, int t,
                                                    float (&acc)[kRw][G][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint4 b[G];
#pragma unroll
    for (int q = 0; q < G; ++q) {
      b[q] = *reinterpret_cast<const uint4*>(stage + (q * kTileTokens + g) * kRowStride +
                                             (2 * t + u) * 16);
    }
    MultiplyHalfChunk<Fmt, kRw, G>(v, s, u, b, acc);
  }
}

// blockIdx.x = row block + row_blocks * item, as in the few-token kernel; the same programmatic
// launch protocol (GEMM1 waits first; GEMM2 issues its first weight loads, then waits).
template <class Fmt, bool kGemm1, int G, int V>
__global__ void __launch_bounds__(TiledConfig<G, V>::kThreads, TiledConfig<G, V>::kMinBlocks)
    TiledGemmKernel(const ExpertGemmParams p, int row_blocks) {
  using Cfg = TiledConfig<G, V>;
  constexpr int kWarps = Cfg::kWarps, kStages = Cfg::kStages, kPrefetch = Cfg::kPrefetch;
  constexpr int kRw = Cfg::kRw;
  __shared__ __align__(16) uint8_t smem[kStages][kTileTokens * G][kRowStride];
  using Scale = typename Fmt::Scale;
  if constexpr (kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }
  const int item_index = static_cast<int>(blockIdx.x / row_blocks);
  const int row_block = static_cast<int>(blockIdx.x % row_blocks);
  if (item_index >= *p.num_items) return;  // whole CTA, before any barrier
  const ExpertItem item = p.items[item_index];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = (row_block * kWarps + warp) * kRw;

  WeightStream<Fmt, kRw> stream;
#pragma unroll
  for (int r = 0; r < kRw; ++r) stream.Aim(p, item.expert, r, tile0 + r, lane);
  const int n = p.chunks;
  uint4 v[kPrefetch][kRw];
  Scale s[kPrefetch][kRw];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) stream.LoadIf(i < n, i, v[i], s[i]);
  if constexpr (!kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }

  BTileLoader<G, Cfg::kThreads> loader;
  loader.Init(p, item);
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(&smem[0][0][0]));
  constexpr uint32_t kStageBytes = kTileTokens * G * kRowStride;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n) loader.Load(smem_base + st * kStageBytes, st);
    CpAsyncCommit();
  }

  float acc[kRw][G][4];
#pragma unroll
  for (int r = 0; r < kRw; ++r)
#pragma unroll
    for (int q = 0; q < G; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][q][e] = 0.f;

  int stage = 0;  // i % kStages
  for (int i0 = 0; i0 < n; i0 += kPrefetch) {
#pragma unroll
    for (int pp = 0; pp < kPrefetch; ++pp) {
      const int i = i0 + pp;
      if (i >= n) break;
      // Chunk i has landed, and every warp is done with chunk i - 1, whose stage is refilled.
      CpAsyncWait<kStages - 2>();
      __syncthreads();
      const int next = i + kStages - 1;
      const int next_stage = stage == 0 ? kStages - 1 : stage - 1;  // (i + S - 1) % S
      if (next < n) loader.Load(smem_base + next_stage * kStageBytes, next);
      CpAsyncCommit();
      MultiplyChunkShared<Fmt, kRw, G>(v[pp], s[pp], &smem[stage][0][0], g, t, acc);
      stream.LoadIf(i + kPrefetch < n, i + kPrefetch, v[pp], s[pp]);
      stage = stage == kStages - 1 ? 0 : stage + 1;
    }
  }
  if constexpr (kGemm1) {
    EpilogueAct<kRw, G>(p, item, tile0, lane, acc);
  } else {
    EpilogueY<kRw, G>(p, item, tile0, lane, acc);
  }
}

using TiledKernel = void (*)(ExpertGemmParams, int);

struct TiledEntry {
  TiledKernel kernels[2][2];  // [nvfp4][gemm2]
  int threads;
  int cta_rows;
};

template <int G, int V>
constexpr TiledEntry Tiled() {
  return TiledEntry{{{&TiledGemmKernel<Mxfp4, true, G, V>, &TiledGemmKernel<Mxfp4, false, G, V>},
                     {&TiledGemmKernel<Nvfp4, true, G, V>, &TiledGemmKernel<Nvfp4, false, G, V>}},
                    TiledConfig<G, V>::kThreads,
                    TiledConfig<G, V>::kCtaRows};
}

// [token groups 1, 2, 4, 8][variant]: few-token groups have one configuration (variant 3).
const TiledEntry kTiledTable[4][3] = {{Tiled<1, 0>(), Tiled<1, 0>(), Tiled<1, 0>()},
                                      {Tiled<2, 0>(), Tiled<2, 0>(), Tiled<2, 0>()},
                                      {Tiled<4, 0>(), Tiled<4, 1>(), Tiled<4, 2>()},
                                      {Tiled<8, 0>(), Tiled<8, 1>(), Tiled<8, 2>()}};

}  // namespace

cudaError_t LaunchTiledGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream) {
  const int groups = launch.token_groups;
  const int gi = groups == 1 ? 0 : groups == 2 ? 1 : groups == 4 ? 2 : groups == 8 ? 3 : -1;
  if (gi < 0) return cudaErrorInvalidValue;
  const TiledEntry& e = kTiledTable[gi][groups <= 2 ? 0 : launch.variant % 3];
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  const int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const TiledKernel kernel =
      e.kernels[launch.format == Fp4Format::kNvfp4 ? 1 : 0][launch.gemm1 ? 0 : 1];
  return LaunchMaybeProgrammatic(kernel, static_cast<unsigned>(blocks), e.threads,
                                 launch.programmatic, stream, p, static_cast<int>(row_blocks));
}

}  // namespace moe::cuda::detail
