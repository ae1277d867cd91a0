// Expert GEMMs for large token tiles (items of up to 144 tokens, GemmLaunch::token_groups 18) on
// Hopper warpgroup MMA (sm_90a wgmma.mma_async, A from registers, B from shared memory).
//
// A CTA covers 256 weight rows (16 tiles of repack.h) of one item: 4 warpgroups x 1 m64 block
// (variants 0, 2) or 2 x 2 (variant 1); warp w of a warpgroup owns the 16 rows of one tile per
// block. Per 64-element K chunk a warp dequantizes its tile's E2M1 codes + scales into the A
// fragments of 4 k-steps (the wgmma A register fragment of a warp's 16 rows is the m16n8k16 one,
// fp4_fragment.h), scales applied before the MMA exactly as in the mma.sync kernels. The codes
// come through a shared-memory ring filled by cp.async (variant 0) or a per-warp register ring
// (variants 1, 2). The item's token rows (B, bf16, K-major) are gathered chunk by chunk into
// shared memory by cp.async in the 128-byte-swizzled layout wgmma reads (row n at n * 128 bytes,
// 16-byte vector v stored at vector v ^ (n % 8); stages 1024-byte aligned). Activations on this
// path are in natural K order (the prologue and this GEMM1's epilogue write them so when the plan
// uses this kernel; ExpertPrologueParams::natural_order). The item's token count picks the wgmma
// width N in {32, 64, 96, 104, ..., 144} once per CTA; token columns past the count hold stale
// shared memory and only feed accumulator columns the epilogue never writes.
//
// Per chunk i (all threads): wait for its B stage, barrier, refill the stages of chunk i - 2
// (their wgmma groups finished: every warpgroup waited for them before the barrier), then per
// m64 block b and k-step: wait until the group that last read this step's A registers (the same
// step one chunk earlier) is done, dequantize the step, fence, one wgmma, commit. Each k-step is
// its own wgmma group, so the tensor cores work on up to a chunk of earlier steps while a warp
// dequantizes (one group per chunk serialized dequantization and MMA). Epilogues as the
// mma.sync kernels: GEMM1 activation + biases (natural-order act rows), GEMM2 y rows; the NVFP4
// global scales and the packing's exponent offset in ep_scale.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
// each: twice the warps to hide each warp's dequant latency), weights through a shared-memory
// ring kWgWStages deep (cp.async, so bytes in flight cost no registers); 1: 2 warpgroups x 2
// blocks (256 threads, one block's wgmma group in flight while the other is dequantized), weights
// through the register ring; 2: 4 x 1 with the register ring. All: 256 rows.
template <int V>
struct WgConfig {
  static constexpr int kGroups = V == 1 ? 2 : 4;   // warpgroups per CTA
  static constexpr int kBlocks = V == 1 ? 2 : 1;   // m64 blocks per warpgroup
  static constexpr bool kSmemWeights = V == 0;
  static constexpr int kThreads = kGroups * 128;
  static constexpr int kCtaRows = kGroups * kBlocks * 64;  // 256 weight rows
  static constexpr int kCtaTiles = kCtaRows / kTileRows;   // 16
};
constexpr int kWgMaxTokens = 144;  // 8 * kWgmmaTokenGroups
constexpr int kWgStages = 6;
constexpr int kWgRowBytes = kChunkK * 2;                    // one token's chunk: 128 bytes
constexpr uint32_t kWgStageBytes = kWgMaxTokens * kWgRowBytes;  // 16 KB
// Shared-memory weight ring (variant 0): B stages, weight stages, bytes per stage.
constexpr int kWgBStagesW = 5;
constexpr int kWgWStages = 12;
template <class Fmt>
constexpr uint32_t WgCodeStageBytes() {
  return 16 * kChunkBytes;  // 16 tiles x 512 bytes
}
template <class Fmt>
constexpr uint32_t WgScaleStageBytes() {
  return 16 * 8 * sizeof(typename Fmt::Scale);
}
template <class Fmt, int V>
constexpr size_t WgSmemBytes() {
  if constexpr (WgConfig<V>::kSmemWeights) {
    return kWgBStagesW * kWgStageBytes +
           kWgWStages * (WgCodeStageBytes<Fmt>() + WgScaleStageBytes<Fmt>()) + 1024;
  } else {
    return kWgStages * kWgStageBytes + 1024;  // + alignment slack
  }
}

template <class Fmt>
constexpr int WgPrefetch() {
  return std::is_same_v<Fmt, Mxfp4> ? 4 : 3;  // weight chunks in flight per warp
}

__device__ __forceinline__ void WgCpAsync16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void LdShared(uint32_t addr, uint4& r) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void LdShared(uint32_t addr, uint32_t& r) {
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(addr) : "memory");
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

  // The gather indices are loaded first, all in flight together (a load per vector behind its
  // own branch left each one's latency exposed: ncu source sampling, NOTES-cuda.md); vectors
  // past the item's tokens look up its first slot and copy nothing. Gather issues those loads,
  // Resolve uses them (a persistent CTA puts the epilogue's stage step between the two).
  __device__ __forceinline__ static void Gather(const ExpertGemmParams& p, const ExpertItem& item,
                                                int (&row)[kPerThread]) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int token = (static_cast<int>(threadIdx.x) + k * kThreads) / kActChunkVectors;
      row[k] = item.slot_begin + (token < item.count ? token : 0);
    }
    if (p.b_row_of_slot != nullptr) {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) row[k] = p.b_row_of_slot[row[k]];
    }
  }
  __device__ __forceinline__ void Init(const ExpertGemmParams& p, const ExpertItem& item) {
    int row[kPerThread];
    Gather(p, item, row);
    Resolve(p, item, row);
  }
  __device__ __forceinline__ void Resolve(const ExpertGemmParams& p, const ExpertItem& item,
                                          const int (&row)[kPerThread]) {
    const int64_t row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
    const uint4* base = reinterpret_cast<const uint4*>(p.b_rows);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int index = static_cast<int>(threadIdx.x) + k * kThreads;
      const int token = index / kActChunkVectors, v = index % kActChunkVectors;
      dst[k] = static_cast<uint32_t>(token * kWgRowBytes + ((v ^ (token & 7)) << 4));
      src[k] = index < kVectors && token < item.count ? base + row[k] * row_vectors + v : nullptr;
    }
  }

  __device__ __forceinline__ void Load(uint32_t stage_addr, int chunk) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (src[k] != nullptr) WgCpAsync16(stage_addr + dst[k], src[k] + chunk * kActChunkVectors);
    }
  }
};

// Copies one chunk of the CTA's 16 weight tiles (512 bytes of codes and 8 scale units each,
// contiguous in the repack.h layout) into a weight stage: codes [tile slot][lane] (16 bytes),
// scales [tile slot][g]. Tiles past the matrix read tile 0 (results unused).
template <class Fmt, int kThreads>
struct WgWLoader {
  using Scale = typename Fmt::Scale;
  static constexpr int kTiles = 16;
  static constexpr int kCodeVectors = kTiles * kWarpLanes;
  static constexpr int kScaleVectorsPerTile = 8 * static_cast<int>(sizeof(Scale)) / 16;
  static constexpr int kScaleVectors = kTiles * kScaleVectorsPerTile;
  static constexpr int kCodePer = (kCodeVectors + kThreads - 1) / kThreads;
  static constexpr int kScalePer = (kScaleVectors + kThreads - 1) / kThreads;
  static_assert(kCodePer * kThreads == kCodeVectors);
  const uint4* code_src[kCodePer];
  const uint4* scale_src[kScalePer];  // null: no vector for this thread

  __device__ __forceinline__ void Init(const ExpertGemmParams& p, const ExpertItem& item,
                                       int row_block) {
    const uint4* values = static_cast<const uint4*>(p.values) + item.expert * p.values_expert_stride;
    const Scale* scales = static_cast<const Scale*>(p.scales) + item.expert * p.scales_expert_stride;
#pragma unroll
    for (int k = 0; k < kCodePer; ++k) {
      const int idx = static_cast<int>(threadIdx.x) + k * kThreads;
      int tile = row_block * kTiles + idx / kWarpLanes;
      if (tile >= p.tiles) tile = 0;
      code_src[k] = values + static_cast<int64_t>(tile) * p.chunks * kWarpLanes + idx % kWarpLanes;
    }
#pragma unroll
    for (int k = 0; k < kScalePer; ++k) {
      const int idx = static_cast<int>(threadIdx.x) + k * kThreads;
      int tile = row_block * kTiles + idx / kScaleVectorsPerTile;
      if (tile >= p.tiles) tile = 0;
      scale_src[k] = idx < kScaleVectors
                         ? reinterpret_cast<const uint4*>(scales +
                                                          static_cast<int64_t>(tile) * p.chunks * 8) +
                               idx % kScaleVectorsPerTile
                         : nullptr;
    }
  }

  __device__ __forceinline__ void Load(uint32_t code_stage, uint32_t scale_stage, int chunk) const {
#pragma unroll
    for (int k = 0; k < kCodePer; ++k) {
      const int idx = static_cast<int>(threadIdx.x) + k * kThreads;
      WgCpAsync16(code_stage + idx * 16, code_src[k] + chunk * kWarpLanes);
    }
#pragma unroll
    for (int k = 0; k < kScalePer; ++k) {
      const int idx = static_cast<int>(threadIdx.x) + k * kThreads;
      if (scale_src[k] != nullptr) {
        WgCpAsync16(scale_stage + idx * 16, scale_src[k] + chunk * kScaleVectorsPerTile);
      }
    }
  }
};

// A thread's epilogue inputs: the expert's scales and the biases of its rows (GEMM1: gate and up
// bias of output column tile * 8 + g; GEMM2: rows tile * 16 + g and + 8), and for GEMM2's staged
// epilogue the y row of token threadIdx.x. Variant 0 loads them before it drains the wgmma
// groups, so their latency overlaps the drain instead of the first activation waiting on it.
struct WgEpInputs {
  float scale0, scale1, bias0, bias1;
  int32_t route;
};

template <bool kGemm1>
__device__ __forceinline__ WgEpInputs LoadEpInputs(const ExpertGemmParams& p,
                                                   const ExpertItem& item, int tile, int lane) {
  const int g = lane >> 2;
  const int64_t bias_base = static_cast<int64_t>(item.expert) * p.out_valid;
  WgEpInputs in{};
  if constexpr (kGemm1) {
    in.scale0 = p.ep_scale[item.expert * 3 + 0];
    in.scale1 = p.ep_scale[item.expert * 3 + 1];
    const int j = tile * 8 + g;
    if (j < p.out_valid) {
      in.bias0 = p.bias_a[bias_base + j];
      in.bias1 = p.bias_b[bias_base + j];
    }
  } else {
    in.scale0 = p.ep_scale[item.expert * 3 + 2];
    const int h = tile * kTileRows + g;
    if (h < p.out_valid) in.bias0 = p.bias_a[bias_base + h];
    if (h + 8 < p.out_valid) in.bias1 = p.bias_a[bias_base + h + 8];
    if (static_cast<int>(threadIdx.x) < item.count) {
      in.route = p.slot_route[item.slot_begin + static_cast<int>(threadIdx.x)];
    }
  }
  return in;
}

// The activated values of a warp's tile (gate row g, up row g + 8: output column tile * 8 + g) for
// its tokens below item.count, as bf16 bits: emit(col, value). Columns at or past out_valid are
// zeros (the act row's padding). kAllColumns: every column below N instead (the staged epilogue,
// whose tile has room for them and never reads those past the count): no per-value branch, so
// the values' dependent chains interleave (with the check, ptxas put a branch around each value
// and the warp ran them one after another: ncu source sampling, NOTES-cuda.md).
template <int N, bool kAllColumns, class Emit>
__device__ __forceinline__ void ForEachActValue(const ExpertGemmParams& p, const ExpertItem& item,
                                                int tile, int lane, const WgEpInputs& in,
                                                const float (&acc)[N / 2], Emit&& emit) {
  const int g = lane >> 2, t = lane & 3;
  const float scale_gate = in.scale0, scale_up = in.scale1;
  const float bias_gate = in.bias0, bias_up = in.bias1;
  const bool real = tile * 8 + g < p.out_valid;
  WithActKind(p.act.kind, [&](auto kind) {
#pragma unroll
    for (int q = 0; q < N / 8; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = q * kTileTokens + 2 * t + e;
        if (!kAllColumns && col >= item.count) continue;
        const float act =
            Activate<decltype(kind)::value>(p.act, acc[4 * q + e] * scale_gate + bias_gate,
                                            acc[4 * q + 2 + e] * scale_up + bias_up);
        emit(col, __bfloat16_as_ushort(__float2bfloat16_rn(real ? act : 0.f)));
      }
    }
  });
}

// GEMM1 epilogue (natural order act rows): acc[4q + e] = (row g (e < 2: gate) or g + 8 (up),
// token 8q + 2t + e % 2) of tile `tile`.
template <int N>
__device__ __forceinline__ void WgEpilogueAct(const ExpertGemmParams& p, const ExpertItem& item,
                                              int tile, int lane, const float (&acc)[N / 2]) {
  if (tile * 8 >= p.out_cols) return;
  const int g = lane >> 2;
  const int j = tile * 8 + g;
  const WgEpInputs in = LoadEpInputs<true>(p, item, tile, lane);
  ForEachActValue<N, false>(p, item, tile, lane, in, acc, [&](int col, uint16_t value) {
    p.act_out[static_cast<int64_t>(item.slot_begin + col) * p.out_cols + j] = value;
  });
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

// Accumulators of MB m64 blocks, zeroed.
template <int MB, int H>
__device__ __forceinline__ void WgZero(float (&acc)[MB][H]) {
#pragma unroll
  for (int b = 0; b < MB; ++b)
#pragma unroll
    for (int e = 0; e < H; ++e) acc[b][e] = 0.f;
}

// After the last chunk: wait for every wgmma group, then each block's epilogue (block b: tile
// tile_base + 4 b).
template <bool kGemm1, int MB, int N>
__device__ __forceinline__ void WgFinish(const ExpertGemmParams& p, const ExpertItem& item,
                                         int tile_base, int lane, const float (&acc)[MB][N / 2]) {
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

// Variant 0's epilogue, through shared memory (its B stages and weight ring are free once every
// wgmma group of the CTA is done): each warp writes its tile's values into a [token][row] tile,
// then whole token rows leave in coalesced 16-byte stores. Writing each value straight to global
// memory (2 or 4 bytes per store; GEMM2 loading each token's y row index next to its store) kept
// the SM's tensor cores idle for ~20% of the GEMM at 4096 tokens (NOTES-cuda.md). Row pitches
// are padded so that the tile writes hit distinct banks (act: 136 bf16, y: 260 floats or 264
// bf16).
constexpr int kWgActPitch = 128 + 8;  // bf16 per token of the act tile (128 columns)
constexpr int kWgYPitch = 256 + 4;    // floats per token of the F32 y tile (256 rows)
constexpr int kWgYPitchBf16 = 256 + 8;  // bf16 per token of the BF16 y tile (y_bf16)
constexpr uint32_t kWgStagedEpilogueBytes =
    kWgMaxTokens * kWgYPitch * sizeof(float) + kWgMaxTokens * sizeof(int32_t);

extern __shared__ __align__(16) uint8_t wg_smem[];

// ExpertGemmParams::l2_ahead_tiles: thread 0 copies the item of the tile to prefetch for here at
// tile start (kept in shared memory: one more register live across the main loop makes ptxas
// serialize the wgmma, C7512).
__shared__ __align__(16) ExpertItem wg_ahead_item;  // cp.async destinations: 16-byte aligned
__shared__ int32_t wg_ahead_tile;
__shared__ int32_t wg_tiles;       // row_blocks x the device's item count
__shared__ int32_t wg_row_blocks;

// The persistent schedule (ExpertGemmParams::wg_claims): this CTA's width class, its first item
// in wg_items and its tile count; the next tile (row block, or -1: none; its item arrives by
// cp.async) and the trace record of the current one. Written by thread 0.
__shared__ int32_t wg_class;
__shared__ int32_t wg_class_first;
__shared__ int32_t wg_class_tiles;
__shared__ int32_t wg_next_row_block;
__shared__ int32_t wg_next_record;
__shared__ __align__(16) ExpertItem wg_next_item;
__shared__ int32_t wg_record;

// ExpertGemmParams::wg_trace: thread 0 records word `k` of this CTA's tile (an SM id or a time):
// record blockIdx.x, or in a persistent CTA the tile's position in the class order.
__device__ __forceinline__ void WgTrace(const ExpertGemmParams& p, int k) {
  if (p.wg_trace == nullptr || threadIdx.x != 0) return;
  const int64_t record = p.wg_claims != nullptr ? wg_record : static_cast<int64_t>(blockIdx.x);
  unsigned long long v;
  if (k == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    v = sm;
  } else {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  }
  p.wg_trace[kWgTraceWords * record + k] = v;
}

// GEMM2's staged epilogue, second half: the y tile (element T, kPitch per token, 256 rows) goes
// to the item's y rows as whole 16-byte vectors (8 BF16 or 4 F32 rows per store) when the rows
// allow, else element by element.
template <class T, int kPitch, int kThreads>
__device__ __forceinline__ void StoreYTile(const ExpertGemmParams& p, const ExpertItem& item,
                                           const T* tile, const int32_t* routes, int row_block,
                                           int rows) {
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));
  constexpr int kVectorsPerToken = 256 / kPerVector;
  T* out = reinterpret_cast<T*>(p.y_out) + row_block * 256;
  if (rows % kPerVector == 0 && p.out_cols % kPerVector == 0 &&
      (reinterpret_cast<uintptr_t>(p.y_out) & 15) == 0) {
    const int vectors = rows / kPerVector;
    for (int idx = threadIdx.x; idx < item.count * kVectorsPerToken; idx += kThreads) {
      const int col = idx / kVectorsPerToken, v = idx % kVectorsPerToken;
      if (v >= vectors) continue;
      const uint4 value = *reinterpret_cast<const uint4*>(tile + col * kPitch + v * kPerVector);
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(routes[col]) * p.out_cols +
                                v * kPerVector) = value;
    }
  } else {
    for (int idx = threadIdx.x; idx < item.count * 256; idx += kThreads) {
      const int col = idx >> 8, r = idx & 255;
      if (r < rows) {
        out[static_cast<int64_t>(routes[col]) * p.out_cols + r] = tile[col * kPitch + r];
      }
    }
  }
}

// GEMM2's staged epilogue, first half: a warp's tile (rows slot * 16 + g and + 8) as
// acc * scale + bias into the [token][row] tile (F32 or BF16 elements, kPitch per token), every
// column below N (see ForEachActValue), the element type fixed outside the unrolled loop.
template <int N, int kPitch, class T>
__device__ __forceinline__ void StageYTile(int slot, int lane, const WgEpInputs& in,
                                           const float (&acc)[N / 2], T* tile) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = slot * kTileRows + g + 8 * half;
    const float bias = half == 0 ? in.bias0 : in.bias1;
#pragma unroll
    for (int q = 0; q < N / 8; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = q * kTileTokens + 2 * t + e;
        const float value = acc[4 * q + 2 * half + e] * in.scale0 + bias;
        if constexpr (sizeof(T) == 2) {
          tile[col * kPitch + r] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
        } else {
          tile[col * kPitch + r] = value;
        }
      }
    }
  }
}

// The staged epilogue. The caller has loaded the thread's inputs (LoadEpInputs), waited for every
// wgmma group and cp.async of the tile and passed a CTA barrier (the ring is free). Each warp
// writes its tile into a [token][row] tile in shared memory (pitches chosen so the writes spread
// over the banks); whole token rows then leave in coalesced 16-byte stores.
// GEMM1: `staged` runs once the act tile is in shared memory, before its stores.
template <bool kGemm1, int kThreads, int N, class Staged>
__device__ __forceinline__ void WgFinishStaged(const ExpertGemmParams& p, const ExpertItem& item,
                                               int row_block, int slot, uint32_t smem_base,
                                               int lane, const WgEpInputs& in,
                                               const float (&acc)[N / 2], Staged&& staged) {
  uint8_t* smem = wg_smem + (smem_base - static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem)));
  const int tile = row_block * 16 + slot;
  const int g = lane >> 2;
  if constexpr (kGemm1) {
    uint16_t* act = reinterpret_cast<uint16_t*>(smem);
    if (tile * 8 < p.out_cols) {
      ForEachActValue<N, true>(p, item, tile, lane, in, acc, [&](int col, uint16_t value) {
        act[col * kWgActPitch + slot * 8 + g] = value;
      });
    }
    __syncthreads();
    WgTrace(p, 7);
    staged();
    // out_cols is a multiple of 64, so rows and the CTA's 128 columns are 16-byte aligned.
    const int vectors = min(16, (p.out_cols - row_block * 128) / 8);
    uint16_t* out =
        p.act_out + static_cast<int64_t>(item.slot_begin) * p.out_cols + row_block * 128;
    for (int idx = threadIdx.x; idx < item.count * 16; idx += kThreads) {
      const int col = idx >> 4, v = idx & 15;
      if (v >= vectors) continue;
      const uint4 value = *reinterpret_cast<const uint4*>(act + col * kWgActPitch + v * 8);
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(col) * p.out_cols + v * 8) = value;
    }
    return;
  }
  const uint32_t tile_bytes = p.y_bf16 ? kWgMaxTokens * kWgYPitchBf16 * sizeof(uint16_t)
                                       : kWgMaxTokens * kWgYPitch * sizeof(float);
  int32_t* routes = reinterpret_cast<int32_t*>(smem + tile_bytes);
  static_assert(kThreads >= kWgMaxTokens);  // one token's route per thread (LoadEpInputs)
  if (static_cast<int>(threadIdx.x) < item.count) routes[threadIdx.x] = in.route;
  float* y = reinterpret_cast<float*>(smem);
  uint16_t* yb = reinterpret_cast<uint16_t*>(smem);
  if (p.y_bf16) {
    StageYTile<N, kWgYPitchBf16>(slot, lane, in, acc, yb);
  } else {
    StageYTile<N, kWgYPitch>(slot, lane, in, acc, y);
  }
  __syncthreads();
  WgTrace(p, 7);
  const int rows = min(256, p.out_valid - row_block * 256);
  if (p.y_bf16) {
    StoreYTile<uint16_t, kWgYPitchBf16, kThreads>(p, item, yb, routes, row_block, rows);
  } else {
    StoreYTile<float, kWgYPitch, kThreads>(p, item, y, routes, row_block, rows);
  }
}

// One k-step: one wgmma group per (block, k-step), so a warpgroup keeps up to a chunk's groups
// in flight while it dequantizes the next steps (one group per chunk serialized them; two steps
// per group measured 5% slower). Before a[] (this step's A registers, read by the group issued
// kGroups groups earlier: the same step of the previous chunk) is rewritten, at most kGroups - 1
// groups may still be pending.
template <class Fmt, int N, int kGroups>
__device__ __forceinline__ void WgStep(const uint4& v, const typename Fmt::Scale& sc, int step,
                                       const uint32_t (&shift_mul)[5], uint32_t (&a)[4],
                                       float (&acc)[N / 2], uint64_t stage_desc) {
  WgmmaWait<kGroups - 1>();
  DequantStepMul<Fmt>(v, sc, step, shift_mul, a);
  WgmmaFence();
  WgmmaRs<N>::Run(acc, a, stage_desc + step * (32 >> 4));
  WgmmaCommit();
}

// Everything after the item is known, for wgmma width N.
template <class Fmt, bool kGemm1, int V, int N>
__device__ __forceinline__ void WgBody(const ExpertGemmParams& p, const ExpertItem& item,
                                       int row_block, uint32_t smem_base) {
  using Cfg = WgConfig<V>;
  constexpr int P = WgPrefetch<Fmt>(), MB = Cfg::kBlocks, S = kWgStages;
  constexpr int kGroupsPerChunk = MB * kStepsPerChunk;
  using Scale = typename Fmt::Scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int tile_base = row_block * Cfg::kCtaTiles + wg * (MB * 4) + wq;  // + 4 b: block b's tile

  WeightStream<Fmt, MB> stream;
#pragma unroll
  for (int b = 0; b < MB; ++b) stream.Aim(p, item.expert, b, tile_base + 4 * b, lane);
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
  WgZero(acc);
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
#pragma unroll
        for (int step = 0; step < kStepsPerChunk; ++step) {
          WgStep<Fmt, N, kGroupsPerChunk>(v[pp][b], s[pp][b], step, p.shift_mul, a[b][step],
                                          acc[b], stage_desc);
        }
      }
      stream.LoadIf(i + P < n, i + P, v[pp], s[pp]);
      stage = stage == S - 1 ? 0 : stage + 1;
    }
  }
  WgFinish<kGemm1, MB, N>(p, item, tile_base, lane, acc);
}

// One claim from a persistent schedule's counter: a relaxed atomic add by the calling thread
// alone (atomicAdd from one lane made the compiler emit warp-aggregation code around it).
__device__ __forceinline__ int WgClaim(int32_t* counter) {
  int c;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;\n"
               : "=r"(c)
               : "l"(counter)
               : "memory");
  return c;
}
// Persistent CTAs (ExpertGemmParams::wg_claims), thread 0: claims the next tile of the CTA's
// class. The result is first used a chunk later (WgFetchNext), so the atomic's round trip
// overlaps a chunk of the main loop.
__device__ __forceinline__ int WgClaimNext(const ExpertGemmParams& p) {
  return WgClaim(p.wg_claims + wg_class);
}
// Thread 0: claim `c` becomes the next tile (its item copied by cp.async, in the caller's
// group), or there is none.
__device__ __forceinline__ void WgFetchNext(const ExpertGemmParams& p, int c) {
  if (c < wg_class_tiles) {
    const int rb = wg_row_blocks;
    const int index = wg_class_first + c / rb;
    wg_next_row_block = c % rb;
    wg_next_record = wg_class_first * rb + c;
    WgCpAsync16(static_cast<uint32_t>(__cvta_generic_to_shared(&wg_next_item)), p.wg_items + index);
  } else {
    wg_next_row_block = -1;
  }
}

// Variant 0: weights through the shared-memory ring. Per chunk i (one cp.async group: B of chunk
// i + SB - 2 and weights of chunk i + SW - 2, both into the stages of chunk i - 2): wait for
// B(i) (weights of i came in an earlier group), barrier, refill, then dequantize from shared
// memory and issue the wgmma group.
//
// kPersist (ExpertGemmParams::wg_claims): after its tile the CTA goes on with the next tile of
// its width class. Thread 0 claims it three chunks before the end and copies its item in the
// next chunk's group, so it is known when the wgmma groups drain; its first weight stages then
// load while the epilogue runs (the weight ring is free, and the staged tile stays in the B
// stages except for GEMM2's F32 y, which loads them after the epilogue instead).
template <class Fmt, bool kGemm1, int V, int N, bool kPersist>
__device__ __forceinline__ void WgBodySmemW(const ExpertGemmParams& p, ExpertItem item,
                                            int row_block, uint32_t smem_base) {
  using Cfg = WgConfig<V>;
  using Scale = typename Fmt::Scale;
  constexpr int MB = Cfg::kBlocks, SB = kWgBStagesW, SW = kWgWStages;
  constexpr int kGroupsPerChunk = MB * kStepsPerChunk;
  static_assert(Cfg::kCtaTiles == 16 && SW >= SB);
  constexpr uint32_t kCodeStage = WgCodeStageBytes<Fmt>();
  constexpr uint32_t kScaleStage = WgScaleStageBytes<Fmt>();
  // The staged epilogue's tile fits in the B stages (GEMM1's act tile, GEMM2's BF16 y tile and
  // its routes), so a persistent CTA may fill the weight ring during it.
  static_assert(kWgMaxTokens * kWgActPitch * 2 <= SB * kWgStageBytes &&
                kWgMaxTokens * (kWgYPitchBf16 * 2 + 4) <= SB * kWgStageBytes);
  const uint32_t code_base = smem_base + SB * kWgStageBytes;
  const uint32_t scale_base = code_base + SW * kCodeStage;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2;
  const int slot_base = wg * (MB * 4) + wq;  // + 4 b: block b's tile slot in the CTA
  const int n = p.chunks;
  // Persistent: the chunk whose refill step claims the next tile (its item follows a chunk
  // later, or after the loop when there is no later chunk).
  const int claim_at = n > 3 ? n - 3 : 0;
  bool weights_issued = false;  // this tile's first weight stages were issued in the last epilogue
  // GEMM1 of a persistent CTA: the act tile fills the first kActStages B stages, so the next
  // tile's B(0) and B(1) load into the last two during the epilogue's stores (its B ring then
  // starts at stage kActStages).
  constexpr int kActStages = (kWgMaxTokens * kWgActPitch * 2 + kWgStageBytes - 1) / kWgStageBytes;
  static_assert(kActStages + 2 == SB);
  bool b_issued = false;  // this tile's B(0) and B(1) were issued in the last epilogue
  WgBLoader<N, Cfg::kThreads> loader;

  // A tile's first weight stages (the ring's first SW - 2).
  const auto load_first_weights = [&](const WgWLoader<Fmt, Cfg::kThreads>& w) {
    for (int st = 0; st < SW - 2 && st < n; ++st) {
      w.Load(code_base + st * kCodeStage, scale_base + st * kScaleStage, st);
    }
  };

  for (;;) {
    const int tile_base = row_block * Cfg::kCtaTiles + slot_base;
    WgWLoader<Fmt, Cfg::kThreads> wl;
    wl.Init(p, item, row_block);
    if (!weights_issued) load_first_weights(wl);
    // L2 ahead: thread 0 (which wrote wg_tiles and wg_row_blocks) copies the item of the tile it
    // will prefetch for, in the cp.async group of B(0), so it is in shared memory by the
    // epilogue.
    if (!kPersist && p.l2_ahead_tiles > 0 && threadIdx.x == 0) {
      const int ahead = static_cast<int>(blockIdx.x) + p.l2_ahead_tiles;
      wg_ahead_tile = ahead;
      if (ahead < wg_tiles) {
        WgCpAsync16(static_cast<uint32_t>(__cvta_generic_to_shared(&wg_ahead_item)),
                    p.items + ahead / wg_row_blocks);
      }
    }
    if constexpr (!kGemm1) {  // a no-op after a persistent CTA's first tile
      WaitForPrerequisites();
      AllowDependents();
    }
    WgTrace(p, 2);
    const int bstage0 = b_issued ? kActStages : 0;  // stage of B(0)
    if (!b_issued) loader.Init(p, item);
#pragma unroll
    for (int st = 0; st < SB - 2; ++st) {
      if (b_issued && st < 2) continue;  // committed in the last epilogue
      const int stage = bstage0 + st < SB ? bstage0 + st : bstage0 + st - SB;
      if (st < n) loader.Load(smem_base + stage * kWgStageBytes, st);
      WgCpAsyncCommit();  // group st: B(st) (+ the weights above in group 0)
    }

    float acc[MB][N / 2];
    WgZero(acc);
    uint32_t a[MB][kStepsPerChunk][4];
    const uint64_t desc_base = SmemDescriptor(smem_base);

    if (p.wg_trace != nullptr) {  // the trace only: when the first chunk's stages have landed
      WgCpAsyncWait<SB - 3>();
      __syncthreads();
      WgTrace(p, 3);
    }
    int bstage = bstage0, wstage = 0;  // (bstage0 + i) % SB, i % SW
    int claim = 0;
    // Chunk i; `hook` runs in its refill step, before the commit (thread 0's claim steps).
    const auto chunk = [&](int i, auto&& hook) {
      WgCpAsyncWait<SB - 3>();
      FenceProxyAsync();
      __syncthreads();
      const int brefill = i + SB - 2;
      const int brefill_stage = bstage >= 2 ? bstage - 2 : bstage + SB - 2;
      if (brefill < n) loader.Load(smem_base + brefill_stage * kWgStageBytes, brefill);
      const int wrefill = i + SW - 2;
      const int wrefill_stage = wstage >= 2 ? wstage - 2 : wstage + SW - 2;
      if (wrefill < n) {
        wl.Load(code_base + wrefill_stage * kCodeStage, scale_base + wrefill_stage * kScaleStage,
                wrefill);
      }
      hook();
      WgCpAsyncCommit();
      const uint64_t stage_desc = desc_base + bstage * (kWgStageBytes >> 4);
      const uint32_t code_stage = code_base + wstage * kCodeStage;
      const uint32_t scale_stage = scale_base + wstage * kScaleStage;
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        const int slot = slot_base + 4 * b;
        uint4 v;
        Scale sc;
        LdShared(code_stage + (slot * kWarpLanes + lane) * 16, v);
        if constexpr (sizeof(Scale) == 16) {
          LdShared(scale_stage + (slot * 8 + g) * 16, sc);
        } else {
          LdShared(scale_stage + (slot * 8 + g) * 4, sc);
        }
#pragma unroll
        for (int step = 0; step < kStepsPerChunk; ++step) {
          WgStep<Fmt, N, kGroupsPerChunk>(v, sc, step, p.shift_mul, a[b][step], acc[b],
                                          stage_desc);
        }
      }
      bstage = bstage == SB - 1 ? 0 : bstage + 1;
      wstage = wstage == SW - 1 ? 0 : wstage + 1;
    };
    if constexpr (kPersist) {
      // The chunks before the claim without the claim's checks, then the last few with them.
      int i = 0;
#pragma unroll 1
      for (; i < claim_at; ++i) chunk(i, [] {});
#pragma unroll 1
      for (; i < n; ++i) {
        chunk(i, [&] {
          if (threadIdx.x == 0) {
            if (i == claim_at) claim = WgClaimNext(p);
            if (i == claim_at + 1) WgFetchNext(p, claim);
          }
        });
      }
      if (claim_at + 1 >= n) {
        if (threadIdx.x == 0) {
          if (n == 0) claim = WgClaimNext(p);
          WgFetchNext(p, claim);
        }
        WgCpAsyncCommit();
      }
    } else {
#pragma unroll 1
      for (int i = 0; i < n; ++i) chunk(i, [] {});
    }
    static_assert(MB == 1 && WgSmemBytes<Fmt, V>() >= kWgStagedEpilogueBytes + 1024);
    WgTrace(p, 4);
    const WgEpInputs ep_in = LoadEpInputs<kGemm1>(p, item, tile_base, lane);
    WgmmaWait<0>();
    WgCpAsyncWait<0>();
    __syncthreads();  // every warpgroup's wgmma has read its last stage; the ahead item has landed
    WgTrace(p, 6);
    ExpertItem next{};
    int next_row_block = -1;
    int next_rows[WgBLoader<N, Cfg::kThreads>::kPerThread];
    // The next tile's first weight stages, as one cp.async group.
    const auto IssueFirstWeights = [&](const ExpertItem& it, int rb) {
      WgWLoader<Fmt, Cfg::kThreads> next_wl;
      next_wl.Init(p, it, rb);
      load_first_weights(next_wl);
      WgCpAsyncCommit();
    };
    b_issued = false;
    if constexpr (kPersist) {
      next_row_block = wg_next_row_block;
      if (next_row_block >= 0) {
        next = wg_next_item;
        weights_issued = kGemm1 || p.y_bf16;
        if constexpr (kGemm1) {  // weights and B(0), B(1) after the stage step (below)
          b_issued = true;
          WgBLoader<N, Cfg::kThreads>::Gather(p, next, next_rows);
        } else if (weights_issued) {
          IssueFirstWeights(next, next_row_block);
        }
      }
    } else if (p.l2_ahead_tiles > 0 && warp == 0 && wg_ahead_tile < wg_tiles) {
      // L2 ahead: warp 0 asks L2 for the first weight stages of the tile likely to start on an
      // SM when this CTA ends (one resident CTA per SM, CTAs start in index order), so that its
      // first loads, which nothing overlaps, hit L2 instead of DRAM. 16 lanes take a weight
      // tile's codes, 16 its scales (both contiguous over the first chunks in the repack.h
      // layout).
      const ExpertItem ahead = wg_ahead_item;
      const int tile = (wg_ahead_tile % wg_row_blocks) * Cfg::kCtaTiles + (lane & 15);
      const int chunks = min(n, SW - 2);
      if (tile < p.tiles) {
        const int64_t first = static_cast<int64_t>(tile) * p.chunks;
        if (lane < 16) {
          BulkPrefetchL2(static_cast<const uint4*>(p.values) +
                             ahead.expert * p.values_expert_stride + first * kWarpLanes,
                         chunks * kChunkBytes);
        } else {
          BulkPrefetchL2(static_cast<const Scale*>(p.scales) +
                             ahead.expert * p.scales_expert_stride + first * 8,
                         chunks * 8 * static_cast<int>(sizeof(Scale)));
        }
      }
    }
    WgFinishStaged<kGemm1, Cfg::kThreads, N>(
        p, item, row_block, slot_base, smem_base, lane, ep_in, acc[0], [&] {
          if (!b_issued) return;
          // The next tile's first weight stages, then its B(0) and B(1) in the stages the act
          // tile leaves free: their loads overlap the stores (issued before the stage step, the
          // copies slowed it by ~0.5 us; trace, NOTES-cuda.md).
          IssueFirstWeights(next, next_row_block);
          loader.Resolve(p, next, next_rows);
#pragma unroll
          for (int st = 0; st < 2; ++st) {
            if (st < n) loader.Load(smem_base + (kActStages + st) * kWgStageBytes, st);
            WgCpAsyncCommit();
          }
        });
    WgTrace(p, 5);
    if constexpr (!kPersist) {
      return;
    } else {
      if (next_row_block < 0) return;
      // The next tile's record, SM and start in one place: separate thread-0 branches at the
      // end of the loop made ptxas keep the main loop's stage counters in vector registers
      // (17-21 more instructions per chunk).
      if (p.wg_trace != nullptr && threadIdx.x == 0) {
        wg_record = wg_next_record;
        WgTrace(p, 0);
        WgTrace(p, 1);
      }
      // Every thread is done with the staged tile before the next tile's B stages land on it.
      __syncthreads();
      item = next;
      row_block = next_row_block;
    }
  }
}

template <class Fmt, bool kGemm1, int V, bool kPersist, int N>
__device__ __forceinline__ void WgRun(const ExpertGemmParams& p, const ExpertItem& item,
                                      int row_block, uint32_t smem_base) {
  if constexpr (WgConfig<V>::kSmemWeights) {
    WgBodySmemW<Fmt, kGemm1, V, N, kPersist>(p, item, row_block, smem_base);
  } else {
    static_assert(!kPersist);
    WgBody<Fmt, kGemm1, V, N>(p, item, row_block, smem_base);
  }
}

// The dynamic shared memory, 1024-byte aligned (the 128-byte swizzle's pattern repeats there).
__device__ __forceinline__ uint32_t WgSmemBase() {
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  return (raw + 1023u) & ~1023u;
}

// The body for the item's width.
static_assert(WgmmaWidthClass(144) == 0 && WgmmaWidthClass(137) == 0 &&
              WgmmaWidthClass(136) == 1 && WgmmaWidthClass(97) == 5 && WgmmaWidthClass(96) == 6 &&
              WgmmaWidthClass(65) == 6 && WgmmaWidthClass(64) == 7 && WgmmaWidthClass(33) == 7 &&
              WgmmaWidthClass(32) == 8 && WgmmaWidthClass(1) == 8 && WgmmaClassWidth(0) == 144 &&
              WgmmaClassWidth(5) == 104 && WgmmaClassWidth(6) == 96 && WgmmaClassWidth(8) == 32,
              "WgDispatch's widths");
template <class Fmt, bool kGemm1, int V, bool kPersist>
__device__ __forceinline__ void WgDispatch(const ExpertGemmParams& p, const ExpertItem& item,
                                           int row_block, uint32_t smem_base) {
  if (item.count <= 32) {
    WgRun<Fmt, kGemm1, V, kPersist, 32>(p, item, row_block, smem_base);
  } else if (item.count <= 64) {
    WgRun<Fmt, kGemm1, V, kPersist, 64>(p, item, row_block, smem_base);
  } else if (item.count <= 96) {
    WgRun<Fmt, kGemm1, V, kPersist, 96>(p, item, row_block, smem_base);
  } else if (item.count <= 104) {
    WgRun<Fmt, kGemm1, V, kPersist, 104>(p, item, row_block, smem_base);
  } else if (item.count <= 112) {
    WgRun<Fmt, kGemm1, V, kPersist, 112>(p, item, row_block, smem_base);
  } else if (item.count <= 120) {
    WgRun<Fmt, kGemm1, V, kPersist, 120>(p, item, row_block, smem_base);
  } else if (item.count <= 128) {
    WgRun<Fmt, kGemm1, V, kPersist, 128>(p, item, row_block, smem_base);
  } else if (item.count <= 136) {
    WgRun<Fmt, kGemm1, V, kPersist, 136>(p, item, row_block, smem_base);
  } else {
    WgRun<Fmt, kGemm1, V, kPersist, 144>(p, item, row_block, smem_base);
  }
}

// A persistent CTA's first tile: from the widest class with tiles left. Warp 0 reads every
// class's start and claim count at once; lane 0 claims, trying the next open class when a claim
// comes back past its class's end. False: no tile left (the whole CTA leaves).
__device__ __forceinline__ bool WgClaimFirst(const ExpertGemmParams& p, int row_blocks,
                                             ExpertItem& item, int& row_block) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int first = 0, tiles = 0, claimed = 0;
    if (lane < kWgWidthClasses) {
      first = __ldcg(p.wg_starts + lane);
      tiles = (__ldcg(p.wg_starts + lane + 1) - first) * row_blocks;
      claimed = __ldcg(p.wg_claims + lane);
    }
    uint32_t open = __ballot_sync(0xffffffffu, lane < kWgWidthClasses && claimed < tiles);
    int found = -1, c = 0;
    while (open != 0) {
      const int cls = __ffs(static_cast<int>(open)) - 1;
      if (lane == 0) c = WgClaim(p.wg_claims + cls);
      c = __shfl_sync(0xffffffffu, c, 0);
      if (c < __shfl_sync(0xffffffffu, tiles, cls)) {
        found = cls;
        break;
      }
      open &= open - 1;
    }
    const int src = found < 0 ? 0 : found;
    const int class_first = __shfl_sync(0xffffffffu, first, src);
    const int class_tiles = __shfl_sync(0xffffffffu, tiles, src);
    if (lane == 0) {
      wg_row_blocks = row_blocks;
      wg_next_row_block = found < 0 ? -1 : c % row_blocks;
      if (found >= 0) {
        wg_class = found;
        wg_class_first = class_first;
        wg_class_tiles = class_tiles;
        wg_record = class_first * row_blocks + c;
        wg_next_item = p.wg_items[class_first + c / row_blocks];
      }
    }
  }
  __syncthreads();
  row_block = wg_next_row_block;
  if (row_block < 0) return false;
  item = wg_next_item;
  return true;
}

// blockIdx.x = row block + row_blocks * item, as in the other GEMM kernels, and the same
// programmatic launch protocol (GEMM1 waits first; GEMM2 issues its first weight loads, then
// waits). kPersist: tiles come from the width-class claim counters instead (WgClaimFirst).
template <class Fmt, bool kGemm1, int V, bool kPersist>
__global__ void __launch_bounds__(WgConfig<V>::kThreads, 1)
    WgmmaGemmKernel(const ExpertGemmParams p, int row_blocks) {
  ExpertItem item;
  int row_block;
  if constexpr (kPersist) {
    if constexpr (kGemm1) {
      WaitForPrerequisites();
      AllowDependents();
    }
    if (!WgClaimFirst(p, row_blocks, item, row_block)) return;  // whole CTA
  } else {
    if (!BlockItem<kGemm1>(p, row_blocks, item, row_block)) return;  // whole CTA
    if (threadIdx.x == 0) {  // read by thread 0 only until the first barrier
      wg_tiles = row_blocks * *p.num_items;
      wg_row_blocks = row_blocks;
    }
  }
  WgTrace(p, 0);
  WgTrace(p, 1);
  WgDispatch<Fmt, kGemm1, V, kPersist>(p, item, row_block, WgSmemBase());
}

using WgKernel = void (*)(ExpertGemmParams, int);
// [variant][nvfp4][gemm2], and the persistent form of variant 0
constexpr int kWgVariants = 3;
struct WgLaunchEntry {
  WgKernel kernel;
  int smem;
  int threads;
  int rows;
};
template <int V, bool kPersist = false>
WgLaunchEntry WgEntryOf(int nv, int gemm2) {
  const WgKernel kernels[2][2] = {
      {&WgmmaGemmKernel<Mxfp4, true, V, kPersist>, &WgmmaGemmKernel<Mxfp4, false, V, kPersist>},
      {&WgmmaGemmKernel<Nvfp4, true, V, kPersist>, &WgmmaGemmKernel<Nvfp4, false, V, kPersist>}};
  const int smem[2] = {static_cast<int>(WgSmemBytes<Mxfp4, V>()),
                       static_cast<int>(WgSmemBytes<Nvfp4, V>())};
  return WgLaunchEntry{kernels[nv][gemm2], smem[nv], WgConfig<V>::kThreads,
                       WgConfig<V>::kCtaRows};
}
// v: the variant; persist (variant 0 only): the persistent form.
WgLaunchEntry WgLookup(int v, int nv, int gemm2, bool persist = false) {
  return v == 1   ? WgEntryOf<1>(nv, gemm2)
         : v == 2 ? WgEntryOf<2>(nv, gemm2)
         : persist ? WgEntryOf<0, true>(nv, gemm2)
                   : WgEntryOf<0>(nv, gemm2);
}
// A persistent grid of one wave per width class is enough only while at most one CTA is resident
// per SM (a class's CTAs all stay until it runs out): the ring's shared memory guarantees that.
static_assert(2 * WgSmemBytes<Mxfp4, 0>() > 228 * 1024 && 2 * WgSmemBytes<Nvfp4, 0>() > 228 * 1024);

// The current device's SM count, looked up once per device.
cudaError_t MultiprocessorCount(int* sms) {
  static std::atomic<int> counts[64] = {};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= 64) {
    return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  }
  *sms = counts[device].load(std::memory_order_relaxed);
  if (*sms > 0) return cudaSuccess;
  if (cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess) {
    return e;
  }
  counts[device].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

// Devices whose kernels already allow their (WgSmemBytes) dynamic shared memory (bit per device).
std::atomic<uint64_t> g_smem_configured{0};

cudaError_t ConfigureSharedMemory() {
  return OncePerDevice(g_smem_configured, [] {
    for (int v = 0; v <= kWgVariants; ++v) {  // kWgVariants: variant 0's persistent form
      for (int nv = 0; nv < 2; ++nv) {
        for (int gemm2 = 0; gemm2 < 2; ++gemm2) {
          const WgLaunchEntry e = v == kWgVariants ? WgLookup(0, nv, gemm2, true)
                                                   : WgLookup(v, nv, gemm2);
          if (cudaError_t err = cudaFuncSetAttribute(
                  e.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, e.smem);
              err != cudaSuccess) {
            return err;
          }
        }
      }
    }
    return cudaSuccess;
  });
}

}  // namespace

cudaError_t LaunchWgmmaGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream) {
  if (cudaError_t e = ConfigureSharedMemory(); e != cudaSuccess) return e;
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  if (p.y_bf16 && (launch.gemm1 || !WgmmaStagesEpilogue(launch.variant))) {
    return cudaErrorInvalidValue;
  }
  const bool persist = p.wg_claims != nullptr;
  if (persist && (!WgmmaStagesEpilogue(launch.variant) || p.wg_starts == nullptr ||
                  p.wg_items == nullptr || p.l2_ahead_tiles != 0)) {
    return cudaErrorInvalidValue;
  }
  const WgLaunchEntry e = WgLookup(launch.variant, launch.format == Fp4Format::kNvfp4 ? 1 : 0,
                                   launch.gemm1 ? 0 : 1, persist);
  const int64_t row_blocks = (rows + e.rows - 1) / e.rows;
  int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (persist) {
    int sms = 0;
    if (cudaError_t err = MultiprocessorCount(&sms); err != cudaSuccess) return err;
    blocks = std::min<int64_t>(blocks, static_cast<int64_t>(sms) * kWgWidthClasses);
  }
  ExpertGemmParams q = p;
  if (q.l2_ahead_tiles < 0) {  // one resident CTA per SM (its shared memory and registers)
    if (cudaError_t err = MultiprocessorCount(&q.l2_ahead_tiles); err != cudaSuccess) return err;
  }
  const WgKernel kernel = e.kernel;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(e.threads);
  config.dynamicSmemBytes = e.smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = launch.programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, q, static_cast<int>(row_blocks));
}

}  // namespace moe::cuda::detail
