// The fused decode layer (expert_kernels.h ExpertLayerParams): one persistent CTA per SM runs
// GEMM1 + activation, GEMM2 and the folded combine of a direct-route batch.
//
// Work: GEMM1 has routes x tiles1 16-row tiles (tiles1 = act columns / 8: gate and up rows of 8
// act columns each), GEMM2 routes x tiles2 (ceil(H / 16)). Tile u of a GEMM goes to CTA u % CTAs,
// so every CTA gets the same share to within one tile. A CTA works through its tiles in rounds:
// in a round each of its warps takes one K range ("slice") of one tile (ks slices per tile,
// LayerLayout::ks).
//
// Weights: every warp streams its own slices through its own ring of shared-memory slots (kGroup
// chunks each, codes and scale words, one bulk copy each, completed on the slot's mbarrier).
// Lane 0 keeps a cursor `stages` steps ahead of the warp's multiply and refills each slot as soon
// as the warp is done with it; the cursor runs on from GEMM1's slices into GEMM2's without
// waiting for anything, so GEMM2's first weights arrive while GEMM1 finishes. (One producer warp
// issuing every warp's copies was measured 1.5x slower than the two-grid path: the compiler
// issues per-lane bulk copies one lane at a time, and that warp could not keep up.)
//
// The warps copy the batch's staged hidden rows into shared memory (after the programmatic wait
// for the prologue), multiply with the B fragments from there, add the K-split partial sums in
// warp order and run GEMM1's epilogue (EpilogueAct), then count the tile in ready[route]
// (release). Before GEMM2 they wait until every route has all of its tiles (acquire), copy the
// act rows into shared memory, and GEMM2's epilogue (EpilogueY) hands each tile to FoldCombine.
// Every CTA must be resident at once: the counters are waited for across CTAs (cooperative
// launch, one CTA per SM).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda {
namespace {

using namespace detail;  // NOLINT: the shared device stages

constexpr int kGroup = 4;       // chunks per ring slot
constexpr int kWarps = kExpertLayerWarps;  // 768 threads: up to 80 registers
constexpr int kMaxStages = 16;  // ring slots per warp
constexpr int kMinStages = 2;
constexpr int kThreads = kWarps * kWarpLanes;

// Shapes and shared-memory offsets of one launch (host-computed, a kernel parameter).
struct LayerLayout {
  int ks[2] = {1, 1};     // slices per tile: GEMM1, GEMM2
  int tpr[2] = {1, 1};    // tiles per round = kWarps / ks
  int tiles[2] = {0, 0};  // tiles per route
  int stages = 0;         // ring slots per warp
  int slot_bytes = 0;     // kGroup * (codes + scale words of a chunk)
  int x_off = 0, act_off = 0, red_off = 0, bar_off = 0, route_off = 0, zero_off = 0;
  int cursor_off = 0;  // warp ranges: each warp's copy cursor (RangeCursor)
  int smem_bytes = 0;
};

__device__ __forceinline__ void CtaBarrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
}
__device__ __forceinline__ void Trace(const ExpertLayerParams& p, int point) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    p.trace[blockIdx.x * 8 + point] = now;
  }
}
__device__ __forceinline__ uint4 LoadShared16(uint32_t at) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(at));
  return r;
}
__device__ __forceinline__ uint32_t LoadShared4(uint32_t at) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(at));
  return r;
}
template <class Scale>
__device__ __forceinline__ Scale LoadScale(uint32_t at) {
  if constexpr (sizeof(Scale) == 4) {
    return LoadShared4(at);
  } else {
    return LoadShared16(at);
  }
}

// The slice of warp `w` in round `round` of GEMM kPh in CTA `cta` of `ctas`: its route index
// (into the route list), tile and chunk range. kPh is a template argument so that every layout
// field is read at a constant offset of the parameter space (a runtime index would copy the
// parameters to local memory).
struct Slice {
  int route_index = 0;
  int tile = 0;
  int k0 = 0;
  int len = 0;   // chunks to stream (0 for GEMM1 tiles past the packed ones: zero act columns)
  int part = 0;  // 0 keeps the sum and runs the epilogue
  bool active = false;
};
template <int kPh>
__device__ __forceinline__ Slice SliceOf(const LayerLayout& L, int chunks, int packed_tiles,
                                         int routes, int cta, int ctas, int round, int w) {
  Slice s;
  const int ks = L.ks[kPh];
  const int pos = w / ks;
  s.part = w - pos * ks;
  if (pos >= L.tpr[kPh]) return s;
  const int units = routes * L.tiles[kPh];
  const int u = cta + (round * L.tpr[kPh] + pos) * ctas;
  if (u >= units) return s;
  s.active = true;
  s.route_index = u / L.tiles[kPh];
  s.tile = u - s.route_index * L.tiles[kPh];
  s.k0 = chunks * s.part / ks;
  s.len = s.tile < packed_tiles ? chunks * (s.part + 1) / ks - s.k0 : 0;
  return s;
}
template <int kPh>
__device__ __forceinline__ int RoundsOf(const LayerLayout& L, int routes, int cta, int ctas) {
  const int units = routes * L.tiles[kPh];
  const int mine = units > cta ? (units - cta + ctas - 1) / ctas : 0;
  return (mine + L.tpr[kPh] - 1) / L.tpr[kPh];
}

// The warp's slices, one step (up to kGroup chunks) at a time: GEMM1's rounds, then GEMM2's,
// skipping rounds where the warp has no slice and tiles with nothing to stream. Lane 0 walks it
// `stages` steps ahead of the multiply to issue the copies.
template <class Fmt>
struct StepCursor {
  using Scale = typename Fmt::Scale;
  int ph = 0;
  int round = -1;
  int step = 0;
  int steps = 0;
  int cnt_last = 0;  // chunks in the slice's last step
  const uint4* values = nullptr;
  const Scale* scales = nullptr;
  bool valid = true;

  // Points the cursor at the first step of the warp's slice in round `round` of GEMM kPh; false
  // when there is nothing to stream (the GEMM's parameters selected at compile time).
  template <int kPh, class Ctx>
  __device__ __forceinline__ bool Enter(const Ctx& c) {
    const ExpertGemmParams& g = kPh == 0 ? c.g1 : c.g2;
    const Slice sl = SliceOf<kPh>(c.L, g.chunks, g.tiles, c.routes, c.cta, c.ctas, round, c.warp);
    if (!sl.active || sl.len == 0) return false;
    const int expert = c.route_list[1 + kMaxLayerRoutes + sl.route_index];
    const int64_t chunk0 = static_cast<int64_t>(sl.tile) * g.chunks + sl.k0;
    values =
        static_cast<const uint4*>(g.values) + expert * g.values_expert_stride + chunk0 * kWarpLanes;
    scales = static_cast<const Scale*>(g.scales) + expert * g.scales_expert_stride + chunk0 * 8;
    step = 0;
    steps = (sl.len + kGroup - 1) / kGroup;
    cnt_last = sl.len - (steps - 1) * kGroup;
    return true;
  }

  // Moves to the next step (from the initial state: to the first one).
  template <class Ctx>
  __device__ __forceinline__ void Next(const Ctx& c) {
    if (++step < steps) {
      values += kGroup * kWarpLanes;
      scales += kGroup * 8;
      return;
    }
    for (;;) {
      ++round;
      if (ph == 0 && round >= c.rounds[0]) {
        ph = 1;
        round = 0;
      }
      if (ph == 1 && round >= c.rounds[1]) {
        valid = false;
        return;
      }
      if (ph == 0 ? Enter<0>(c) : Enter<1>(c)) return;
    }
  }
};

struct LayerContext {
  const ExpertGemmParams& g1;
  const ExpertGemmParams& g2;
  const LayerLayout& L;
  const int32_t* route_list;
  int routes, cta, ctas, warp;
  int rounds[2];
};

template <class Fmt>
__global__ void __launch_bounds__(kThreads, 1)
    ExpertLayerKernel(const ExpertLayerParams p, const LayerLayout L) {
  using Scale = typename Fmt::Scale;
  constexpr int kScaleBytes = 8 * static_cast<int>(sizeof(Scale));
  constexpr int kChunkAll = kChunkBytes + kScaleBytes;
  using Ph0 = std::integral_constant<int, 0>;
  using Ph1 = std::integral_constant<int, 1>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int cta = static_cast<int>(blockIdx.x), ctas = static_cast<int>(gridDim.x);
  const ExpertGemmParams& g1 = p.g1;
  const ExpertGemmParams& g2 = p.g2;
  const int stages = L.stages, slot_bytes = L.slot_bytes;
  // [0]: count, [1 + i]: route i's y row, [1 + kMaxLayerRoutes + i]: its expert slot.
  int32_t* route_list = reinterpret_cast<int32_t*>(smem + L.route_off);
  const uint32_t smem_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // This warp's ring (stages slots) and its slots' barriers.
  const uint32_t ring = smem_at + warp * stages * slot_bytes;
  const uint32_t bars = smem_at + L.bar_off + warp * kMaxStages * 8;

  // The routes that run (ids are an input: readable before the programmatic wait), in y-row
  // order; every CTA builds the same list.
  if (threadIdx.x == 0) {
    // As ExpertLayerRoutes.
    const int total = g1.direct_tokens * (g1.direct_top_k + g1.direct_shared);
    int n = 0;
    for (int r = 0; r < total && n < kMaxLayerRoutes; ++r) {
      const int expert = DirectExpert(g1, r);
      if (expert < 0) continue;
      route_list[1 + n] = r;
      route_list[1 + kMaxLayerRoutes + n] = expert;
      ++n;
    }
    route_list[0] = n;
  }
  if (threadIdx.x < 32) reinterpret_cast<uint32_t*>(smem + L.zero_off)[threadIdx.x] = 0u;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) MbarrierInit(bars + 8 * s, 1);
    FenceMbarrierInit();
  }
  __syncthreads();
  const int routes = route_list[0];
  if (routes == 0) return;  // every output row was zeroed by the prologue
  const LayerContext ctx{
      g1,         g2,     L,
      route_list, routes, cta,
      ctas,       warp,   {RoundsOf<0>(L, routes, cta, ctas), RoundsOf<1>(L, routes, cta, ctas)}};

  // Lane 0: the first `stages` steps' copies (the weights need nothing from the prologue).
  const uint64_t policy = L2Policy(true);
  StepCursor<Fmt> issue;
  auto issue_into = [&](int slot) {
    if (!issue.valid) return;
    const int cnt = issue.step + 1 < issue.steps ? kGroup : issue.cnt_last;
    const uint32_t bar = bars + 8 * slot;
    const uint32_t dst = ring + slot * slot_bytes;
    MbarrierArriveExpectTx(bar, static_cast<uint32_t>(cnt * kChunkAll));
    BulkCopyToShared(dst, issue.values, cnt * kChunkBytes, bar, policy);
    BulkCopyToShared(dst + kGroup * kChunkBytes, issue.scales, cnt * kScaleBytes, bar, policy);
    issue.Next(ctx);
  };
  if (lane == 0) {
    issue.Next(ctx);
    for (int s = 0; s < stages; ++s) issue_into(s);
  }

  WaitForPrerequisites();  // the prologue's staged rows and zeroed counters
  Trace(p, 0);
  const int x_vectors_per_row = g1.chunks * kActChunkVectors;
  const int act_vectors_per_row = g2.chunks * kActChunkVectors;
  {
    const int vectors = g1.direct_tokens * x_vectors_per_row;
    const uint4* src = reinterpret_cast<const uint4*>(g1.b_rows);
    uint4* dst = reinterpret_cast<uint4*>(smem + L.x_off);
    for (int i = static_cast<int>(threadIdx.x); i < vectors; i += kThreads) {
      dst[i] = LoadCoherent(src + i);
    }
  }
  CtaBarrier();
  Trace(p, 1);
  float* red = reinterpret_cast<float*>(smem + L.red_off);
  const uint32_t x_at = smem_at + L.x_off + 2 * t * 16;
  const uint32_t act_at = smem_at + L.act_off + 2 * t * 16;
  const uint32_t zero_at = smem_at + L.zero_off + 2 * t * 16;
  const uint32_t my_v = lane * 16;
  const uint32_t my_s = kGroup * kChunkBytes + g * static_cast<int>(sizeof(Scale));
  int slot = 0;
  uint32_t parity = 0;
  auto consume = [&](auto ph_c) {
    constexpr int kPh = decltype(ph_c)::value;
    const ExpertGemmParams& gp = kPh == 0 ? g1 : g2;
    const int ks = L.ks[kPh];
    for (int round = 0; round < ctx.rounds[kPh]; ++round) {
      const Slice sl = SliceOf<kPh>(L, gp.chunks, gp.tiles, routes, cta, ctas, round, warp);
      const int route = sl.active ? route_list[1 + sl.route_index] : 0;
      const int expert = sl.active ? route_list[1 + kMaxLayerRoutes + sl.route_index] : 0;
      const int token = DirectToken(g1, route);
      if (sl.active && sl.part == 0) {
        // The epilogue's scalars into L1 while the slice streams.
        PrefetchL1(gp.ep_scale + expert * 3);
        if constexpr (kPh == 0) {
          const int64_t at =
              static_cast<int64_t>(expert) * g1.out_valid + min(sl.tile * 8 + g, g1.out_valid - 1);
          PrefetchL1(g1.bias_a + at);
          PrefetchL1(g1.bias_b + at);
        } else {
          PrefetchL1(g2.bias_a + static_cast<int64_t>(expert) * g2.out_valid +
                     min(sl.tile * kTileRows + g, g2.out_valid - 1));
          PrefetchL1(g2.fold_ids + token * g2.fold_top_k);
        }
      }
      // B row in shared memory: GEMM1 the route's token's hidden row, GEMM2 the route's act row;
      // lanes g > 0 (MMA columns without a token) read zeros and stay there.
      uint32_t b_row = kPh == 0 ? x_at + token * x_vectors_per_row * 16
                                : act_at + sl.route_index * act_vectors_per_row * 16;
      b_row += sl.k0 * kActChunkVectors * 16;
      if (g != 0) b_row = zero_at;
      const uint32_t b_step = g == 0 ? kActChunkVectors * 16 : 0;
      // Two accumulators (k-steps 0-1 and 2-3 of each chunk) halve the chain of dependent MMAs.
      // (Four, with the loads of two chunks first, measured no faster and spilled for NVFP4.)
      float acc[1][1][4], acc_hi[1][1][4];
      ZeroAccumulators<1, 1>(acc);
      ZeroAccumulators<1, 1>(acc_hi);
      const int len = sl.active ? sl.len : 0;
      for (int done = 0; done < len; done += kGroup) {
        const int cnt = min(kGroup, len - done);
        MbarrierWait(bars + 8 * slot, parity);
        const uint32_t base = ring + slot * slot_bytes;
#pragma unroll
        for (int c = 0; c < kGroup; ++c) {
          if (c >= cnt) break;
          uint4 v[1], b_lo[1], b_hi[1];
          Scale sc[1];
          v[0] = LoadShared16(base + my_v + c * kChunkBytes);
          sc[0] = LoadScale<Scale>(base + my_s + c * kScaleBytes);
          // One token per route: column 0 of the MMA's N.
          b_lo[0] = LoadShared16(b_row);
          b_hi[0] = LoadShared16(b_row + 16);
          b_row += b_step;
          MultiplyHalfChunk<Fmt, 1, 1>(v, sc, 0, b_lo, acc);
          MultiplyHalfChunk<Fmt, 1, 1>(v, sc, 1, b_hi, acc_hi);
        }
        __syncwarp();  // every lane is done with the slot
        if (lane == 0) issue_into(slot);
        if (++slot == stages) {
          slot = 0;
          parity ^= 1u;
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][0][e] += acc_hi[0][0][e];
      // K-split partial sums, added in warp order by part 0.
      if (ks > 1) {
        if (sl.part > 0) {
#pragma unroll
          for (int e = 0; e < 4; ++e) red[(warp * 4 + e) * kWarpLanes + lane] = acc[0][0][e];
        }
        CtaBarrier();
        if (sl.part == 0) {
          for (int k = 1; k < ks; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[0][0][e] += red[((warp + k) * 4 + e) * kWarpLanes + lane];
            }
          }
        }
        CtaBarrier();
      }
      if (!sl.active || sl.part != 0) continue;
      const ExpertItem item{expert, route, 1, 0};
      if constexpr (kPh == 0) {
        EpilogueAct<1, 1>(g1, item, sl.tile, lane, acc);
        __threadfence();
        __syncwarp();
        if (lane == 0) AddRelease(p.ready + sl.route_index, 1);
      } else {
        EpilogueY<1, 1>(g2, item, sl.tile, lane, acc);
        __threadfence();  // this lane's y stores, before the counts
        FoldCombine(g2, token, sl.tile, lane);
      }
    }
  };
  consume(Ph0{});
  Trace(p, 2);
  // Every route's act columns, from every CTA: wait, then copy them into shared memory.
  if (warp == 0) {
    const int want = L.tiles[0];
    for (int i = lane; i < routes; i += kWarpLanes) {
      while (static_cast<int>(LoadAcquire(p.ready + i)) < want) __nanosleep(32);
    }
  }
  CtaBarrier();
  Trace(p, 3);
  {
    const int vectors = routes * act_vectors_per_row;
    uint4* dst = reinterpret_cast<uint4*>(smem + L.act_off);
    for (int i = static_cast<int>(threadIdx.x); i < vectors; i += kThreads) {
      const int ri = i / act_vectors_per_row;
      const int64_t row = route_list[1 + ri];
      dst[i] = __ldcg(reinterpret_cast<const uint4*>(g2.b_rows) + row * act_vectors_per_row +
                      (i - ri * act_vectors_per_row));
    }
  }
  CtaBarrier();
  Trace(p, 4);
  consume(Ph1{});
  Trace(p, 5);
}

// ---- Warp ranges (ExpertLayerParams::ranges): the same work split without rounds or K-split
// barriers. Each GEMM's chunks (routes x packed tiles x chunks, route-major, then tile, then K)
// are cut into one contiguous range per warp (the warps ordered warp-major across the CTAs, so
// neighbouring ranges run on different SMs); a warp streams its GEMM1 range, then its GEMM2
// range, through its ring without pausing at tile boundaries. A tile cut between warps is
// finished by the last of them to arrive: each piece's accumulators go to a per-warp slot in
// global memory, a counter per tile (indexed by the tile's first warp) counts the pieces, and
// the warp that completes it adds the pieces in warp order (bitwise repeatable) and runs the
// epilogue. GEMM2's pieces wait for their route's GEMM1 tiles (ready[route], acquire) before
// reading its act row; nothing waits for a whole CTA.
constexpr int kRangeMinChunks = 4;  // fewer chunks per warp leave warps without a range
constexpr int kRangeWarps = 16;     // warps per CTA: up to 128 registers
static_assert(kRangeWarps <= kExpertLayerWarps, "the scratch is sized for kExpertLayerWarps");

// One GEMM's chunks over the warps: warp w streams [Begin(w), Begin(w + 1)).
struct RangeSplit {
  int64_t units = 0;  // routes * tiles * chunks
  int warps = 1;      // warps with a range
  int tiles = 0, chunks = 0;
  __device__ __forceinline__ int64_t Begin(int w) const { return units * w / warps; }
  // The warp whose range holds chunk u.
  __device__ __forceinline__ int WarpOf(int64_t u) const {
    return static_cast<int>(((u + 1) * warps - 1) / units);
  }
};
__device__ __forceinline__ RangeSplit SplitOf(const ExpertGemmParams& g, int routes,
                                              int all_warps) {
  RangeSplit s;
  s.tiles = g.tiles;
  s.chunks = g.chunks;
  s.units = static_cast<int64_t>(routes) * g.tiles * g.chunks;
  s.warps = static_cast<int>(
      max(int64_t{1}, min(static_cast<int64_t>(all_warps), s.units / kRangeMinChunks)));
  return s;
}

// A position in a warp's range: route index, tile, chunk in the tile, chunks left.
struct RangePos {
  int ri = 0, tile = 0, k = 0;
  int64_t left = 0;
  __device__ __forceinline__ void Start(const RangeSplit& s, int w) {
    left = 0;
    if (w >= s.warps || s.units == 0) return;
    const int64_t u = s.Begin(w);
    left = s.Begin(w + 1) - u;
    const int64_t per_route = static_cast<int64_t>(s.tiles) * s.chunks;
    ri = static_cast<int>(u / per_route);
    const int rem = static_cast<int>(u - ri * per_route);
    tile = rem / s.chunks;
    k = rem - tile * s.chunks;
  }
  // Chunks of the piece (the rest of this tile within the range).
  __device__ __forceinline__ int PieceLen(const RangeSplit& s) const {
    return static_cast<int>(min(left, static_cast<int64_t>(s.chunks - k)));
  }
  __device__ __forceinline__ void Advance(const RangeSplit& s, int n) {
    k += n;
    left -= n;
    if (k == s.chunks) {
      k = 0;
      if (++tile == s.tiles) {
        tile = 0;
        ++ri;
      }
    }
  }
};

struct RangeCursor {
  RangePos pos;
  int ph;
};
static_assert(kGroup % 2 == 0, "the B ping-pong needs an even group");
static_assert(sizeof(RangeCursor) <= 32, "LayerLayout::cursor_off holds 32 bytes per warp");

// B fragments of one chunk (two 16-byte vectors) where `pred` (else lo and hi keep their
// values): GEMM1 through L1, GEMM2 (act rows written by other CTAs of the grid) from L2.
template <int kPh>
__device__ __forceinline__ void LoadBPair(bool pred, const uint4* p, uint4& lo, uint4& hi) {
  if constexpr (kPh == 0) {
    asm volatile(
        "{\n .reg .pred q;\n setp.ne.b32 q, %8, 0;\n"
        " @q ld.global.v4.u32 {%0, %1, %2, %3}, [%9];\n"
        " @q ld.global.v4.u32 {%4, %5, %6, %7}, [%9+16];\n}"
        : "+r"(lo.x), "+r"(lo.y), "+r"(lo.z), "+r"(lo.w), "+r"(hi.x), "+r"(hi.y), "+r"(hi.z),
          "+r"(hi.w)
        : "r"(static_cast<int>(pred)), "l"(p));
  } else {
    asm volatile(
        "{\n .reg .pred q;\n setp.ne.b32 q, %8, 0;\n"
        " @q ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%9];\n"
        " @q ld.global.cg.v4.u32 {%4, %5, %6, %7}, [%9+16];\n}"
        : "+r"(lo.x), "+r"(lo.y), "+r"(lo.z), "+r"(lo.w), "+r"(hi.x), "+r"(hi.y), "+r"(hi.z),
          "+r"(hi.w)
        : "r"(static_cast<int>(pred)), "l"(p));
  }
}

template <class Fmt, bool kLight>
__global__ void __launch_bounds__(kRangeWarps * kWarpLanes, 1)
    ExpertLayerRangesKernel(const ExpertLayerParams p, const LayerLayout L) {
  using Scale = typename Fmt::Scale;
  constexpr int kScaleBytes = 8 * static_cast<int>(sizeof(Scale));
  constexpr int kChunkAll = kChunkBytes + kScaleBytes;
  using Ph0 = std::integral_constant<int, 0>;
  using Ph1 = std::integral_constant<int, 1>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int cta = static_cast<int>(blockIdx.x), ctas = static_cast<int>(gridDim.x);
  const int all_warps = ctas * kRangeWarps;
  const int gw = warp * ctas + cta;
  const ExpertGemmParams& g1 = p.g1;
  const ExpertGemmParams& g2 = p.g2;
  const int stages = L.stages, slot_bytes = L.slot_bytes;
  int32_t* route_list = reinterpret_cast<int32_t*>(smem + L.route_off);
  const uint32_t smem_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t ring = smem_at + warp * stages * slot_bytes;
  const uint32_t bars = smem_at + L.bar_off + warp * kMaxStages * 8;

  if (threadIdx.x == 0) {  // as ExpertLayerKernel
    const int total = g1.direct_tokens * (g1.direct_top_k + g1.direct_shared);
    int n = 0;
    for (int r = 0; r < total && n < kMaxLayerRoutes; ++r) {
      const int expert = DirectExpert(g1, r);
      if (expert < 0) continue;
      route_list[1 + n] = r;
      route_list[1 + kMaxLayerRoutes + n] = expert;
      ++n;
    }
    route_list[0] = n;
  }
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) MbarrierInit(bars + 8 * s, 1);
    FenceMbarrierInit();
  }
  __syncthreads();
  const int routes = route_list[0];
  if (routes == 0) return;
  const RangeSplit split[2] = {SplitOf(g1, routes, all_warps), SplitOf(g2, routes, all_warps)};
  int32_t* const piece_counts = p.ready + kMaxLayerRoutes;

  // Lane 0's copy cursor (GEMM1's range, then GEMM2's), kept in shared memory: lane 0 touches it
  // once per step, and the main loop's registers stay free.
  const uint64_t policy = L2Policy(true);
  RangeCursor& cur = reinterpret_cast<RangeCursor*>(smem + L.cursor_off)[warp];
  RangePos& issue = cur.pos;
  auto issue_next_phase = [&] {
    while (issue.left == 0 && cur.ph < 2) {
      if (++cur.ph < 2) issue.Start(split[1], gw);
    }
  };
  auto issue_step = [&](auto ph_c, int slot) {
    constexpr int kPh = decltype(ph_c)::value;
    const ExpertGemmParams& gp = kPh == 0 ? g1 : g2;
    const RangeSplit& s = split[kPh];
    const int cnt = min(kGroup, issue.PieceLen(s));
    const int expert = route_list[1 + kMaxLayerRoutes + issue.ri];
    const int64_t chunk0 = static_cast<int64_t>(issue.tile) * gp.chunks + issue.k;
    const uint4* values = static_cast<const uint4*>(gp.values) + expert * gp.values_expert_stride +
                          chunk0 * kWarpLanes;
    const Scale* scales =
        static_cast<const Scale*>(gp.scales) + expert * gp.scales_expert_stride + chunk0 * 8;
    const uint32_t bar = bars + 8 * slot;
    const uint32_t dst = ring + slot * slot_bytes;
    MbarrierArriveExpectTx(bar, static_cast<uint32_t>(cnt * kChunkAll));
    BulkCopyToShared(dst, values, cnt * kChunkBytes, bar, policy);
    BulkCopyToShared(dst + kGroup * kChunkBytes, scales, cnt * kScaleBytes, bar, policy);
    issue.Advance(s, cnt);
  };
  auto issue_into = [&](int slot) {
    if (cur.ph >= 2) return;
    if (cur.ph == 0) {
      issue_step(Ph0{}, slot);
    } else {
      issue_step(Ph1{}, slot);
    }
    issue_next_phase();
  };
  if (lane == 0) {
    cur.ph = 0;
    issue.Start(split[0], gw);
    issue_next_phase();
    for (int s = 0; s < stages; ++s) issue_into(s);
  }

  WaitForPrerequisites();  // the prologue's staged rows and zeroed counters
  Trace(p, 0);
  Trace(p, 1);
  const int x_vectors_per_row = g1.chunks * kActChunkVectors;
  const int act_vectors_per_row = g2.chunks * kActChunkVectors;
  const uint32_t my_v = lane * 16;
  const uint32_t my_s = kGroup * kChunkBytes + g * static_cast<int>(sizeof(Scale));
  int slot = 0;
  uint32_t parity = 0, slot_at = ring, bar_at = bars;
  const bool b_lanes = g == 0;  // MMA column 0: the route's one token
  uint64_t routes_ready = 0;  // GEMM2: routes whose act rows this warp has waited for
  auto consume = [&](auto ph_c) {
    constexpr int kPh = decltype(ph_c)::value;
    const ExpertGemmParams& gp = kPh == 0 ? g1 : g2;
    const RangeSplit& s = split[kPh];
    RangePos pos;
    pos.Start(s, gw);
    bool first_piece = true;
    while (pos.left > 0) {
      const int len = pos.PieceLen(s);
      const int ri = pos.ri, tile = pos.tile;
      const int route = route_list[1 + ri];
      const int expert = route_list[1 + kMaxLayerRoutes + ri];
      const int token = DirectToken(g1, route);
      PrefetchL1(gp.ep_scale + expert * 3);
      if constexpr (kPh == 0) {
        const int64_t at =
            static_cast<int64_t>(expert) * g1.out_valid + min(tile * 8 + g, g1.out_valid - 1);
        PrefetchL1(g1.bias_a + at);
        PrefetchL1(g1.bias_b + at);
      } else {
        PrefetchL1(g2.bias_a + static_cast<int64_t>(expert) * g2.out_valid +
                   min(tile * kTileRows + g, g2.out_valid - 1));
        PrefetchL1(g2.fold_ids + token * g2.fold_top_k);
        if (((routes_ready >> ri) & 1u) == 0) {  // ri < kMaxLayerRoutes = 64
          // Every GEMM1 tile of the route has written its act columns.
          if (lane == 0) {
            while (LoadRelaxed(p.ready + ri) < L.tiles[0]) __nanosleep(32);
            (void)LoadAcquire(p.ready + ri);
          }
          __syncwarp();
          routes_ready |= uint64_t{1} << ri;
        }
      }
      // B: GEMM1 the token's staged hidden row, GEMM2 the route's act row (written by other
      // CTAs of this grid: read from L2); lanes g > 0 (MMA columns without a token) use zeros.
      const uint4* b_at =
          (kPh == 0 ? reinterpret_cast<const uint4*>(g1.b_rows) +
                          static_cast<int64_t>(token) * x_vectors_per_row
                    : reinterpret_cast<const uint4*>(g2.b_rows) +
                          static_cast<int64_t>(route) * act_vectors_per_row) +
          pos.k * kActChunkVectors + 2 * t;
      float acc[1][1][4], acc_hi[1][1][4];
      ZeroAccumulators<1, 1>(acc);
      ZeroAccumulators<1, 1>(acc_hi);
      // Ping-pong B buffers (a group has an even number of chunks, so chunk i uses b[i & 1]).
      // Lanes g > 0 keep zeros: MMA columns 1..7 have no token (their sums are never read).
      uint4 b[2][2][1];
#pragma unroll
      for (int i = 0; i < 2; ++i) b[i][0][0] = b[i][1][0] = make_uint4(0, 0, 0, 0);
      LoadBPair<kPh>(b_lanes, b_at, b[0][0][0], b[0][1][0]);
      for (int done = 0; done < len; done += kGroup) {
        const int cnt = min(kGroup, len - done);
        MbarrierWait(bar_at, parity);
#pragma unroll
        for (int c = 0; c < kGroup; ++c) {
          if (c >= cnt) break;
          uint4 v[1];
          Scale sc[1];
          v[0] = LoadShared16(slot_at + my_v + c * kChunkBytes);
          sc[0] = LoadScale<Scale>(slot_at + my_s + c * kScaleBytes);
          b_at += kActChunkVectors;
          LoadBPair<kPh>(b_lanes && done + c + 1 < len, b_at, b[(c + 1) & 1][0][0],
                         b[(c + 1) & 1][1][0]);
          MultiplyHalfChunk<Fmt, 1, 1>(v, sc, 0, b[c & 1][0], acc);
          MultiplyHalfChunk<Fmt, 1, 1>(v, sc, 1, b[c & 1][1], acc_hi);
        }
        __syncwarp();  // every lane is done with the slot
        if (lane == 0) issue_into(slot);
        slot_at += slot_bytes;
        bar_at += 8;
        if (++slot == stages) {
          slot = 0;
          slot_at = ring;
          bar_at = bars;
          parity ^= 1u;
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][0][e] += acc_hi[0][0][e];
      const bool mine_first = first_piece;
      first_piece = false;
      pos.Advance(s, len);
      if (len != s.chunks) {
        // A tile cut between warps: hand in this piece; the last piece's warp adds them all.
        const int64_t tile_u = (static_cast<int64_t>(ri) * s.tiles + tile) * s.chunks;
        const int wf = s.WarpOf(tile_u), wl = s.WarpOf(tile_u + s.chunks - 1);
        float4* const parts = reinterpret_cast<float4*>(p.partials) + static_cast<int64_t>(kPh) * all_warps * 2 * kWarpLanes;
        __stcg(parts + (static_cast<int64_t>(gw) * 2 + (mine_first ? 0 : 1)) * kWarpLanes + lane,
               make_float4(acc[0][0][0], acc[0][0][1], acc[0][0][2], acc[0][0][3]));
        if (!kLight) __threadfence();
        __syncwarp();
        int arrived = 0;
        if (lane == 0) {
          arrived = kLight ? AddAcqRel(piece_counts + kPh * all_warps + wf, 1)
                           : atomicAdd(piece_counts + kPh * all_warps + wf, 1);
        }
        arrived = __shfl_sync(0xffffffffu, arrived, 0);
        if (arrived != wl - wf) continue;
        if (!kLight) __threadfence();  // the other pieces' stores, before the reads below
        __syncwarp();
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = wf; w <= wl; ++w) {
          float4 x;
          if (w == gw) {
            x = make_float4(acc[0][0][0], acc[0][0][1], acc[0][0][2], acc[0][0][3]);
          } else {
            const int piece_slot = s.Begin(w) >= tile_u ? 0 : 1;
            x = __ldcg(parts + (static_cast<int64_t>(w) * 2 + piece_slot) * kWarpLanes + lane);
          }
          sum[0] += x.x;
          sum[1] += x.y;
          sum[2] += x.z;
          sum[3] += x.w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][0][e] = sum[e];
      }
      const ExpertItem item{expert, route, 1, 0};
      if constexpr (kPh == 0) {
        EpilogueAct<1, 1>(g1, item, tile, lane, acc);
        if (!kLight) __threadfence();
        __syncwarp();
        if (lane == 0) AddRelease(p.ready + ri, 1);
      } else {
        EpilogueY<1, 1>(g2, item, tile, lane, acc);
        __threadfence();  // this lane's y stores, before the counts
        FoldCombine(g2, token, tile, lane);
      }
    }
  };
  consume(Ph0{});
  // GEMM1 tiles past the packed ones (zero act columns, L.tiles[0] > g1.tiles): no weights,
  // only the epilogue, spread over the warps.
  {
    const int extra = L.tiles[0] - g1.tiles;
    for (int x = gw; x < routes * extra; x += all_warps) {
      const int ri = x / extra;
      float acc[1][1][4];
      ZeroAccumulators<1, 1>(acc);
      const ExpertItem item{route_list[1 + kMaxLayerRoutes + ri], route_list[1 + ri], 1, 0};
      EpilogueAct<1, 1>(g1, item, g1.tiles + (x - ri * extra), lane, acc);
      __threadfence();
      __syncwarp();
      if (lane == 0) AddRelease(p.ready + ri, 1);
    }
  }
  Trace(p, 2);
  Trace(p, 3);
  Trace(p, 4);
  consume(Ph1{});
  Trace(p, 5);
}

int Align128(int64_t bytes) { return static_cast<int>((bytes + 127) / 128 * 128); }

struct DeviceLimits {
  int sms = 0;
  int smem = 0;
};

// The current device's SM count and opt-in shared memory per block (cached per device).
bool Limits(DeviceLimits& out) {
  static std::atomic<uint64_t> cached[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < 64) {
    const uint64_t c = cached[device].load(std::memory_order_acquire);
    if (c != 0) {
      out.sms = static_cast<int>(c >> 32);
      out.smem = static_cast<int>(c & 0xffffffffu);
      return true;
    }
  }
  if (cudaDeviceGetAttribute(&out.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&out.smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return false;
  }
  if (device < 64) {
    cached[device].store((static_cast<uint64_t>(out.sms) << 32) | static_cast<uint32_t>(out.smem),
                         std::memory_order_release);
  }
  return true;
}

// The layout for these sizes, or false when it does not fit.
bool PlanLayout(Fp4Format format, int tokens, int routes, int hidden_chunks, int act_cols,
                int w13_tiles, int w2_tiles, int w2_chunks, const DeviceLimits& dev, bool ranges,
                LayerLayout& L) {
  if (tokens <= 0 || routes <= 0 || routes > kMaxLayerRoutes || dev.sms <= 0) return false;
  if (act_cols % kChunkK != 0 || w2_chunks * kChunkK != act_cols) return false;
  const int scale_bytes = 8 * (format == Fp4Format::kMxfp4 ? 4 : 16);
  L.tiles[0] = act_cols / 8;
  L.tiles[1] = w2_tiles;
  if (w13_tiles > L.tiles[0]) return false;
  const int chunks[2] = {hidden_chunks, w2_chunks};
  for (int ph = 0; ph < 2; ++ph) {
    const int64_t units = static_cast<int64_t>(routes) * L.tiles[ph];
    const int64_t per_cta = (units + dev.sms - 1) / dev.sms;
    // As many slices per tile as leave no warp idle in a CTA's first round, each of at least
    // 8 chunks.
    int ks = 1;
    while (ks * 2 * per_cta <= kWarps && chunks[ph] / (ks * 2) >= 8) ks *= 2;
    L.ks[ph] = ks;
    L.tpr[ph] = kWarps / ks;
  }
  L.slot_bytes = kGroup * (kChunkBytes + scale_bytes);
  int at = 0;
  // Warp ranges read the B rows from global memory and add no slices in shared memory.
  L.x_off = at;
  if (!ranges) at += Align128(static_cast<int64_t>(tokens) * hidden_chunks * kChunkK * 2);
  L.act_off = at;
  if (!ranges) at += Align128(static_cast<int64_t>(routes) * act_cols * 2);
  L.red_off = at;
  at += !ranges && (L.ks[0] > 1 || L.ks[1] > 1) ? kWarps * 4 * kWarpLanes * 4 : 0;
  L.bar_off = at;
  const int warps = ranges ? kRangeWarps : kWarps;
  at += warps * kMaxStages * 8;
  L.route_off = at;
  at += Align128((2 * kMaxLayerRoutes + 1) * 4);
  L.zero_off = at;
  at += 128;
  L.cursor_off = at;
  at += ranges ? kExpertLayerWarps * 32 : 0;
  const int room = dev.smem - at;
  L.stages = std::min(kMaxStages, room / (warps * L.slot_bytes));
  if (L.stages < kMinStages) return false;
  // The rings first (the bulk copies' destinations are then 128-byte aligned).
  const int stage_bytes = warps * L.stages * L.slot_bytes;
  L.x_off += stage_bytes;
  L.act_off += stage_bytes;
  L.red_off += stage_bytes;
  L.bar_off += stage_bytes;
  L.route_off += stage_bytes;
  L.zero_off += stage_bytes;
  L.cursor_off += stage_bytes;
  L.smem_bytes = at + stage_bytes;
  return L.smem_bytes <= dev.smem;
}

cudaError_t ConfigureKernels(int smem) {
  for (auto kernel : {&ExpertLayerKernel<Mxfp4>, &ExpertLayerKernel<Nvfp4>,
                      &ExpertLayerRangesKernel<Mxfp4, false>, &ExpertLayerRangesKernel<Nvfp4, false>,
                      &ExpertLayerRangesKernel<Mxfp4, true>, &ExpertLayerRangesKernel<Nvfp4, true>}) {
    if (cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

}  // namespace

bool ExpertLayerFits(Fp4Format format, int tokens, int routes, int hidden_chunks, int act_cols,
                     int w13_tiles, int w2_tiles, int w2_chunks, int* sms, bool ranges) {
  DeviceLimits dev;
  LayerLayout L;
  if (!Limits(dev)) return false;
  if (sms != nullptr) *sms = dev.sms;
  return PlanLayout(format, tokens, routes, hidden_chunks, act_cols, w13_tiles, w2_tiles, w2_chunks,
                    dev, ranges, L);
}

int64_t ExpertLayerCounterWords() {
  DeviceLimits dev;
  if (!Limits(dev)) return 0;
  return kMaxLayerRoutes + 2 * static_cast<int64_t>(dev.sms) * kWarps;
}

int64_t ExpertLayerPartialFloats() {
  DeviceLimits dev;
  if (!Limits(dev)) return 0;
  // [GEMM][warp][first or last piece of its range][lane][4]
  return 2 * static_cast<int64_t>(dev.sms) * kWarps * 2 * kWarpLanes * 4;
}

cudaError_t LaunchExpertLayer(const ExpertLayerParams& p, Fp4Format format, bool programmatic,
                              cudaStream_t stream) {
  const ExpertGemmParams& g1 = p.g1;
  const ExpertGemmParams& g2 = p.g2;
  if (g1.direct_ids == nullptr || g2.fold_counters == nullptr || p.ready == nullptr ||
      (p.ranges != 0 && p.partials == nullptr)) {
    return cudaErrorInvalidValue;
  }
  DeviceLimits dev;
  if (!Limits(dev)) return cudaErrorInvalidDevice;
  const int routes = ExpertLayerRoutes(g1.direct_tokens, g1.direct_top_k, g1.direct_shared);
  LayerLayout L;
  if (!PlanLayout(format, g1.direct_tokens, routes, g1.chunks, g1.out_cols, g1.tiles, g2.tiles,
                  g2.chunks, dev, p.ranges != 0, L)) {
    return cudaErrorInvalidValue;
  }
  static std::atomic<uint64_t> configured{0};
  if (cudaError_t e = OncePerDevice(configured, [&] { return ConfigureKernels(dev.smem); });
      e != cudaSuccess) {
    return e;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(dev.sms));
  config.blockDim = dim3(p.ranges != 0 ? kRangeWarps * kWarpLanes : kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(L.smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  attr[n].id = cudaLaunchAttributeCooperative;
  attr[n].val.cooperative = 1;
  ++n;
  if (programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  if (p.ranges != 0) {
    const bool light = p.ranges == 2;
    const bool mx = format == Fp4Format::kMxfp4;
    return light ? (mx ? cudaLaunchKernelEx(&config, &ExpertLayerRangesKernel<Mxfp4, true>, p, L)
                       : cudaLaunchKernelEx(&config, &ExpertLayerRangesKernel<Nvfp4, true>, p, L))
                 : (mx ? cudaLaunchKernelEx(&config, &ExpertLayerRangesKernel<Mxfp4, false>, p, L)
                       : cudaLaunchKernelEx(&config, &ExpertLayerRangesKernel<Nvfp4, false>, p, L));
  }
  return format == Fp4Format::kMxfp4 ? cudaLaunchKernelEx(&config, &ExpertLayerKernel<Mxfp4>, p, L)
                                     : cudaLaunchKernelEx(&config, &ExpertLayerKernel<Nvfp4>, p, L);
}

}  // namespace moe::cuda
