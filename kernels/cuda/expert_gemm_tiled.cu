// Expert GEMMs for many tokens per expert (token groups 4 and 8: items of up to 32 / 64 tokens;
// also a few-token configuration). A CTA of W warps covers 32 W weight rows (2 tiles per warp)
// for one item, so each activation chunk is fetched from L2 once per 32 W rows. The item's
// activations (B) are staged chunk by chunk in shared memory by cp.async, S stages deep and
// zero-filled past the item's tokens; every warp reads its B fragments with conflict-free
// LDS.128 (rows padded by 16 bytes) instead of waiting on L1/L2 per chunk (BStages). Weights:
// variants 0-2 stream them through a P-deep register ring exactly as in the few-token kernel
// (expert_gemm.cu; TiledConfig: W, S, P); variants 4-8 (TiledBulkConfig; 8 is the default)
// through a per-warp shared-memory ring filled by bulk copies, which frees the ring's registers
// for 4 CTAs per SM. No K split: no cross-warp reduction.
// Stages: BStages (cp.async) -> WeightStream or the bulk ring -> DequantStep -> Mma -> epilogues
// (expert_gemm_stages.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
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

// Copies `src_bytes` (16, or 0: zero-fill) of gmem into the 16 bytes at smem_addr.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem,
                                          uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
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
// thread owns fixed vectors, so the gathered row addresses are computed once. A token past the
// item copies 0 bytes (zero-fill) from row 0's vector, which exists in every chunk: the copy
// needs no branch.
template <int G, int kThreads>
struct BTileLoader {
  static constexpr int kVectors = kTileTokens * G * kActChunkVectors;
  static constexpr int kPerThread = (kVectors + kThreads - 1) / kThreads;
  const uint4* src[kPerThread];  // row + vector (row 0 for a token past the item)
  uint32_t dst[kPerThread];      // byte offset inside a stage
  uint32_t bytes[kPerThread];    // 16, or 0 for a token past the item
  bool active[kPerThread];       // the vector exists (fewer vectors than threads for small G)

  __device__ __forceinline__ void Init(const ExpertGemmParams& p, const ExpertItem& item) {
    const int64_t row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
    const uint4* b = reinterpret_cast<const uint4*>(p.b_rows);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int index = static_cast<int>(threadIdx.x) + k * kThreads;
      const int token = index / kActChunkVectors, v = index % kActChunkVectors;
      dst[k] = static_cast<uint32_t>(token * kRowStride + v * 16);
      src[k] = b + v;
      bytes[k] = 0;
      active[k] = index < kVectors;
      if (active[k] && token < item.count) {
        const int slot = item.slot_begin + token;
        const int row = p.b_row_of_slot != nullptr ? p.b_row_of_slot[slot] : slot;
        src[k] = b + row * row_vectors + v;
        bytes[k] = 16;
      }
    }
  }

  __device__ __forceinline__ void Load(uint32_t stage_addr, int chunk) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (!active[k]) continue;
      CpAsync16(stage_addr + dst[k], src[k] + chunk * kActChunkVectors, bytes[k]);
    }
  }
};

// One chunk: B fragments of the G groups from the stage (lane (g, t) reads token row 8q + g,
// vectors 2t and 2t + 1), 4 k-steps, both tiles; only the first `used` token groups (1..G,
// warp-uniform: reads and MMAs of the others predicated off).
template <class Fmt, int kRw, int G>
__device__ __forceinline__ void MultiplyChunkShared(const uint4 (&v)[kRw],
                                                    const typename Fmt::Scale (&s)[kRw],
                                                    const uint8_t* stage, int g, int t,
                                                    float (&acc)[kRw][G][4], int used = G) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint4 b[G];  // read only where loaded (MultiplyHalfChunk guards with the same predicate)
#pragma unroll
    for (int q = 0; q < G; ++q) {
      if (q == 0 || q < used) {
        b[q] = *reinterpret_cast<const uint4*>(stage + (q * kTileTokens + g) * kRowStride +
                                               (2 * t + u) * 16);
      }
    }
    MultiplyHalfChunk<Fmt, kRw, G>(v, s, u, b, acc, used);
  }
}

// The item's B chunks through kStages shared-memory stages filled by cp.async, kStages - 1
// chunks ahead, one CTA barrier per chunk.
template <int G, int kThreads, int kStages>
struct BStages {
  static constexpr uint32_t kStageBytes = kTileTokens * G * kRowStride;
  BTileLoader<G, kThreads> loader;
  uint32_t base_at;  // shared-space address of stage 0
  int n;             // chunks
  int stage = 0;     // chunk i's stage: i % kStages

  // Starts the copies of chunks 0 .. kStages - 2 into the stages at `smem`.
  __device__ __forceinline__ void Start(const ExpertGemmParams& p, const ExpertItem& item,
                                        const uint8_t* smem, int chunks) {
    loader.Init(p, item);
    base_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    n = chunks;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n) loader.Load(base_at + st * kStageBytes, st);
      CpAsyncCommit();
    }
  }

  // Chunk i (called for i = 0, 1, ... by every thread): waits until it has landed and every warp
  // is done with chunk i - 1, refills that stage with chunk i + kStages - 1; returns chunk i's
  // stage index.
  __device__ __forceinline__ int Next(int i) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    const int next = i + kStages - 1;
    const int next_stage = stage == 0 ? kStages - 1 : stage - 1;  // (i + S - 1) % S
    if (next < n) loader.Load(base_at + next_stage * kStageBytes, next);
    CpAsyncCommit();
    const int at = stage;
    stage = stage == kStages - 1 ? 0 : stage + 1;
    return at;
  }
};

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
  ExpertItem item;
  int row_block;
  if (!BlockItem<kGemm1>(p, row_blocks, item, row_block)) return;  // whole CTA
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
    WaitForInputs(Gemm2InputWait(p, static_cast<int>(blockIdx.x) / row_blocks));
  }

  BStages<G, Cfg::kThreads, kStages> b_stages;
  b_stages.Start(p, item, &smem[0][0][0], n);
  float acc[kRw][G][4];
  ZeroAccumulators<kRw, G>(acc);

  for (int i0 = 0; i0 < n; i0 += kPrefetch) {
#pragma unroll
    for (int pp = 0; pp < kPrefetch; ++pp) {
      const int i = i0 + pp;
      if (i >= n) break;
      MultiplyChunkShared<Fmt, kRw, G>(v[pp], s[pp], &smem[b_stages.Next(i)][0][0], g, t, acc);
      stream.LoadIf(i + kPrefetch < n, i + kPrefetch, v[pp], s[pp]);
    }
  }
  if constexpr (kGemm1) {
    EpilogueAct<kRw, G>(p, item, tile0, lane, acc);
    SignalItemReady(p, static_cast<int>(blockIdx.x) / row_blocks);  // every warp of the CTA
  } else {
    EpilogueY<kRw, G>(p, item, tile0, lane, acc);
  }
}

// Variants 4-8 (G = 4 and 8): the weights of the warp's RW tiles come through a per-warp
// shared-memory ring filled by bulk copies (cp.async.bulk, completed on one mbarrier per ring
// slot, issued by lane 0) instead of the register ring: the 8-chunk register ring (64 registers)
// of variant 0 is what held it to 2 CTAs per SM (221 registers); without it 4 CTAs of 4 warps fit
// (16 warps per SM), with (D - 1) x C chunks per tile in flight that cost no registers. B stages
// as in the other variants (BStages). Ring slot layout: per tile r, C chunks of codes (512 bytes
// each) then their C x 8 scale words; a tile's chunks and its scale words are contiguous in the
// packing, so a group is 2 RW bulk copies.
// Variant V: 4 = 4 warps, groups of 2 chunks; 5 = 8 warps, groups of 2, empty token groups
// skipped (as 8); 6 = 4 warps, groups of 4 in 2 slots (half the copy instructions per chunk, one
// group in flight while one is read); 7 = as 6 with 2 B stages, so that 5 CTAs fit an SM (MXFP4
// G = 4: 20 warps); 8 = as 6, with the MMAs and B reads of token groups past the item's tokens
// predicated off (an item of 9-16 tokens in a 32-token tile does half the tensor work).
template <class Fmt, int V>
struct TiledBulkConfig {
  static constexpr int kWarps = V == 5 ? 8 : 4;
  // CTAs per SM the registers must allow: G = 4: 4 of 4 warps or 2 of 8 (<= 128 registers; 95
  // to 110 used), 5 for variant 7 MXFP4 (<= 96; NVFP4's larger ring leaves shared memory for 4).
  // G = 8 (64 accumulators): 3 of 4 warps (its B stages leave shared memory for 3).
  static constexpr int MinBlocks(int groups) {
    return groups >= 8 ? 3 : kWarps == 8 ? 2 : V == 7 && sizeof(typename Fmt::Scale) == 4 ? 5 : 4;
  }
  static constexpr int kRw = 2;
  static constexpr int kStages = V == 7 ? 2 : 3;
  static constexpr int kGroup = V >= 6 ? 4 : 2;  // chunks per ring slot
  static constexpr bool kSkipEmptyGroups = V == 8 || V == 5;
  static constexpr int kScaleBytes = 8 * static_cast<int>(sizeof(typename Fmt::Scale));
  // Groups of 2: 4 slots for MXFP4, 3 for NVFP4 (its 128-byte scale groups), so that 4 CTAs of
  // 4 warps (or 2 of 8) fit the 227 KB of an SM; groups of 4: 2 slots.
  static constexpr int kSlots = V >= 6 ? 2 : sizeof(typename Fmt::Scale) == 4 ? 4 : 3;
  static constexpr int kTileBytes = kGroup * (kChunkBytes + kScaleBytes);  // one tile's group
  static constexpr int kSlotBytes = kRw * kTileBytes;
  static constexpr int kWarpBytes = kSlots * kSlotBytes;
  static constexpr int kThreads = kWarps * kWarpLanes;
  static constexpr int kCtaRows = kWarps * kRw * kTileRows;
  // Dynamic shared memory: the barriers, the rings, then the B stages of G token groups.
  static constexpr int kBarBytes = 256;
  static constexpr int kRingOffset = kBarBytes;
  static constexpr int kStageOffset = kRingOffset + kWarps * kWarpBytes;
  static_assert(kWarps * kSlots * 8 <= kBarBytes);
  static constexpr int SmemBytes(int groups) {
    return kStageOffset + kStages * kTileTokens * groups * kRowStride;
  }
};

template <class Fmt, bool kGemm1, int G, int V>
__global__ void __launch_bounds__(TiledBulkConfig<Fmt, V>::kThreads,
                                  TiledBulkConfig<Fmt, V>::MinBlocks(G))
    TiledBulkGemmKernel(const ExpertGemmParams p, int row_blocks) {
  using Cfg = TiledBulkConfig<Fmt, V>;
  using Scale = typename Fmt::Scale;
  constexpr int kWarps = Cfg::kWarps, kStages = Cfg::kStages, kRw = Cfg::kRw;
  constexpr int C = Cfg::kGroup, D = Cfg::kSlots;
  extern __shared__ __align__(128) uint8_t tiled_smem[];
  auto& smem = *reinterpret_cast<uint8_t(*)[kStages][kTileTokens * G][kRowStride]>(
      tiled_smem + Cfg::kStageOffset);
  uint8_t* const ring_all = tiled_smem + Cfg::kRingOffset;
  uint64_t* const bars_all = reinterpret_cast<uint64_t*>(tiled_smem);
  ExpertItem item;
  int row_block;
  if (!BlockItem<kGemm1>(p, row_blocks, item, row_block)) return;  // whole CTA
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // Warp-uniform (broadcast from lane 0), so the copy operands stay in uniform registers.
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);
  const int expert = __shfl_sync(0xffffffffu, item.expert, 0);
  const int tile0 = (row_block * kWarps + warp) * kRw;
  const int n = p.chunks;
  const int groups = (n + C - 1) / C;
  // Token groups of 8 that hold tokens of this item (variant 8 multiplies only those).
  const int groups_used = __shfl_sync(0xffffffffu, (item.count + kTileTokens - 1) / kTileTokens, 0);

  uint8_t* ring = ring_all + warp * Cfg::kWarpBytes;
  const uint32_t ring_at = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bars_at = static_cast<uint32_t>(__cvta_generic_to_shared(bars_all + warp * D));
  const uint4* src_v[kRw];
  const Scale* src_s[kRw];
#pragma unroll
  for (int r = 0; r < kRw; ++r) {
    const int tile = tile0 + r;
    const int64_t base = static_cast<int64_t>(tile < p.tiles ? tile : 0) * n;
    src_v[r] = static_cast<const uint4*>(p.values) + expert * p.values_expert_stride +
               base * kWarpLanes;
    src_s[r] = static_cast<const Scale*>(p.scales) + expert * p.scales_expert_stride + base * 8;
  }
  const uint64_t policy = L2Policy(p.weights_evict_first);
  // Lane 0: group j (chunks jC .. jC + cnt - 1 of every tile) into slot `slot`.
  auto issue = [&](int j, int slot) {
    const int cnt = min(C, n - j * C);
    const uint32_t bar = bars_at + 8 * slot;
    MbarrierArriveExpectTx(bar, kRw * cnt * (kChunkBytes + Cfg::kScaleBytes));
#pragma unroll
    for (int r = 0; r < kRw; ++r) {
      const uint32_t dst = ring_at + slot * Cfg::kSlotBytes + r * Cfg::kTileBytes;
      BulkCopyToShared(dst, src_v[r] + static_cast<int64_t>(j) * C * kWarpLanes,
                       cnt * kChunkBytes, bar, policy);
      BulkCopyToShared(dst + C * kChunkBytes, src_s[r] + static_cast<int64_t>(j) * C * 8,
                       cnt * Cfg::kScaleBytes, bar, policy);
    }
  };
  if (lane == 0) {
#pragma unroll
    for (int d = 0; d < D; ++d) MbarrierInit(bars_at + 8 * d, 1);
    FenceMbarrierInit();
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (d < groups) issue(d, d);
    }
  }
  __syncwarp();
  if constexpr (!kGemm1) {
    WaitForInputs(Gemm2InputWait(p, static_cast<int>(blockIdx.x) / row_blocks));
  }

  BStages<G, Cfg::kThreads, kStages> b_stages;
  b_stages.Start(p, item, &smem[0][0][0], n);
  float acc[kRw][G][4];
  ZeroAccumulators<kRw, G>(acc);

  // This lane's code vector and row pair's scale word in slot 0, tile 0, chunk 0.
  const uint4* my_v = reinterpret_cast<const uint4*>(ring) + lane;
  const Scale* my_s = reinterpret_cast<const Scale*>(ring + C * kChunkBytes) + g;
  for (int j0 = 0; j0 < groups; j0 += D) {
    const uint32_t parity = static_cast<uint32_t>(j0 / D) & 1u;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int j = j0 + d;
      if (j >= groups) break;
      if (j > 0) {
        __syncwarp();  // every lane is done with the slot of group j - 1
        const int refill = j - 1 + D;
        if (lane == 0 && refill < groups) issue(refill, (d + D - 1) % D);
      }
      MbarrierWait(bars_at + 8 * d, parity);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int i = j * C + c;
        if (i >= n) break;
        const int stage = b_stages.Next(i);
        uint4 v[kRw];
        Scale s[kRw];
#pragma unroll
        for (int r = 0; r < kRw; ++r) {
          const int at = d * Cfg::kSlotBytes + r * Cfg::kTileBytes;
          v[r] = my_v[(at + c * kChunkBytes) / 16];
          s[r] = my_s[(at + c * Cfg::kScaleBytes) / static_cast<int>(sizeof(Scale))];
        }
        MultiplyChunkShared<Fmt, kRw, G>(v, s, &smem[stage][0][0], g, t, acc,
                                         Cfg::kSkipEmptyGroups ? groups_used : G);
      }
    }
  }
  if constexpr (kGemm1) {
    EpilogueAct<kRw, G>(p, item, tile0, lane, acc);
    SignalItemReady(p, static_cast<int>(blockIdx.x) / row_blocks);  // every warp of the CTA
  } else {
    EpilogueY<kRw, G>(p, item, tile0, lane, acc);
  }
}

using TiledKernel = void (*)(ExpertGemmParams, int);

struct TiledEntry {
  TiledKernel kernels[2][2];  // [nvfp4][gemm2]
  int threads;
  int cta_rows;
  int smem[2] = {0, 0};  // dynamic shared memory bytes [nvfp4]
};

template <int G, int V>
constexpr TiledEntry Tiled() {
  return TiledEntry{{{&TiledGemmKernel<Mxfp4, true, G, V>, &TiledGemmKernel<Mxfp4, false, G, V>},
                     {&TiledGemmKernel<Nvfp4, true, G, V>, &TiledGemmKernel<Nvfp4, false, G, V>}},
                    TiledConfig<G, V>::kThreads,
                    TiledConfig<G, V>::kCtaRows};
}

template <int G, int V>
constexpr TiledEntry TiledBulk() {
  static_assert(TiledBulkConfig<Mxfp4, V>::kCtaRows == TiledBulkConfig<Nvfp4, V>::kCtaRows);
  return TiledEntry{
      {{&TiledBulkGemmKernel<Mxfp4, true, G, V>, &TiledBulkGemmKernel<Mxfp4, false, G, V>},
       {&TiledBulkGemmKernel<Nvfp4, true, G, V>, &TiledBulkGemmKernel<Nvfp4, false, G, V>}},
      TiledBulkConfig<Mxfp4, V>::kThreads,
      TiledBulkConfig<Mxfp4, V>::kCtaRows,
      {TiledBulkConfig<Mxfp4, V>::SmemBytes(G), TiledBulkConfig<Nvfp4, V>::SmemBytes(G)}};
}

// [token groups 1, 2, 4, 8][variant 0, 1, 2, 4, 5, 6, 7]: few-token groups have one
// configuration (variant 3); the bulk ring (TiledBulkConfig): variant 4 = 4 warps per CTA (G = 4:
// 4 CTAs per SM; G = 8: 3), 5 = 8 warps x 2 CTAs per SM (G = 8: as 4, 8 warps would spill), 6 =
// as 4 with groups of 4 chunks, 7 = as 6 with 2 B stages, 5 CTAs per SM (G = 8: as 6), 8 = as 6
// without the MMAs of empty token groups.
constexpr int kTiledVariants = 8;
const TiledEntry kTiledTable[4][kTiledVariants] = {
    {Tiled<1, 0>(), Tiled<1, 0>(), Tiled<1, 0>(), Tiled<1, 0>(), Tiled<1, 0>(), Tiled<1, 0>(),
     Tiled<1, 0>(), Tiled<1, 0>()},
    {Tiled<2, 0>(), Tiled<2, 0>(), Tiled<2, 0>(), Tiled<2, 0>(), Tiled<2, 0>(), Tiled<2, 0>(),
     Tiled<2, 0>(), Tiled<2, 0>()},
    {Tiled<4, 0>(), Tiled<4, 1>(), Tiled<4, 2>(), TiledBulk<4, 4>(), TiledBulk<4, 5>(),
     TiledBulk<4, 6>(), TiledBulk<4, 7>(), TiledBulk<4, 8>()},
    {Tiled<8, 0>(), Tiled<8, 1>(), Tiled<8, 2>(), TiledBulk<8, 4>(), TiledBulk<8, 4>(),
     TiledBulk<8, 6>(), TiledBulk<8, 6>(), TiledBulk<8, 8>()}};

// Devices whose bulk-ring kernels already allow their dynamic shared memory and the largest
// carveout (bit per device).
std::atomic<uint64_t> g_bulk_configured{0};

cudaError_t ConfigureBulkKernels() {
  return OncePerDevice(g_bulk_configured, [] {
    for (int gi = 2; gi < 4; ++gi) {
      for (int vi = 3; vi < kTiledVariants; ++vi) {
        const TiledEntry& e = kTiledTable[gi][vi];
        for (int nv = 0; nv < 2; ++nv) {
          for (int gemm2 = 0; gemm2 < 2; ++gemm2) {
            TiledKernel k = e.kernels[nv][gemm2];
            cudaError_t err =
                cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, e.smem[nv]);
            if (err == cudaSuccess) {
              err = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared);
            }
            if (err != cudaSuccess) return err;
          }
        }
      }
    }
    return cudaSuccess;
  });
}

}  // namespace

int64_t TiledItemReadyCount(const GemmLaunch& launch, int64_t rows) {
  const int groups = launch.token_groups;
  const int gi = groups == 1 ? 0 : groups == 2 ? 1 : groups == 4 ? 2 : groups == 8 ? 3 : -1;
  if (gi < 0) return 0;
  const int v = launch.variant;
  const TiledEntry& e = kTiledTable[gi][groups <= 2 ? 0 : (v >= 4 && v <= 8) ? v - 1 : v % 3];
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  return launch.gemm1 ? row_blocks * (e.threads / kWarpLanes) : row_blocks;  // GEMM1: every warp
}

cudaError_t LaunchTiledGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream) {
  const int groups = launch.token_groups;
  const int gi = groups == 1 ? 0 : groups == 2 ? 1 : groups == 4 ? 2 : groups == 8 ? 3 : -1;
  if (gi < 0) return cudaErrorInvalidValue;
  const int v = launch.variant;
  const int vi = groups <= 2 ? 0 : (v >= 4 && v <= 8) ? v - 1 : v % 3;
  if (vi >= 3) {
    if (cudaError_t e = ConfigureBulkKernels(); e != cudaSuccess) return e;
  }
  const TiledEntry& e = kTiledTable[gi][vi];
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  const int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const TiledKernel kernel =
      e.kernels[launch.format == Fp4Format::kNvfp4 ? 1 : 0][launch.gemm1 ? 0 : 1];
  const int nv = launch.format == Fp4Format::kNvfp4 ? 1 : 0;
  return LaunchMaybeProgrammaticShared(kernel, static_cast<unsigned>(blocks), e.threads,
                                       e.smem[nv], launch.programmatic, stream, p,
                                       static_cast<int>(row_blocks));
}

}  // namespace moe::cuda::detail
