// Expert GEMMs with FP4 weights dequantized in registers, weight-streaming kernel for few tokens
// per expert (see expert_kernels.h and fp4_fragment.h), plus the runtime dispatch of both GEMM
// kernel families. One CTA computes a block of weight rows for one item (up to 8 * G tokens of
// one expert): warps split the rows (RT groups of RW 16-row tiles) and the K chunks (KS ways,
// interleaved so neighbouring warps stream neighbouring 512-byte blocks), each warp keeps P
// chunks of weights in flight in registers, and the K-split partial sums are added in shared
// memory in a fixed order (deterministic). The weight tile is the A operand of
// mma.m16n8k16 and the tokens the N side, so one-token experts waste only MMA slots, not bytes.
// Stages (expert_gemm_stages.cuh): WeightStream::LoadIf (16-byte streaming loads) ->
// DequantStep (rotate/mask + mul.bf16x2 by the block scale) -> Mma -> ReduceAcrossWarps ->
// EpilogueAct (GEMM1) / EpilogueY (GEMM2).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/expert_gemm_bulk.cuh"
#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda {
namespace {

using namespace detail;  // NOLINT: the shared device stages

// ---- Tile configurations: (token groups G, variant V) -> warp rows RW, row warps RT, K-split KS,
// chunks of weights in flight P, and whether the B fragments of the next chunk are loaded ahead.
// Few tokens (G <= 2): CTAs over 16 RT rows with a 4-way K split (bandwidth: many small CTAs,
// many bytes in flight, a fine-grained tail). Their B fragments come through L1 one chunk
// ahead; kWarmL1 first prefetches all of a warp's B lines into L1 (measured 1-2% slower, kept as
// a variant). Variant 0: RT 1 (the measured best), 1: RT 1 + L1 warm-up, 2: RT 2 + warm-up.
// Variant 4 (G <= 2): RT 1, the weights staged through a shared-memory ring per warp
// (WarpMainloopRing) instead of the register ring; variant 5: the same with RT 2, KS 2;
// variant 6: as 4 with a deeper ring (fewer CTAs per SM, more chunks in flight per warp);
// variant 7: RT 4, KS 1 (each warp streams a whole tile; no K-split reduction).
// Variants 8..11 (G <= 2): the ring filled by bulk copies (WarpMainloopBulk): 8 = RT 4 x KS 1,
// 9 = RT 2 x KS 2, 10 = RT 1 x KS 4, 11..13 = RT 4 x KS 1 with rings of larger groups
// (BulkRing).
// More tokens (G >= 4, variant 3 there): each warp covers two row tiles so every B fragment
// feeds two MMAs.
template <int G, int V>
struct GemmConfig {
  static constexpr int kRw = G <= 2 ? 1 : 2;
  static constexpr bool kWholeTile = V == 7 || V == 8 || V >= 11;
  static constexpr int kRt = G <= 2 ? (V == 2 || V == 5 || V == 9 ? 2 : kWholeTile ? 4 : 1) : 2;
  static constexpr int kKs = G <= 2 ? (V == 5 || V == 9 ? 2 : kWholeTile ? 1 : 4) : 2;
  static constexpr int kPrefetch = G <= 2 ? 4 : 2;
  static constexpr bool kPrefetchB = G <= 2;
  static constexpr bool kWarmL1 = G <= 2 && (V == 1 || V == 2);
  static constexpr bool kSmemRing = G <= 2 && V >= 4 && V <= 7;
  static constexpr bool kBulk = G <= 2 && V >= 8;
};

// Ring of the bulk-copy variants (BulkRingLayout: slots x chunks per slot): 8: 4 x 2 chunks,
// 9 and 10: 6 x 2, 11: 3 x 4 (fewer, larger requests), 12 and 13: 2 x 4 (less shared memory: 10
// and 12 CTAs per SM).
template <int V>
constexpr int BulkSlots() {
  return V == 8 ? 4 : V == 11 ? 3 : V >= 12 ? 2 : 6;
}
template <class Fmt, int V>
using BulkRing = BulkRingLayout<Fmt, V >= 11 ? 4 : 2, BulkSlots<V>()>;

// Chunks per warp in the shared-memory ring of variants 4..7: 512 bytes of codes (each lane
// copies and reads its own 16) plus the 8 scale words of the chunk (MXFP4 32 bytes, NVFP4 128;
// copied by the lanes with t == 0, read by all four lanes of a row pair g).
template <class Fmt, int V>
constexpr int RingDepth() {
  return V == 6 ? 12 : 8;
}

template <int G, int V>
constexpr int CtaThreads() {
  return GemmConfig<G, V>::kRt * GemmConfig<G, V>::kKs * kWarpLanes;
}
// Launch bounds. Variants 0..3 keep ptxas's own register choice (ExpertGemmKernel, maximum
// threads only): an explicit minimum of 1 CTA per SM lets it take up to 50% more registers (MXFP4
// G=1 95 instead of 64), measured 10-20% slower. The ring variants run as ExpertGemmKernelCapped
// (maximum threads and a minimum of CTAs per SM, as measured): one token group MXFP4 8 CTAs
// (<= 64 registers), NVFP4 7 (<= 72; at 64 it spills); two token groups 1 (83-93 registers;
// at a cap of 80 several spill).
template <class Fmt, int G, int V>
constexpr bool Capped() {
  return GemmConfig<G, V>::kSmemRing || GemmConfig<G, V>::kBulk;
}
template <class Fmt, int G, int V>
constexpr int MinCtasPerSm() {
  if (G != 1) return GemmConfig<G, V>::kBulk ? 7 : 1;
  if (V == 12) return 10;
  if (V == 13) return 12;
  return sizeof(typename Fmt::Scale) == 4 ? 8 : 7;
}
template <int G, int V>
constexpr int CtaRowsOf() {
  return GemmConfig<G, V>::kRt * GemmConfig<G, V>::kRw * kTileRows;
}

// Main loop of one warp over chunks ks, ks + KS, ...: a ring of P chunks of weights in flight,
// each reloaded right after it is consumed (no register copies), and for kPrefetchB configs a
// ping-pong pair of B fragment buffers (the next chunk's loads are in flight while this one
// multiplies). The first weight loads are issued before `inputs` (GEMM2 under programmatic launch:
// GEMM1's activations).
template <class Fmt, int G, int V>
__device__ __forceinline__ void WarpMainloop(
    const WeightStream<Fmt, GemmConfig<G, V>::kRw>& stream, int chunks, int ks,
    const uint4* const (&b_rows)[G], const InputWait& inputs,
    float (&acc)[GemmConfig<G, V>::kRw][G][4]) {
  using Cfg = GemmConfig<G, V>;
  constexpr int RW = Cfg::kRw, KS = Cfg::kKs, P = Cfg::kPrefetch;
  static_assert(!Cfg::kPrefetchB || P % 2 == 0, "the B ping-pong needs an even ring");
  using Scale = typename Fmt::Scale;
  const int n = chunks > ks ? (chunks - ks + KS - 1) / KS : 0;
  uint4 v[P][RW];
  Scale s[P][RW];
#pragma unroll
  for (int i = 0; i < P; ++i) stream.LoadIf(i < n, ks + i * KS, v[i], s[i]);
  WaitForInputs(inputs);
  if constexpr (Cfg::kWarmL1) {
    // Lane (g, t) prefetches the 128-byte lines of chunks i = t, t + 4, ... of token g's rows.
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int q = 0; q < G; ++q) {
      if (b_rows[q] == nullptr) continue;
      const uint4* row = b_rows[q] - 2 * t;
      for (int i = t; i < n; i += 4) PrefetchL1(row + (ks + i * KS) * kActChunkVectors);
    }
  }
  uint4 b[2][G][2];
  if constexpr (Cfg::kPrefetchB) FirstBFragments<G>(n > 0, b_rows, ks, b);
  for (int i0 = 0; i0 < n; i0 += P) {
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const int i = i0 + pp;
      if (i >= n) break;
      const int chunk = ks + i * KS;
      if constexpr (Cfg::kPrefetchB) {
#pragma unroll
        for (int q = 0; q < G; ++q) LoadBIf(i + 1 < n, b_rows[q], chunk + KS, b[(pp + 1) & 1][q]);
        MultiplyChunkLoaded<Fmt, RW, G>(v[pp], s[pp], b[pp & 1], acc);
      } else {
        MultiplyChunk<Fmt, RW, G>(v[pp], s[pp], b_rows, chunk, acc);
      }
      stream.LoadIf(i + P < n, chunk + P * KS, v[pp], s[pp]);
    }
  }
}

// Main loop of the ring variants (values, scales: this lane's pointers at chunk 0, as
// WeightStream): the warp's next D - 1 chunks of weights (codes and scale words) are in flight as
// cp.async copies into its shared-memory ring (no registers held for them), one commit group per
// chunk; chunk i is read back after wait_group(D - 1) and a __syncwarp, and step i refills the
// slot read at step i - 1 (after a __syncwarp) with chunk i + D - 1. B fragments: the ping-pong
// pair, as kPrefetchB.
template <class Fmt, int G, int V>
__device__ __forceinline__ void WarpMainloopRing(const uint4* values,
                                                 const typename Fmt::Scale* scales, int chunks,
                                                 int ks, const uint4* const (&b_rows)[G],
                                                 const InputWait& inputs, uint4* ring_v,
                                                 typename Fmt::Scale* ring_s, uint64_t policy,
                                                 float (&acc)[1][G][4]) {
  using Cfg = GemmConfig<G, V>;
  using Scale = typename Fmt::Scale;
  constexpr int KS = Cfg::kKs, D = RingDepth<Fmt, V>();
  static_assert(D % 2 == 0, "the B ping-pong needs an even ring");
  const int lane = threadIdx.x & 31;
  const int n = chunks > ks ? (chunks - ks + KS - 1) / KS : 0;
  const int g = lane >> 2;
  const bool copies_scale = (lane & 3) == 0;
  const uint32_t sv = static_cast<uint32_t>(__cvta_generic_to_shared(ring_v + lane));
  const uint32_t ss = static_cast<uint32_t>(__cvta_generic_to_shared(ring_s + g));
  auto issue = [&](bool pred, int i, int slot) {
    const int64_t chunk = ks + static_cast<int64_t>(i) * KS;
    CopyAsync16HintIf(pred, sv + slot * kWarpLanes * 16, values + chunk * kWarpLanes, policy);
    if constexpr (sizeof(Scale) == 4) {
      CopyAsync4HintIf(pred && copies_scale, ss + slot * 8 * 4, scales + chunk * 8, policy);
    } else {
      CopyAsync16HintIf(pred && copies_scale, ss + slot * 8 * 16, scales + chunk * 8, policy);
    }
    CopyAsyncCommit();
  };
#pragma unroll
  for (int d = 0; d < D - 1; ++d) issue(d < n, d, d);
  WaitForInputs(inputs);
  uint4 b[2][G][2];
  FirstBFragments<G>(n > 0, b_rows, ks, b);
  for (int i0 = 0; i0 < n; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      if (i >= n) break;
      __syncwarp();  // every lane has read the slot refilled below (scale words are shared)
      issue(i + D - 1 < n, i + D - 1, (d + D - 1) % D);
      CopyAsyncWait<D - 1>();
      __syncwarp();  // the scale words copied by lanes t == 0 are visible to the others
      uint4 v[1];
      Scale s[1];
      v[0] = ring_v[d * kWarpLanes + lane];
      s[0] = ring_s[d * 8 + g];
      const int chunk = ks + i * KS;
#pragma unroll
      for (int q = 0; q < G; ++q) LoadBIf(i + 1 < n, b_rows[q], chunk + KS, b[(d + 1) & 1][q]);
      MultiplyChunkLoaded<Fmt, 1, G>(v, s, b[d & 1], acc);
    }
  }
}

// ---- Stage 4: add the K-split partial sums in warp order ks = 0, 1, ... (warp ks = 0 keeps them).
template <int G, int V>
__device__ __forceinline__ void ReduceAcrossWarps(float* red, int ks, int wr, int lane,
                                                  float (&acc)[GemmConfig<G, V>::kRw][G][4]) {
  constexpr int RW = GemmConfig<G, V>::kRw, RT = GemmConfig<G, V>::kRt;
  constexpr int KS = GemmConfig<G, V>::kKs;
  constexpr int kPerWarp = RW * G * 4;
  if constexpr (KS > 1) {
    if (ks > 0) {
      float* dst = red + ((ks - 1) * RT + wr) * kPerWarp * kWarpLanes + lane;
#pragma unroll
      for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int q = 0; q < G; ++q)
#pragma unroll
          for (int e = 0; e < 4; ++e) dst[((r * G + q) * 4 + e) * kWarpLanes] = acc[r][q][e];
    }
    __syncthreads();
    if (ks == 0) {
#pragma unroll
      for (int k = 1; k < KS; ++k) {
        const float* src = red + ((k - 1) * RT + wr) * kPerWarp * kWarpLanes + lane;
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
          for (int q = 0; q < G; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][q][e] += src[((r * G + q) * 4 + e) * kWarpLanes];
      }
    }
  }
}

// ---- The kernel: blockIdx.x = row block + row_blocks * item (row blocks of one item adjacent,
// so the CTAs reading one item's activations run together; items of one expert are adjacent
// too, so token tiles that re-read an expert's weights find them in L2). Under programmatic
// launch GEMM1 waits for the prologue before reading the items; GEMM2 reads the items (the
// prologue finished before GEMM1 could let it start), issues its first weight loads and only
// then waits for GEMM1's activations, overlapping its start with GEMM1's last wave. With direct
// routes GEMM1 does the same as GEMM2 (the items come from the ids, an input).
template <class Fmt, bool kGemm1, int G, int V>
__device__ __forceinline__ void GemmBody(const ExpertGemmParams& p, int row_blocks) {
  using Cfg = GemmConfig<G, V>;
  constexpr int RW = Cfg::kRw, RT = Cfg::kRt, KS = Cfg::kKs;
  __shared__ float red[KS > 1 ? (KS - 1) * RT * RW * G * 4 * kWarpLanes : 1];
  constexpr int kRingChunks = Cfg::kSmemRing ? RT * KS * RingDepth<Fmt, V>() : 1;
  __shared__ uint4 ring_v[kRingChunks * kWarpLanes];
  __shared__ typename Fmt::Scale ring_s[kRingChunks * 8];
  constexpr int kBulkWarps = Cfg::kBulk ? RT * KS : 0;
  constexpr int kBulkRingBytes = kBulkWarps > 0 ? kBulkWarps * BulkRing<Fmt, V>::kWarpBytes : 16;
  __shared__ alignas(128) unsigned char bulk_ring[kBulkRingBytes];
  __shared__ uint64_t bulk_bars[kBulkWarps > 0 ? kBulkWarps * BulkRing<Fmt, V>::kSlots : 1];

  const bool direct = p.direct_ids != nullptr;
  if constexpr (kGemm1) {
    if (!direct) WaitForPrerequisites();
    AllowDependents();
  }
  const int item_index = static_cast<int>(blockIdx.x / row_blocks);
  const int row_block = static_cast<int>(blockIdx.x % row_blocks);
  ExpertItem item;
  if (direct) {
    const int expert = DirectExpert(p, item_index);
    if (expert < 0) return;  // whole CTA
    item = ExpertItem{expert, item_index, 1, 0};
  } else {
    if (item_index >= *p.num_items) return;  // whole CTA: no barrier is skipped by part of it
    item = p.items[item_index];
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ks = warp % KS, wr = warp / KS;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = (row_block * RT + wr) * RW;

  WeightStream<Fmt, RW> stream;
#pragma unroll
  for (int r = 0; r < RW; ++r) stream.Aim(p, item.expert, r, tile0 + r, lane);
  const uint4* b_rows[G];
  const int64_t b_row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
#pragma unroll
  for (int q = 0; q < G; ++q) {
    const int col = q * kTileTokens + g;
    b_rows[q] = nullptr;
    if (col < item.count) {
      const int slot = item.slot_begin + col;
      const int row = direct ? (kGemm1 ? DirectToken(p, slot) : slot)
                             : (p.b_row_of_slot != nullptr ? p.b_row_of_slot[slot] : slot);
      b_rows[q] = reinterpret_cast<const uint4*>(p.b_rows) + row * b_row_vectors + 2 * t;
    }
  }

  float acc[RW][G][4];
  ZeroAccumulators<RW, G>(acc);

  // GEMM2 waits for its item's act rows, GEMM1 with direct routes for the prologue's rows.
  const InputWait inputs = kGemm1 ? InputWait{direct} : Gemm2InputWait(p, item_index);
  if constexpr (Cfg::kBulk) {
    static_assert(RW == 1, "the bulk main loop streams one tile per warp");
    if (kGemm1 && (p.l2_prefetch & kL2PrefetchNext) != 0 && p.next_values != nullptr && lane == 0) {
      // This warp's share of the same expert slot's GEMM2 weights, into L2 while GEMM1 runs.
      const int parts = row_blocks * RT * KS, part = row_block * RT * KS + warp;
      PrefetchShareL2(static_cast<const unsigned char*>(p.next_values) +
                          item.expert * p.next_values_stride_bytes,
                      p.next_values_bytes, part, parts);
      PrefetchShareL2(static_cast<const unsigned char*>(p.next_scales) +
                          item.expert * p.next_scales_stride_bytes,
                      p.next_scales_bytes, part, parts);
    }
    // Warp-uniform copies of the warp index and the expert slot (broadcast from lane 0), so the
    // compiler keeps the copy addresses in uniform registers.
    const int uwarp = __shfl_sync(0xffffffffu, warp, 0);
    const int uexpert = __shfl_sync(0xffffffffu, item.expert, 0);
    const int uks = uwarp % KS;
    const int utile = row_block * RT + uwarp / KS;
    const int64_t base = static_cast<int64_t>(utile < p.tiles ? utile : 0) * p.chunks;
    const uint4* values =
        static_cast<const uint4*>(p.values) + uexpert * p.values_expert_stride + base * kWarpLanes;
    const auto* scales = static_cast<const typename Fmt::Scale*>(p.scales) +
                         uexpert * p.scales_expert_stride + base * 8;
    // Contiguous K ranges per K-split warp (bulk copies of several chunks at once).
    const int c_begin = static_cast<int>(static_cast<int64_t>(p.chunks) * uks / KS);
    const int c_end = static_cast<int>(static_cast<int64_t>(p.chunks) * (uks + 1) / KS);
    using Ring = BulkRing<Fmt, V>;
    WarpMainloopBulk<Fmt, G, Ring>(p, values, scales, c_begin, c_end - c_begin, b_rows,
                                   inputs, bulk_ring + uwarp * Ring::kWarpBytes,
                                   bulk_bars + uwarp * Ring::kSlots, acc);
  } else if constexpr (Cfg::kSmemRing) {
    static_assert(RW == 1, "the ring main loop streams one tile per warp");
    constexpr int kWarpChunks = RingDepth<Fmt, V>();
    WarpMainloopRing<Fmt, G, V>(stream.values[0], stream.scales[0], p.chunks, ks, b_rows,
                                inputs, ring_v + warp * kWarpChunks * kWarpLanes,
                                ring_s + warp * kWarpChunks * 8, L2Policy(p.weights_evict_first),
                                acc);
  } else {
    WarpMainloop<Fmt, G, V>(stream, p.chunks, ks, b_rows, inputs, acc);
  }
  ReduceAcrossWarps<G, V>(red, ks, wr, lane, acc);
  if (ks != 0) return;
  if constexpr (kGemm1) {
    EpilogueAct<RW, G>(p, item, tile0, lane, acc);
    SignalItemReady(p, item_index);  // one of the item's row_blocks * RT signals
  } else {
    EpilogueY<RW, G>(p, item, tile0, lane, acc);
    if constexpr (RW == 1) {
      if (p.fold_counters != nullptr) {
        __threadfence();  // this lane's y stores, before the counts
        if (direct) {
          FoldCombine(p, DirectToken(p, item.slot_begin), tile0, lane);
        } else {
          // Grouped routes: every token of the item (warp-uniform loop).
          for (int col = 0; col < item.count; ++col) {
            FoldCombine(p, p.fold_slot_token[item.slot_begin + col], tile0, lane);
          }
        }
      }
    }
  }
}

template <class Fmt, bool kGemm1, int G, int V>
__global__ void __launch_bounds__(CtaThreads<G, V>())
    ExpertGemmKernel(const ExpertGemmParams p, int row_blocks) {
  GemmBody<Fmt, kGemm1, G, V>(p, row_blocks);
}
template <class Fmt, bool kGemm1, int G, int V>
__global__ void __launch_bounds__(CtaThreads<G, V>(), MinCtasPerSm<Fmt, G, V>())
    ExpertGemmKernelCapped(const ExpertGemmParams p, int row_blocks) {
  GemmBody<Fmt, kGemm1, G, V>(p, row_blocks);
}

// ---- Runtime -> template dispatch: [format][gemm1][token groups 1, 2, 4, 8][variant 0..7].
using GemmKernel = void (*)(ExpertGemmParams, int);

template <class Fmt, bool kGemm1, int G, int V>
constexpr GemmKernel KernelOf() {
  if constexpr (Capped<Fmt, G, V>()) {
    return &ExpertGemmKernelCapped<Fmt, kGemm1, G, V>;
  } else {
    return &ExpertGemmKernel<Fmt, kGemm1, G, V>;
  }
}

struct GemmEntry {
  GemmKernel mxfp4_gemm1, mxfp4_gemm2, nvfp4_gemm1, nvfp4_gemm2;
  int threads;
  int cta_rows;
  int ready_signals;  // per CTA with item_ready: its warps of K-split 0
  int resident[2];    // [nvfp4] CTAs per SM its launch bounds ask for (0: none asked)
};

template <int G, int V>
constexpr GemmEntry Entry() {
  return GemmEntry{KernelOf<Mxfp4, true, G, V>(), KernelOf<Mxfp4, false, G, V>(),
                   KernelOf<Nvfp4, true, G, V>(), KernelOf<Nvfp4, false, G, V>(),
                   CtaThreads<G, V>(), CtaRowsOf<G, V>(), GemmConfig<G, V>::kRt,
                   {Capped<Mxfp4, G, V>() ? MinCtasPerSm<Mxfp4, G, V>() : 0,
                    Capped<Nvfp4, G, V>() ? MinCtasPerSm<Nvfp4, G, V>() : 0}};
}

// Variants of this kernel: token groups <= 2: 0, 1, 2, 4 (variant 3 is the tiled kernel, its
// column here unused); token groups >= 4: variant 3, in column 0 (0, 1, 2, 4 are tiled).
const GemmEntry kGemmTable[4][kMaxGemmVariant + 1] = {
    {Entry<1, 0>(), Entry<1, 1>(), Entry<1, 2>(), Entry<1, 0>(), Entry<1, 4>(), Entry<1, 5>(),
     Entry<1, 6>(), Entry<1, 7>(), Entry<1, 8>(), Entry<1, 9>(), Entry<1, 10>(), Entry<1, 11>(),
     Entry<1, 12>(), Entry<1, 13>()},
    {Entry<2, 0>(), Entry<2, 1>(), Entry<2, 2>(), Entry<2, 0>(), Entry<2, 4>(), Entry<2, 5>(),
     Entry<2, 6>(), Entry<2, 7>(), Entry<2, 8>(), Entry<2, 9>(), Entry<2, 10>(), Entry<2, 11>(),
     Entry<2, 12>(), Entry<2, 13>()},
    {Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(),
     Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>(),
     Entry<4, 0>(), Entry<4, 0>()},
    {Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(),
     Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>(),
     Entry<8, 0>(), Entry<8, 0>()}};

// ExpertGemmParams::acc_scale (GemmCanScaleAccumulators): MXFP4, one token group, variants 6 and
// 12, [variant 12][gemm2]; threads and rows as their kGemmTable entries.
const GemmKernel kAccScaleKernels[2][2] = {
    {KernelOf<Mxfp4Acc, true, 1, 6>(), KernelOf<Mxfp4Acc, false, 1, 6>()},
    {KernelOf<Mxfp4Acc, true, 1, 12>(), KernelOf<Mxfp4Acc, false, 1, 12>()}};

// The ring kernels want the largest shared-memory carveout (their occupancy is bounded by shared
// memory); set once, before their first launch.
cudaError_t SetRingCarveouts() {
  const auto set = [](GemmKernel k) {
    return cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared);
  };
  for (int gi = 0; gi < 2; ++gi) {
    for (int v = 4; v <= kMaxGemmVariant; ++v) {
      const GemmEntry& e = kGemmTable[gi][v];
      for (GemmKernel k : {e.mxfp4_gemm1, e.mxfp4_gemm2, e.nvfp4_gemm1, e.nvfp4_gemm2}) {
        if (const cudaError_t err = set(k); err != cudaSuccess) return err;
      }
    }
  }
  for (const auto& pair : kAccScaleKernels) {
    for (GemmKernel k : pair) {
      if (const cudaError_t err = set(k); err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

int GroupsIndex(int token_groups) {
  switch (token_groups) {
    case 1:
      return 0;
    case 2:
      return 1;
    case 4:
      return 2;
    case 8:
      return 3;
    default:
      return -1;
  }
}

}  // namespace

int64_t GemmItemReadyCount(const GemmLaunch& launch, const ExpertGemmParams& p) {
  const int index = GroupsIndex(launch.token_groups);
  if (index < 0 || launch.variant < 0 || launch.variant > kMaxGemmVariant) return 0;
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  if (!GemmUsesStreamingKernel(launch.token_groups, launch.variant)) {
    GemmLaunch tiled = launch;
    if (tiled.variant >= 9) tiled.variant = 0;
    return TiledItemReadyCount(tiled, rows);
  }
  const GemmEntry& e = kGemmTable[index][launch.token_groups >= 4 ? 0 : launch.variant];
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  return row_blocks * (launch.gemm1 ? e.ready_signals : 1);
}

double GemmWaves(const GemmLaunch& launch, const ExpertGemmParams& p) {
  const int index = GroupsIndex(launch.token_groups);
  if (index < 0 || launch.variant < 0 || launch.variant > kMaxGemmVariant ||
      !GemmUsesStreamingKernel(launch.token_groups, launch.variant)) {
    return 0;
  }
  const GemmEntry& e = kGemmTable[index][launch.token_groups >= 4 ? 0 : launch.variant];
  const int resident = e.resident[launch.format == Fp4Format::kNvfp4 ? 1 : 0];
  int device = 0, sms = 0;
  if (resident <= 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    return 0;
  }
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  return static_cast<double>(row_blocks * launch.num_items) / (static_cast<double>(sms) * resident);
}

cudaError_t LaunchExpertGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                             cudaStream_t stream) {
  if (p.acc_scale && !GemmCanScaleAccumulators(launch)) return cudaErrorInvalidValue;
  if (launch.token_groups == kWgmmaTokenGroups) {
    if (p.item_ready != nullptr) return cudaErrorInvalidValue;  // no per-item readiness there
    if (launch.num_items == 0) return cudaSuccess;
    return LaunchWgmmaGemm(p, launch, stream);
  }
  const int index = GroupsIndex(launch.token_groups);
  if (index < 0 || launch.variant < 0 || launch.variant > kMaxGemmVariant) {
    return cudaErrorInvalidValue;
  }
  if (launch.num_items == 0) return cudaSuccess;
  if (p.item_ready != nullptr && !launch.gemm1 &&
      (p.item_ready_target <= 0 || p.item_ready_waiters != GemmItemReadyCount(launch, p))) {
    return cudaErrorInvalidValue;
  }
  if (!GemmUsesStreamingKernel(launch.token_groups, launch.variant)) {
    if (p.direct_ids != nullptr) return cudaErrorInvalidValue;
    if (launch.variant >= 9) {
      GemmLaunch tiled = launch;
      tiled.variant = 0;
      return LaunchTiledGemm(p, tiled, stream);
    }
    return LaunchTiledGemm(p, launch, stream);
  }
  if (p.fold_counters != nullptr &&
      ((p.direct_ids == nullptr && p.fold_slot_token == nullptr) || launch.gemm1 ||
       !GemmCanFoldCombine(launch.token_groups, launch.variant))) {
    return cudaErrorInvalidValue;
  }
  if (launch.variant >= 4) {
    static const cudaError_t carveout = SetRingCarveouts();
    if (carveout != cudaSuccess) return carveout;
  }
  const GemmEntry& e = kGemmTable[index][launch.token_groups >= 4 ? 0 : launch.variant];
  // GEMM1 rows: gate+up pairs of every act column (I padded to 64); GEMM2 rows: H.
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  const int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool mx = launch.format == Fp4Format::kMxfp4;
  const GemmKernel kernel =
      p.acc_scale ? kAccScaleKernels[launch.variant == 12 ? 1 : 0][launch.gemm1 ? 0 : 1]
      : launch.gemm1 ? (mx ? e.mxfp4_gemm1 : e.nvfp4_gemm1)
                     : (mx ? e.mxfp4_gemm2 : e.nvfp4_gemm2);
  return LaunchMaybeProgrammatic(kernel, static_cast<unsigned>(blocks), e.threads,
                                 launch.programmatic, stream, p, static_cast<int>(row_blocks));
}

}  // namespace moe::cuda
