// Weight streaming through bulk copies for the few-token expert GEMM kernel (expert_gemm.cu,
// variants 8..13): each warp keeps a ring of groups of chunks in shared memory, filled by
// cp.async.bulk (one request per group for the codes and one for the scale words, completed on
// an mbarrier per ring slot) instead of 32 per-lane cp.async copies per chunk, and the L2
// prefetch hints of ExpertGemmParams::l2_prefetch. Device code only; included by expert_gemm.cu.
#ifndef MOE_KERNELS_CUDA_EXPERT_GEMM_BULK_CUH_
#define MOE_KERNELS_CUDA_EXPERT_GEMM_BULK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/expert_gemm_stages.cuh"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda::detail {

// One warp's ring: kSlots slots of kGroup chunks each (the group's codes, then its scale words).
template <class Fmt, int C, int D>
struct BulkRingLayout {
  static constexpr int kGroup = C;
  static constexpr int kSlots = D;
  static constexpr int kScaleBytes = 8 * static_cast<int>(sizeof(typename Fmt::Scale));
  static constexpr int kSlotBytes = kGroup * (kChunkBytes + kScaleBytes);
  static constexpr int kWarpBytes = kSlots * kSlotBytes;
};

// Main loop of the bulk-copy variants. The warp's chunks are the contiguous range [c_begin,
// c_begin + n) (values, scales: the tile's chunk 0, lane independent), streamed in groups of
// kGroup chunks: lane 0 arms slot d's mbarrier with the group's byte count and issues two bulk
// copies (codes, scale words; contiguous in the packing); every lane waits on the barrier's phase
// parity, then reads its 16 bytes and its row pair's scale word per chunk. Step j refills the
// slot of step j - 1 (after a __syncwarp: every lane has used what it read there) with group
// j - 1 + kSlots, so kSlots - 1 groups stay in flight without registers. B fragments: the
// ping-pong pair, as the ring of variants 4..7 (kGroup even, so chunk parity is static).
template <class Fmt, int G, class Ring>
__device__ __forceinline__ void WarpMainloopBulk(const ExpertGemmParams& p, const uint4* values,
                                                 const typename Fmt::Scale* scales, int c_begin,
                                                 int n, const uint4* const (&b_rows)[G],
                                                 const InputWait& inputs, unsigned char* ring,
                                                 uint64_t* bars, float (&acc)[1][G][4]) {
  using Scale = typename Fmt::Scale;
  constexpr int C = Ring::kGroup, D = Ring::kSlots;
  static_assert(C % 2 == 0, "the B ping-pong needs an even group");
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int groups = (n + C - 1) / C;
  const uint4* v0 = values + static_cast<int64_t>(c_begin) * kWarpLanes;
  const Scale* s0 = scales + static_cast<int64_t>(c_begin) * 8;
  const uint32_t ring_at = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bars_at = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  const uint64_t policy = L2Policy(p.weights_evict_first);
  const bool ahead = (p.l2_prefetch & kL2PrefetchAhead) != 0;
  // This lane's code vector and row pair's scale word in slot 0, chunk 0.
  const uint4* my_v = reinterpret_cast<const uint4*>(ring) + lane;
  const Scale* my_s = reinterpret_cast<const Scale*>(ring + C * kChunkBytes) + g;
  // Lane 0 only (every operand is warp-uniform, so the copies need no per-lane loop).
  auto issue = [&](int j, int slot) {
    const uint32_t bar = bars_at + 8 * slot;
    const uint32_t dst = ring_at + slot * Ring::kSlotBytes;
    const uint4* src_v = v0 + static_cast<int64_t>(j) * C * kWarpLanes;
    const Scale* src_s = s0 + static_cast<int64_t>(j) * C * 8;
    if ((j + 1) * C <= n) {  // a full group: constant sizes
      MbarrierArriveExpectTx(bar, C * (kChunkBytes + Ring::kScaleBytes));
      BulkCopyToShared(dst, src_v, C * kChunkBytes, bar, policy);
      BulkCopyToShared(dst + C * kChunkBytes, src_s, C * Ring::kScaleBytes, bar, policy);
    } else {
      const int cnt = n - j * C;
      MbarrierArriveExpectTx(bar, cnt * (kChunkBytes + Ring::kScaleBytes));
      BulkCopyToShared(dst, src_v, cnt * kChunkBytes, bar, policy);
      BulkCopyToShared(dst + C * kChunkBytes, src_s, cnt * Ring::kScaleBytes, bar, policy);
    }
  };
  if (lane == 0) {
#pragma unroll
    for (int d = 0; d < D; ++d) MbarrierInit(bars_at + 8 * d, 1);
    FenceMbarrierInit();
    if ((p.l2_prefetch & kL2PrefetchOwn) != 0 && n > 0) {
      BulkPrefetchL2(v0, n * kChunkBytes);
      BulkPrefetchL2(s0, n * Ring::kScaleBytes);
    }
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (d < groups) issue(d, d);
    }
  }
  __syncwarp();
  WaitForInputs(inputs);
  uint4 b[2][G][2];
  FirstBFragments<G>(n > 0, b_rows, c_begin, b);
  for (int j0 = 0; j0 < groups; j0 += D) {
    const uint32_t parity = static_cast<uint32_t>(j0 / D) & 1u;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int j = j0 + d;
      if (j >= groups) break;
      if (j > 0) {
        __syncwarp();  // every lane is done with the slot of step j - 1
        const int refill = j - 1 + D;
        if (lane == 0 && refill < groups) {
          issue(refill, (d + D - 1) % D);
          if (ahead && refill + D < groups) {
            const int64_t at = static_cast<int64_t>(refill + D) * C;
            const int cnt = min(C, n - (refill + D) * C);
            BulkPrefetchL2(v0 + at * kWarpLanes, cnt * kChunkBytes);
          }
        }
      }
      MbarrierWait(bars_at + 8 * d, parity);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int i = j * C + c;
        if (i >= n) break;
        uint4 v[1];
        Scale s[1];
        v[0] = my_v[(d * Ring::kSlotBytes + c * kChunkBytes) / 16];
        s[0] =
            my_s[(d * Ring::kSlotBytes + c * Ring::kScaleBytes) / static_cast<int>(sizeof(Scale))];
        const int chunk = c_begin + i;
#pragma unroll
        for (int q = 0; q < G; ++q) LoadBIf(i + 1 < n, b_rows[q], chunk + 1, b[(c + 1) & 1][q]);
        MultiplyChunkLoaded<Fmt, 1, G>(v, s, b[c & 1], acc);
      }
    }
  }
}

// GEMM1 with kL2PrefetchNext: part `part` of `parts` of [base, base + bytes) (16-byte units) into
// L2.
__device__ __forceinline__ void PrefetchShareL2(const void* base, int64_t bytes, int part,
                                                int parts) {
  const int64_t units = bytes / 16;
  const int64_t begin = units * part / parts, end = units * (part + 1) / parts;
  if (end > begin) {
    BulkPrefetchL2(static_cast<const unsigned char*>(base) + begin * 16,
                   static_cast<uint32_t>((end - begin) * 16));
  }
}

}  // namespace moe::cuda::detail

#endif  // MOE_KERNELS_CUDA_EXPERT_GEMM_BULK_CUH_
