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
// More tokens (G >= 4, variant 3 there): each warp covers two row tiles so every B fragment
// feeds two MMAs.
template <int G, int V>
struct GemmConfig {
  static constexpr int kRw = G <= 2 ? 1 : 2;
  static constexpr int kRt = G <= 2 ? (V == 2 ? 2 : 1) : 2;
  static constexpr int kKs = G <= 2 ? 4 : 2;
  static constexpr int kPrefetch = G <= 2 ? 4 : 2;
  static constexpr bool kPrefetchB = G <= 2;
  static constexpr bool kWarmL1 = G <= 2 && V != 0;
};

template <int G, int V>
constexpr int CtaThreads() {
  return GemmConfig<G, V>::kRt * GemmConfig<G, V>::kKs * kWarpLanes;
}
template <int G, int V>
constexpr int CtaRowsOf() {
  return GemmConfig<G, V>::kRt * GemmConfig<G, V>::kRw * kTileRows;
}

// Main loop of one warp over chunks ks, ks + KS, ...: a ring of P chunks of weights in flight,
// each reloaded right after it is consumed (no register copies), and for kPrefetchB configs a
// ping-pong pair of B fragment buffers (the next chunk's loads are in flight while this one
// multiplies). With wait_after_prefetch (GEMM2 under programmatic launch) the first weight loads
// are issued before waiting for GEMM1's activations.
template <class Fmt, int G, int V>
__device__ __forceinline__ void WarpMainloop(
    const WeightStream<Fmt, GemmConfig<G, V>::kRw>& stream, int chunks, int ks,
    const uint4* const (&b_rows)[G], bool wait_after_prefetch,
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
  if (wait_after_prefetch) {
    WaitForPrerequisites();
    AllowDependents();
  }
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
  if constexpr (Cfg::kPrefetchB) {
#pragma unroll
    for (int q = 0; q < G; ++q) {
      b[0][q][0] = b[0][q][1] = b[1][q][0] = b[1][q][1] = make_uint4(0u, 0u, 0u, 0u);
      LoadBIf(n > 0, b_rows[q], ks, b[0][q]);
    }
  }
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
// then waits for GEMM1's activations, overlapping its start with GEMM1's last wave.
template <class Fmt, bool kGemm1, int G, int V>
__global__ void __launch_bounds__(CtaThreads<G, V>()) ExpertGemmKernel(const ExpertGemmParams p,
                                                                       int row_blocks) {
  using Cfg = GemmConfig<G, V>;
  constexpr int RW = Cfg::kRw, RT = Cfg::kRt, KS = Cfg::kKs;
  __shared__ float red[KS > 1 ? (KS - 1) * RT * RW * G * 4 * kWarpLanes : 1];

  if constexpr (kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }
  const int item_index = static_cast<int>(blockIdx.x / row_blocks);
  const int row_block = static_cast<int>(blockIdx.x % row_blocks);
  if (item_index >= *p.num_items) return;  // whole CTA: no barrier is skipped by part of it
  const ExpertItem item = p.items[item_index];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ks = warp % KS, wr = warp / KS;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = (row_block * RT + wr) * RW;

  WeightStream<Fmt, RW> stream;
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int tile = tile0 + r < p.tiles ? tile0 + r : 0;
    const int64_t base = static_cast<int64_t>(tile) * p.chunks;
    stream.values[r] = static_cast<const uint4*>(p.values) +
                       item.expert * p.values_expert_stride + base * kWarpLanes + lane;
    stream.scales[r] = static_cast<const typename Fmt::Scale*>(p.scales) +
                       item.expert * p.scales_expert_stride + base * 8 + g;
  }
  const uint4* b_rows[G];
  const int64_t b_row_vectors = static_cast<int64_t>(p.chunks) * kActChunkVectors;
#pragma unroll
  for (int q = 0; q < G; ++q) {
    const int col = q * kTileTokens + g;
    b_rows[q] = nullptr;
    if (col < item.count) {
      const int slot = item.slot_begin + col;
      const int row = p.b_row_of_slot != nullptr ? p.b_row_of_slot[slot] : slot;
      b_rows[q] = reinterpret_cast<const uint4*>(p.b_rows) + row * b_row_vectors + 2 * t;
    }
  }

  float acc[RW][G][4];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int q = 0; q < G; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][q][e] = 0.f;

  WarpMainloop<Fmt, G, V>(stream, p.chunks, ks, b_rows, /*wait_after_prefetch=*/!kGemm1, acc);
  ReduceAcrossWarps<G, V>(red, ks, wr, lane, acc);
  if (ks != 0) return;
  if constexpr (kGemm1) {
    EpilogueAct<RW, G>(p, item, tile0, lane, acc);
  } else {
    EpilogueY<RW, G>(p, item, tile0, lane, acc);
  }
}

// ---- Runtime -> template dispatch: [format][gemm1][token groups 1, 2, 4, 8][variant 0, 1].
using GemmKernel = void (*)(ExpertGemmParams, int);

struct GemmEntry {
  GemmKernel mxfp4_gemm1, mxfp4_gemm2, nvfp4_gemm1, nvfp4_gemm2;
  int threads;
  int cta_rows;
};

template <int G, int V>
constexpr GemmEntry Entry() {
  return GemmEntry{&ExpertGemmKernel<Mxfp4, true, G, V>, &ExpertGemmKernel<Mxfp4, false, G, V>,
                   &ExpertGemmKernel<Nvfp4, true, G, V>, &ExpertGemmKernel<Nvfp4, false, G, V>,
                   CtaThreads<G, V>(), CtaRowsOf<G, V>()};
}

// Variants of this kernel: token groups <= 2: 0, 1, 2 (variant 3 is the tiled kernel); token
// groups >= 4: variant 3 (0, 1, 2 are tiled configurations).
const GemmEntry kGemmTable[4][3] = {{Entry<1, 0>(), Entry<1, 1>(), Entry<1, 2>()},
                                    {Entry<2, 0>(), Entry<2, 1>(), Entry<2, 2>()},
                                    {Entry<4, 0>(), Entry<4, 0>(), Entry<4, 0>()},
                                    {Entry<8, 0>(), Entry<8, 0>(), Entry<8, 0>()}};

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

cudaError_t LaunchExpertGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                             cudaStream_t stream) {
  if (launch.token_groups == kWgmmaTokenGroups) {
    if (launch.num_items == 0) return cudaSuccess;
    return LaunchWgmmaGemm(p, launch, stream);
  }
  const int index = GroupsIndex(launch.token_groups);
  if (index < 0 || launch.variant < 0 || launch.variant > kMaxGemmVariant) {
    return cudaErrorInvalidValue;
  }
  if (launch.num_items == 0) return cudaSuccess;
  const bool tiled = launch.token_groups >= 4 ? launch.variant != 3 : launch.variant == 3;
  if (tiled) return LaunchTiledGemm(p, launch, stream);
  const GemmEntry& e = kGemmTable[index][launch.token_groups >= 4 ? 0 : launch.variant];
  // GEMM1 rows: gate+up pairs of every act column (I padded to 64); GEMM2 rows: H.
  const int64_t rows = launch.gemm1 ? 2 * static_cast<int64_t>(p.out_cols) : p.out_valid;
  const int64_t row_blocks = (rows + e.cta_rows - 1) / e.cta_rows;
  const int64_t blocks = row_blocks * launch.num_items;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool mx = launch.format == Fp4Format::kMxfp4;
  const GemmKernel kernel = launch.gemm1 ? (mx ? e.mxfp4_gemm1 : e.nvfp4_gemm1)
                                         : (mx ? e.mxfp4_gemm2 : e.nvfp4_gemm2);
  return LaunchMaybeProgrammatic(kernel, static_cast<unsigned>(blocks), e.threads,
                                 launch.programmatic, stream, p, static_cast<int>(row_blocks));
}

}  // namespace moe::cuda
