// Expert prologue (see expert_kernels.h): one launch whose first blocks (one, or up to
// kMaxGroupBlocks for big batches) group the routes by expert slot and cut each slot's tokens
// into items of tile_tokens, while the other blocks stage the hidden states as bf16 rows permuted
// per 64-element chunk (fp4_fragment.h ActPermIndex), zero-padded to whole chunks, unless GEMM1
// reads them in place (stage_hidden). Merging the two saves a launch at decode sizes.
//
// Slot positions inside one expert come from shared-memory atomics, so their order may differ
// between runs; no result depends on it (every route's GEMM column is computed independently and
// the combine reads y by route, in k order).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda {
namespace {

using detail::LoadAcquire;
using detail::StoreRelease;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStagingBlocks = 2048;

// Exclusive scan of two per-slot sequences (token counts and item counts) by one block: each
// thread owns a contiguous run of slots, warps scan the run totals, warp 0 scans warp totals.
__device__ void ScanSlots(const int32_t* count, int slots, int tile_tokens, int32_t* offset,
                          int32_t* item_offset, int2* warp_totals, int32_t* num_items) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per_thread = (slots + kThreads - 1) / kThreads;
  const int begin = min(slots, tid * per_thread), end = min(slots, begin + per_thread);
  int tokens = 0, items = 0;
  for (int e = begin; e < end; ++e) {
    tokens += count[e];
    items += (count[e] + tile_tokens - 1) / tile_tokens;
  }
  int inc_tokens = tokens, inc_items = items;
  for (int d = 1; d < 32; d <<= 1) {
    const int up_tokens = __shfl_up_sync(0xffffffffu, inc_tokens, d);
    const int up_items = __shfl_up_sync(0xffffffffu, inc_items, d);
    if (lane >= d) {
      inc_tokens += up_tokens;
      inc_items += up_items;
    }
  }
  if (lane == 31) warp_totals[warp] = make_int2(inc_tokens, inc_items);
  __syncthreads();
  if (warp == 0) {
    int2 v = lane < kWarps ? warp_totals[lane] : make_int2(0, 0);
    for (int d = 1; d < 32; d <<= 1) {
      const int ux = __shfl_up_sync(0xffffffffu, v.x, d);
      const int uy = __shfl_up_sync(0xffffffffu, v.y, d);
      if (lane >= d) {
        v.x += ux;
        v.y += uy;
      }
    }
    if (lane < kWarps) warp_totals[lane] = v;  // inclusive
    if (lane == kWarps - 1) *num_items = v.y;
  }
  __syncthreads();
  int run_tokens = inc_tokens - tokens + (warp > 0 ? warp_totals[warp - 1].x : 0);
  int run_items = inc_items - items + (warp > 0 ? warp_totals[warp - 1].y : 0);
  for (int e = begin; e < end; ++e) {
    offset[e] = run_tokens;
    item_offset[e] = run_items;
    run_tokens += count[e];
    run_items += (count[e] + tile_tokens - 1) / tile_tokens;
  }
}

// f(route, id) for every route, by the whole block. The ids are read 16 bytes at a time, four
// loads in flight per thread before any is used: one block walks all T x K routes (twice), and
// with one 4-byte load per step each walk took T x K / 512 load latencies (problem A at 8192
// tokens: the prologue measured 104 us before, 81 us with these loads; NOTES-cuda.md).
template <class F>
__device__ __forceinline__ void ForEachRoute(const int32_t* ids, int32_t routes, F&& f) {
  constexpr int kUnroll = 4;
  int32_t done = 0;
  if ((reinterpret_cast<uintptr_t>(ids) & 15) == 0) {
    const int32_t vectors = routes / 4;
    const int4* v = reinterpret_cast<const int4*>(ids);
    for (int32_t base = 0; base < vectors; base += kThreads * kUnroll) {
      int4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t j = base + u * kThreads + static_cast<int32_t>(threadIdx.x);
        r[u] = j < vectors ? __ldg(v + j) : make_int4(-1, -1, -1, -1);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t j = base + u * kThreads + static_cast<int32_t>(threadIdx.x);
        if (j >= vectors) continue;
        f(4 * j, r[u].x);
        f(4 * j + 1, r[u].y);
        f(4 * j + 2, r[u].z);
        f(4 * j + 3, r[u].w);
      }
    }
    done = vectors * 4;
  }
  for (int32_t i = done + static_cast<int32_t>(threadIdx.x); i < routes; i += kThreads) {
    f(i, __ldg(ids + i));
  }
}

// Item i of a slot with n tokens cut into items of at most `tile`: whole tiles then the rest,
// or (ExpertPrologueParams::even_items) ceil(n / tile) items whose sizes differ by at most one,
// so that a slot's items share a wgmma width class and sit side by side in the persistent
// schedule (their weights then come from L2 for all but the first).
__device__ __forceinline__ ExpertItem SlotItem(int e, int offset, int n, int i, int tile,
                                               bool even) {
  if (!even) return ExpertItem{e, offset + i * tile, min(tile, n - i * tile), 0};
  const int k = (n + tile - 1) / tile;
  const int begin = i * n / k, end = (i + 1) * n / k;
  return ExpertItem{e, offset + begin, end - begin, 0};
}

// The persistent wgmma schedule (ExpertPrologueParams::wg_sched): the items again, grouped by
// width class and in slot order inside a class (a stable partition: each thread counts the
// classes of a contiguous range of slots, then a block-wide scan per class), the classes'
// starts, and both GEMMs' claim counters zeroed. Called by the whole block that cut the items.
__device__ void WriteWidthSchedule(const ExpertPrologueParams& p, const int32_t* count,
                                   const int32_t* offset, int slots) {
  constexpr int C = kWgWidthClasses;
  __shared__ int32_t warp_base[kWarps][C];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (slots + kThreads - 1) / kThreads;
  const int e0 = min(slots, tid * per), e1 = min(slots, e0 + per);
  const auto for_each_item = [&](auto&& f) {
    for (int e = e0; e < e1; ++e) {
      const int n = count[e];
      for (int i = 0; i * p.tile_tokens < n; ++i) {
        f(SlotItem(e, offset[e], n, i, p.tile_tokens, p.even_items));
      }
    }
  };
  int local[C], before[C];
#pragma unroll
  for (int c = 0; c < C; ++c) local[c] = 0;
  for_each_item([&](const ExpertItem& it) {
    const int cls = WgmmaWidthClass(it.count);
#pragma unroll
    for (int c = 0; c < C; ++c) local[c] += c == cls ? 1 : 0;
  });
#pragma unroll
  for (int c = 0; c < C; ++c) {
    int v = local[c];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += up;
    }
    before[c] = v - local[c];  // this thread's exclusive prefix inside its warp
    if (lane == 31) warp_base[warp][c] = v;
  }
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int c = 0; c < C; ++c) {
      p.wg_sched[kWgSchedStarts + c] = run;
      for (int w = 0; w < kWarps; ++w) {
        const int t = warp_base[w][c];
        warp_base[w][c] = run;
        run += t;
      }
    }
    p.wg_sched[kWgSchedStarts + C] = run;
  }
  if (tid < 2 * kWgSchedClaimStride) p.wg_sched[kWgSchedClaims + tid] = 0;
  __syncthreads();
  int cursor[C];
#pragma unroll
  for (int c = 0; c < C; ++c) cursor[c] = warp_base[warp][c] + before[c];
  for_each_item([&](const ExpertItem& it) {
    const int cls = WgmmaWidthClass(it.count);
    int pos = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (c == cls) pos = cursor[c]++;
    }
    p.wg_items[pos] = it;
  });
}

// Block b of the G grouping blocks: counts its share of the routes (and of the tokens, for the
// shared experts), then, once every block's counts are in, scatters that share. With G = 1 the
// block does everything in shared memory. With G > 1 (group_scratch set) the last block to
// arrive scans the slot totals and cuts the items while the others wait for its generation
// word; every block's cursors then start at the slot offset plus the counts of the blocks before
// it. The blocks must run at the same time: at most kMaxGroupBlocks of them, launched first in the
// grid (the staging blocks after them never wait).
__device__ void GroupRoutes(const ExpertPrologueParams& p, int b, int G) {
  extern __shared__ int32_t smem[];
  __shared__ uint32_t generation;
  __shared__ bool last;
  const int slots = p.num_experts + p.num_shared;
  int32_t* count = smem;
  int32_t* offset = smem + slots;
  int32_t* item_offset = smem + 2 * slots;
  int2* warp_totals = reinterpret_cast<int2*>(smem + 3 * slots + (slots & 1));
  const int tid = threadIdx.x;
  // Route indices fit int32: the y rows (T x K plus the shared experts') are indexed by int32 in
  // slot_route.
  const int32_t routes = p.tokens * p.top_k;
  const bool shared = p.num_shared > 0 && p.shared_mask != nullptr;
  // This block's routes [r0, r1) (a multiple of 4 apart, so its ids stay 16-byte aligned) and
  // tokens [t0, t1) for the shared experts.
  const int32_t per = ((routes + G - 1) / G + 3) & ~3;
  const int32_t r0 = min(routes, b * per), r1 = min(routes, r0 + per);
  const int32_t per_token = (p.tokens + G - 1) / G;
  const int32_t t0 = min(p.tokens, b * per_token), t1 = min(p.tokens, t0 + per_token);
  int32_t* sync = p.group_scratch;  // [0] arrivals, [1] generation
  int32_t* slot_offset = sync + 2;
  int32_t* partial = slot_offset + slots;

  if (G > 1 && tid == 0) generation = LoadAcquire(sync + 1);
  for (int e = tid; e < slots; e += kThreads) count[e] = 0;
  __syncthreads();
  ForEachRoute(p.ids + r0, r1 - r0, [&](int32_t, int id) {
    if (id >= 0) atomicAdd(&count[id], 1);
  });
  if (shared) {
    for (int t = t0 + tid; t < t1; t += kThreads) {
      if (p.shared_mask[t] != 0) {
        for (int s = 0; s < p.num_shared; ++s) atomicAdd(&count[p.num_experts + s], 1);
      }
    }
  }
  __syncthreads();
  if (G > 1) {
    for (int e = tid; e < slots; e += kThreads) partial[b * slots + e] = count[e];
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(sync, 1) == G - 1;
    __syncthreads();
    if (last) {
      __threadfence();
      for (int e = tid; e < slots; e += kThreads) {
        int total = 0;
        for (int q = 0; q < G; ++q) total += __ldcg(partial + q * slots + e);
        count[e] = total;
      }
      __syncthreads();
    }
  }
  if (G == 1 || last) {
    ScanSlots(count, slots, p.tile_tokens, offset, item_offset, warp_totals, p.num_items);
    __syncthreads();
    for (int e = tid; e < slots; e += kThreads) {
      const int n = count[e];
      for (int i = 0; i * p.tile_tokens < n; ++i) {
        p.items[item_offset[e] + i] =
            SlotItem(e, offset[e], n, i, p.tile_tokens, p.even_items);
      }
      if (G > 1) slot_offset[e] = offset[e];
    }
    if (p.wg_sched != nullptr) WriteWidthSchedule(p, count, offset, slots);
    if (G > 1) {
      __threadfence();
      __syncthreads();
      if (tid == 0) {
        sync[0] = 0;  // every block has arrived; the next launch counts from zero
        StoreRelease(sync + 1, generation + 1);
      }
    }
  } else if (tid == 0) {
    while (LoadAcquire(sync + 1) == generation) __nanosleep(64);
  }
  __syncthreads();
  // The write cursors: the slot's offset, plus (G > 1) the counts of the blocks before this one.
  if (G == 1) {
    for (int e = tid; e < slots; e += kThreads) count[e] = offset[e];
  } else {
    for (int e = tid; e < slots; e += kThreads) {
      int base = __ldcg(slot_offset + e);
      for (int q = 0; q < b; ++q) base += __ldcg(partial + q * slots + e);
      count[e] = base;
    }
  }
  __syncthreads();
  ForEachRoute(p.ids + r0, r1 - r0, [&](int32_t i, int id) {
    if (id < 0) return;
    const int pos = atomicAdd(&count[id], 1);
    p.slot_token[pos] = (r0 + i) / p.top_k;
    p.slot_route[pos] = r0 + i;
  });
  if (shared) {
    for (int t = t0 + tid; t < t1; t += kThreads) {
      if (p.shared_mask[t] == 0) continue;
      for (int s = 0; s < p.num_shared; ++s) {
        const int pos = atomicAdd(&count[p.num_experts + s], 1);
        p.slot_token[pos] = t;
        p.slot_route[pos] = static_cast<int32_t>(routes + static_cast<int64_t>(s) * p.tokens + t);
      }
    }
  }
}

__device__ __forceinline__ uint32_t HiddenBf16(const ExpertPrologueParams& p, int64_t row_base,
                                               int k) {
  if (k >= p.hidden_size) return 0u;
  if (p.hidden_bf16) {
    const uint16_t bits = static_cast<const uint16_t*>(p.hidden)[row_base + k];
    if (p.x_prescale == 1.f) return bits;
    return __bfloat16_as_ushort(
        __float2bfloat16_rn(__bfloat162float(__ushort_as_bfloat16(bits)) * p.x_prescale));
  }
  return __bfloat16_as_ushort(
      __float2bfloat16_rn(static_cast<const float*>(p.hidden)[row_base + k] * p.x_prescale));
}

// One 16-byte vector of the staged row: vector w of chunk c holds, for lane t = w / 2 and
// k-steps 2u, 2u+1 (u = w % 2), the B register pairs (k, k+1) and (k+8, k+9), k = 16 step + 2t.
__device__ void StageHidden(const ExpertPrologueParams& p, int block, int blocks) {
  const int64_t vectors_per_row = static_cast<int64_t>(p.hidden_chunks) * kActChunkVectors;
  const int64_t total = vectors_per_row * p.tokens;
  uint4* out = reinterpret_cast<uint4*>(p.x_staged);
  for (int64_t idx = static_cast<int64_t>(block) * kThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blocks) * kThreads) {
    const int64_t token = idx / vectors_per_row;
    const int v = static_cast<int>(idx % vectors_per_row);
    const int chunk = v / kActChunkVectors, w = v % kActChunkVectors;
    const int lane_t = w >> 1, u = w & 1;
    const int64_t row_base = token * p.hidden_size;
    uint32_t words[4];
    if (p.natural_order) {  // elements 8 w .. 8 w + 7 of the chunk
      const int k = chunk * kChunkK + 8 * w;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        words[i] = HiddenBf16(p, row_base, k + 2 * i) | (HiddenBf16(p, row_base, k + 2 * i + 1) << 16);
      }
      out[idx] = make_uint4(words[0], words[1], words[2], words[3]);
      continue;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = chunk * kChunkK + (2 * u + half) * 16 + 2 * lane_t;
      words[2 * half] = HiddenBf16(p, row_base, k) | (HiddenBf16(p, row_base, k + 1) << 16);
      words[2 * half + 1] =
          HiddenBf16(p, row_base, k + 8) | (HiddenBf16(p, row_base, k + 9) << 16);
    }
    out[idx] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Zeros the output rows of tokens without routes (ExpertPrologueParams::zero_unrouted_out).
__device__ void ZeroUnroutedRows(const ExpertPrologueParams& p, int block, int blocks) {
  for (int t = block; t < p.tokens; t += blocks) {
    bool routed = p.num_shared > 0 && p.shared_mask != nullptr && p.shared_mask[t] != 0;
    for (int k = 0; k < p.top_k && !routed; ++k) routed = p.ids[t * p.top_k + k] >= 0;
    if (routed) continue;
    const int64_t row = static_cast<int64_t>(t) * p.hidden_size;
    for (int h = threadIdx.x; h < p.hidden_size; h += kThreads) {
      if (p.zero_unrouted_bf16) {
        static_cast<uint16_t*>(p.zero_unrouted_out)[row + h] = 0;
      } else {
        static_cast<float*>(p.zero_unrouted_out)[row + h] = 0.f;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) ExpertPrologueKernel(const ExpertPrologueParams p) {
  // GEMM1 may start launching now (it hides its launch latency behind this kernel); it reads
  // nothing of ours before its griddepcontrol.wait, which waits for this grid to complete.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < p.zero_word_count; i += kThreads) p.zero_words[i] = 0;
  }
  if (!p.group_routes) {
    if (p.stage_hidden) StageHidden(p, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
    if (p.zero_unrouted_out != nullptr) {
      ZeroUnroutedRows(p, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
    }
  } else if (static_cast<int>(blockIdx.x) < p.group_blocks) {
    GroupRoutes(p, static_cast<int>(blockIdx.x), p.group_blocks);
  } else {
    const int block = static_cast<int>(blockIdx.x) - p.group_blocks;
    const int blocks = static_cast<int>(gridDim.x) - p.group_blocks;
    if (p.stage_hidden) StageHidden(p, block, blocks);
    if (p.zero_unrouted_out != nullptr) ZeroUnroutedRows(p, block, blocks);
  }
}

}  // namespace

cudaError_t LaunchExpertPrologue(const ExpertPrologueParams& given, cudaStream_t stream) {
  const int slots = given.num_experts + given.num_shared;
  if (slots <= 0 || slots > kMaxPrologueSlots || given.tile_tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  ExpertPrologueParams p = given;
  // One grouping block per kRoutesPerGroupBlock routes, up to kMaxGroupBlocks, when the scratch
  // for their meeting is there (problem A at 4096 tokens: one block took ~40 us for 16384 routes,
  // bound by its shared-memory atomics and load latencies).
  const int64_t routes = static_cast<int64_t>(p.tokens) * p.top_k;
  p.group_blocks = !p.group_routes ? 0
                   : p.group_scratch == nullptr
                       ? 1
                       : static_cast<int32_t>(std::clamp<int64_t>(
                             (routes + kRoutesPerGroupBlock - 1) / kRoutesPerGroupBlock, 1,
                             kMaxGroupBlocks));
  // Blocks besides the grouping blocks: enough for the staging (vectors of the rows), or, when
  // nothing is staged, one per 64 tokens for the unrouted rows' zeros, or none.
  const int64_t vectors = p.stage_hidden ? static_cast<int64_t>(p.hidden_chunks) *
                                               kActChunkVectors * static_cast<int64_t>(p.tokens)
                                         : 0;
  int64_t staging_blocks =
      vectors == 0 ? 1 : std::min<int64_t>(kMaxStagingBlocks, (vectors + kThreads - 1) / kThreads);
  if (!p.stage_hidden) {
    staging_blocks = p.zero_unrouted_out == nullptr
                         ? (p.group_routes ? 0 : 1)
                         : std::min<int64_t>(kMaxStagingBlocks, (p.tokens + 63) / 64);
  }
  const size_t smem = p.group_routes ? (3 * static_cast<size_t>(slots) + 1) * sizeof(int32_t) +
                                           kWarps * sizeof(int2)
                                     : 0;
  const int64_t blocks = p.group_blocks + staging_blocks;
  ExpertPrologueKernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::cuda
