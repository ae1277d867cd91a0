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
constexpr int kWarps = 24;      // 768 threads: up to 80 registers
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
                int w13_tiles, int w2_tiles, int w2_chunks, const DeviceLimits& dev,
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
  L.x_off = at;
  at += Align128(static_cast<int64_t>(tokens) * hidden_chunks * kChunkK * 2);
  L.act_off = at;
  at += Align128(static_cast<int64_t>(routes) * act_cols * 2);
  L.red_off = at;
  at += (L.ks[0] > 1 || L.ks[1] > 1) ? kWarps * 4 * kWarpLanes * 4 : 0;
  L.bar_off = at;
  at += kWarps * kMaxStages * 8;
  L.route_off = at;
  at += Align128((2 * kMaxLayerRoutes + 1) * 4);
  L.zero_off = at;
  at += 128;
  const int room = dev.smem - at;
  L.stages = std::min(kMaxStages, room / (kWarps * L.slot_bytes));
  if (L.stages < kMinStages) return false;
  // The rings first (the bulk copies' destinations are then 128-byte aligned).
  const int stage_bytes = kWarps * L.stages * L.slot_bytes;
  L.x_off += stage_bytes;
  L.act_off += stage_bytes;
  L.red_off += stage_bytes;
  L.bar_off += stage_bytes;
  L.route_off += stage_bytes;
  L.zero_off += stage_bytes;
  L.smem_bytes = at + stage_bytes;
  return L.smem_bytes <= dev.smem;
}

cudaError_t ConfigureKernels(int smem) {
  for (auto kernel : {&ExpertLayerKernel<Mxfp4>, &ExpertLayerKernel<Nvfp4>}) {
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
                     int w13_tiles, int w2_tiles, int w2_chunks, int* sms) {
  DeviceLimits dev;
  LayerLayout L;
  if (!Limits(dev)) return false;
  if (sms != nullptr) *sms = dev.sms;
  return PlanLayout(format, tokens, routes, hidden_chunks, act_cols, w13_tiles, w2_tiles, w2_chunks,
                    dev, L);
}

cudaError_t LaunchExpertLayer(const ExpertLayerParams& p, Fp4Format format, bool programmatic,
                              cudaStream_t stream) {
  const ExpertGemmParams& g1 = p.g1;
  const ExpertGemmParams& g2 = p.g2;
  if (g1.direct_ids == nullptr || g2.fold_counters == nullptr || p.ready == nullptr) {
    return cudaErrorInvalidValue;
  }
  DeviceLimits dev;
  if (!Limits(dev)) return cudaErrorInvalidDevice;
  const int routes = ExpertLayerRoutes(g1.direct_tokens, g1.direct_top_k, g1.direct_shared);
  LayerLayout L;
  if (!PlanLayout(format, g1.direct_tokens, routes, g1.chunks, g1.out_cols, g1.tiles, g2.tiles,
                  g2.chunks, dev, L)) {
    return cudaErrorInvalidValue;
  }
  static std::atomic<uint64_t> configured{0};
  if (cudaError_t e = OncePerDevice(configured, [&] { return ConfigureKernels(dev.smem); });
      e != cudaSuccess) {
    return e;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(dev.sms));
  config.blockDim = dim3(kThreads);
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
  return format == Fp4Format::kMxfp4 ? cudaLaunchKernelEx(&config, &ExpertLayerKernel<Mxfp4>, p, L)
                                     : cudaLaunchKernelEx(&config, &ExpertLayerKernel<Nvfp4>, p, L);
}

}  // namespace moe::cuda
