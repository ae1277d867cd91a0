// Device stages shared by the expert GEMM kernels (expert_gemm.cu: weight-streaming kernel for few
// tokens; expert_gemm_tiled.cu: shared-memory B tiles for many tokens): loads, E2M1 dequant,
// mma.sync, the two epilogues, and the programmatic-launch controls. Device code only; included
// by .cu files (no abseil, no protobuf).
#ifndef MOE_KERNELS_CUDA_EXPERT_GEMM_STAGES_CUH_
#define MOE_KERNELS_CUDA_EXPERT_GEMM_STAGES_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda::detail {

// Programmatic dependent launch (sm_90): wait until the grids this one depends on have finished
// and their writes are visible; let the next grid in the stream start launching its CTAs.
// Both are no-ops when the kernel was launched without the programmatic attribute.
__device__ __forceinline__ void WaitForPrerequisites() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void AllowDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// GPU-scope acquire load, release store and release add of a 32-bit word (counters that CTAs
// of one grid wait for: the prologue's grouping blocks, the fused layer's per-route counts).
__device__ __forceinline__ uint32_t LoadAcquire(const int32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreRelease(int32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void AddRelease(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Relaxed GPU-scope load (no L1 invalidation, unlike the acquire load: spinning on it leaves the
// L1 lines of the other CTAs on the SM alone), add returning the old value, and store.
__device__ __forceinline__ int32_t LoadRelaxed(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int32_t AddRelaxed(int32_t* p, int v) {
  int32_t old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}
__device__ __forceinline__ void StoreRelaxed(int32_t* p, int32_t v) {
  asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ExpertGemmParams::item_ready. GEMM1, a warp that wrote act rows of item `item_index`: count
// it once its stores are visible.
__device__ __forceinline__ void SignalItemReady(const ExpertGemmParams& p, int item_index) {
  if (p.item_ready == nullptr) return;
  __threadfence();  // this lane's act stores, before the count
  __syncwarp();
  if ((threadIdx.x & 31) == 0) AddRelease(p.item_ready + item_index * kItemReadyStride, 1);
}
// Where a kernel waits for its predecessor's output (GEMM2: GEMM1's act rows; GEMM1 with direct
// routes: the prologue's staged rows), then lets the next kernel start launching. Every thread of
// the CTA calls it. ready null: griddepcontrol.wait (the whole predecessor grid). Else (GEMM2 with
// item_ready) thread 0 polls *ready with relaxed loads and a growing sleep until it reaches
// target (its item's GEMM1 warps), takes one acquire load and counts the CTA; the last of the
// item's `waiters` CTAs sets the word back to zero, so it is zero again when the next batch's
// GEMM1 starts (the words start at zero). One poller per CTA and a word per 128-byte line: an
// earlier form with every warp polling one shared line ran up to 74% slower (H200, problem C at
// one token; NOTES-cuda.md).
struct InputWait {
  bool wait = false;              // false: nothing to wait for here
  int32_t* ready = nullptr;
  int32_t target = 0;
  int32_t waiters = 0;
};
__device__ __forceinline__ void WaitForInputs(const InputWait& w) {
  if (!w.wait) return;
  if (w.ready == nullptr) {
    WaitForPrerequisites();
  } else {
    if (threadIdx.x == 0) {
      for (unsigned sleep = 32; LoadRelaxed(w.ready) < w.target; sleep = min(2 * sleep, 512u)) {
        __nanosleep(sleep);
      }
      (void)LoadAcquire(w.ready);  // orders the CTA's act reads after the GEMM1 warps' stores
      if (AddRelaxed(w.ready, 1) == w.target + w.waiters - 1) StoreRelaxed(w.ready, 0);
    }
    __syncthreads();  // the other threads' act reads come after thread 0's acquire
  }
  AllowDependents();
}
// GEMM2's wait of a grouped-route or direct item: item_ready when set, else the grid-wide wait.
__device__ __forceinline__ InputWait Gemm2InputWait(const ExpertGemmParams& p, int item_index) {
  return InputWait{true,
                   p.item_ready != nullptr ? p.item_ready + item_index * kItemReadyStride : nullptr,
                   p.item_ready_target, p.item_ready_waiters};
}

// The grouped-route kernels' start (blockIdx.x = row block + row_blocks * item): GEMM1 waits for
// the prologue that wrote the items and lets GEMM2 start launching; then this CTA's item and row
// block. False when the CTA has no item (past the device's item count): the whole CTA returns,
// before any barrier.
template <bool kGemm1>
__device__ __forceinline__ bool BlockItem(const ExpertGemmParams& p, int row_blocks,
                                          ExpertItem& item, int& row_block) {
  if constexpr (kGemm1) {
    WaitForPrerequisites();
    AllowDependents();
  }
  const int item_index = static_cast<int>(blockIdx.x / row_blocks);
  row_block = static_cast<int>(blockIdx.x % row_blocks);
  if (item_index >= *p.num_items) return false;
  item = p.items[item_index];
  return true;
}

// ---- Weight formats: how a lane's scale data turns into the bf16x2 factor of a k-step.
struct Mxfp4 {
  using Scale = uint32_t;
  static constexpr bool kAccScale = false;
  static __device__ __forceinline__ uint32_t Pair(const Scale& s, int step, int row8) {
    return MxScalePair(s, MxScaleByte(step, row8));
  }
  // Pair with its shift as a multiply by x128 = 128 (DequantStepMul).
  static __device__ __forceinline__ uint32_t PairMul(const Scale& s, int step, int row8,
                                                     uint32_t x128) {
    return MxScalePairMul(s, MxScaleByte(step, row8), x128);
  }
};
// MXFP4 with the block scale applied to the fp32 accumulators (ExpertGemmParams::acc_scale): each
// 32-K block's raw decoded fragments (E2M1 x 2^-126, code 0.5 a bf16 subnormal, which mma.sync
// keeps: bench/probes/mma_subnormal.cu) go into a temporary accumulator, added to the
// accumulators times the block's scale as an fp32. The B rows are staged times 2^64 so those
// products stay normal fp32; the epilogues multiply by ExpertGemmParams::acc_unscale (2^-64).
struct Mxfp4Acc : Mxfp4 {
  static constexpr bool kAccScale = true;
  // 2^(byte - 127) as an fp32 (0 for byte 0, infinity for 255), like MxScalePair's bf16.
  static __device__ __forceinline__ float ScaleF32(const Scale& s, int byte_index) {
    return __uint_as_float(__byte_perm(s, 0u, 0x0444u | (byte_index << 12)) >> 1);
  }
};
struct Nvfp4 {
  static constexpr bool kAccScale = false;
  using Scale = uint4;
  static __device__ __forceinline__ uint32_t Pair(const Scale& s, int step, int row8) {
    const uint32_t w = step == 0 ? s.x : step == 1 ? s.y : step == 2 ? s.z : s.w;
    return NvScalePair(w, row8);
  }
  static __device__ __forceinline__ uint32_t PairMul(const Scale& s, int step, int row8,
                                                     uint32_t /*x128: no shift here*/) {
    return Pair(s, step, row8);
  }
};

// Predicated loads that leave the destination untouched when `pred` is false: no zero-fill, so
// the compiler needs no branch around them (BSSY/BSYNC) and no register copies.
__device__ __forceinline__ void LoadStreamingIf(bool pred, const uint4* p, uint4& r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(pred)));
}
__device__ __forceinline__ void LoadIf(bool pred, const uint4* p, uint4& r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(pred)));
}
// The same through the coherent path (no .nc): for data that the previous kernel in the stream
// writes. Under programmatic launch a kernel starts while its predecessor still runs, so those
// data are not read-only for its lifetime, which ld.global.nc requires; griddepcontrol.wait makes
// the predecessor's writes visible to ordinary loads.
__device__ __forceinline__ void LoadCoherentIf(bool pred, const uint4* p, uint4& r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(pred)));
}
__device__ __forceinline__ uint4 LoadCoherent(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ void LoadIf(bool pred, const uint32_t* p, uint32_t& r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u32 %0, [%1];\n}"
      : "+r"(r)
      : "l"(p), "r"(static_cast<int>(pred)));
}

// Asynchronous copies global -> shared (cp.async, sm_80+), skipped when `pred` is false. Each
// thread later reads back only what it copied itself, so wait_group alone orders the reads.
__device__ __forceinline__ void CopyAsync16If(bool pred, uint32_t smem, const void* p) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.cg.shared.global [%0], [%1], 16;\n}" ::"r"(smem),
      "l"(p), "r"(static_cast<int>(pred))
      : "memory");
}
__device__ __forceinline__ void CopyAsync4If(bool pred, uint32_t smem, const void* p) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.ca.shared.global [%0], [%1], 4;\n}" ::"r"(smem),
      "l"(p), "r"(static_cast<int>(pred))
      : "memory");
}
// The same with an L2 policy (L2Policy) for the lines they read.
__device__ __forceinline__ void CopyAsync16HintIf(bool pred, uint32_t smem, const void* p,
                                                  uint64_t policy) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %3;\n}" ::"r"(smem),
      "l"(p), "r"(static_cast<int>(pred)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void CopyAsync4HintIf(bool pred, uint32_t smem, const void* p,
                                                 uint64_t policy) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 4, %3;\n}" ::"r"(smem),
      "l"(p), "r"(static_cast<int>(pred)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Bulk copies (cp.async.bulk, sm_90: one request for a whole contiguous range, done by the
// copy engine) into shared memory, completed on an mbarrier (transaction bytes), and L2 hints.
// Addresses and sizes: multiples of 16 bytes.
__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the copy engine (async proxy).
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of copies to complete on the barrier.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void BulkCopyToShared(uint32_t smem, const void* p, uint32_t bytes,
                                                 uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem),
      "l"(p), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void BulkPrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// L2 policy for every line an access touches: evict first (read once) or normal.
__device__ __forceinline__ uint64_t L2Policy(bool evict_first) {
  uint64_t first, normal;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return evict_first ? first : normal;
}

__device__ __forceinline__ void PrefetchL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---- Stage 1: load one chunk (16 bytes of codes + the scales) of each of the warp's tiles.
// Tiles past the matrix point at tile 0 instead: their results are never written (GEMM1 writes
// zeros for j >= I, GEMM2 skips h >= H), so they need no zero-fill.
template <class Fmt, int RW>
struct WeightStream {
  const uint4* values[RW];
  const typename Fmt::Scale* scales[RW];

  // Points stream r at this lane's part of tile `tile` of the item's expert (a tile past the
  // matrix is pointed at tile 0: loaded, results unused).
  __device__ __forceinline__ void Aim(const ExpertGemmParams& p, int expert, int r, int tile,
                                      int lane) {
    const int64_t base = static_cast<int64_t>(tile < p.tiles ? tile : 0) * p.chunks;
    values[r] = static_cast<const uint4*>(p.values) + expert * p.values_expert_stride +
                base * kWarpLanes + lane;
    scales[r] = static_cast<const typename Fmt::Scale*>(p.scales) +
                expert * p.scales_expert_stride + base * 8 + (lane >> 2);
  }

  __device__ __forceinline__ void LoadIf(bool pred, int chunk, uint4 (&v)[RW],
                                         typename Fmt::Scale (&s)[RW]) const {
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      LoadStreamingIf(pred, values[r] + static_cast<int64_t>(chunk) * kWarpLanes, v[r]);
      detail::LoadIf(pred, scales[r] + static_cast<int64_t>(chunk) * 8, s[r]);
    }
  }
};

// ---- Stage 2: one k-step of one tile -> the four bf16x2 A registers. DequantStepMul takes the
// decode's shift factors m = {2, 4, 8, 64, 128} as values (UnpackFragmentWordMul): the wgmma
// kernels pass ExpertGemmParams::shift_mul, so that ptxas keeps those operations on the FMA pipe
// (for the GEMM1 kernel, whose activation epilogue is FMA-heavy, it had put every decode shift on
// the ALU beside the masks; NOTES-cuda.md); DequantStep passes the constants (shifts).
template <class Fmt>
__device__ __forceinline__ void DequantStepMul(const uint4& v, const typename Fmt::Scale& s,
                                               int step, const uint32_t (&m)[5],
                                               uint32_t (&a)[4]) {
  uint32_t raw[4];
  UnpackFragmentWordMul(Word(v, step), m, raw);
  const uint32_t scale_g = Fmt::PairMul(s, step, 0, m[4]);
  const uint32_t scale_g8 = Fmt::PairMul(s, step, 1, m[4]);
  a[0] = MulBf16x2(raw[0], scale_g);
  a[1] = MulBf16x2(raw[1], scale_g8);
  a[2] = MulBf16x2(raw[2], scale_g);
  a[3] = MulBf16x2(raw[3], scale_g8);
}
template <class Fmt>
__device__ __forceinline__ void DequantStep(const uint4& v, const typename Fmt::Scale& s, int step,
                                            uint32_t (&a)[4]) {
  constexpr uint32_t kShifts[5] = {2u, 4u, 8u, 64u, 128u};
  DequantStepMul<Fmt>(v, s, step, kShifts, a);
}

// ---- Stage 3: multiply one chunk: B fragments of the G token groups, 4 k-steps, RW tiles.
// B fragments of one chunk for one token group; rows of absent tokens stay zero (b_row null).
__device__ __forceinline__ void LoadBIf(bool pred, const uint4* b_row, int chunk, uint4 (&b)[2]) {
  const bool load = pred && b_row != nullptr;
  const uint4* at = b_row + chunk * kActChunkVectors;
  LoadCoherentIf(load, at, b[0]);  // written by the previous kernel (prologue or GEMM1)
  LoadCoherentIf(load, at + 1, b[1]);
}

// B registers of a two-chunk ping-pong, zeroed, with chunk `chunk` loaded into the first half.
template <int G>
__device__ __forceinline__ void FirstBFragments(bool load, const uint4* const (&b_rows)[G],
                                                int chunk, uint4 (&b)[2][G][2]) {
#pragma unroll
  for (int q = 0; q < G; ++q) {
    b[0][q][0] = b[0][q][1] = b[1][q][0] = b[1][q][1] = make_uint4(0u, 0u, 0u, 0u);
    LoadBIf(load, b_rows[q], chunk, b[0][q]);
  }
}

// Two k-steps (2u, 2u + 1) whose B registers are b[q] (x, y: step 2u; z, w: step 2u + 1), for
// the first `used` token groups (1..G, warp-uniform; the others' MMAs are predicated off and
// their b[q] are not read; the default G compiles to no predicate).
template <class Fmt, int RW, int G>
__device__ __forceinline__ void MultiplyHalfChunk(const uint4 (&v)[RW],
                                                  const typename Fmt::Scale (&s)[RW], int u,
                                                  const uint4 (&b)[G], float (&acc)[RW][G][4],
                                                  int used = G) {
  if constexpr (Fmt::kAccScale) {  // k-steps 2u, 2u + 1 are MXFP4 block u of the chunk
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      float t[G][4];
#pragma unroll
      for (int q = 0; q < G; ++q) t[q][0] = t[q][1] = t[q][2] = t[q][3] = 0.f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t raw[4];
        UnpackFragmentWord(Word(v[r], 2 * u + half), raw);
#pragma unroll
        for (int q = 0; q < G; ++q) {
          if (q == 0 || q < used) {
            Mma(t[q], raw, half == 0 ? b[q].x : b[q].z, half == 0 ? b[q].y : b[q].w);
          }
        }
      }
      const float scale_g = Fmt::ScaleF32(s[r], MxScaleByte(2 * u, 0));
      const float scale_g8 = Fmt::ScaleF32(s[r], MxScaleByte(2 * u, 1));
#pragma unroll
      for (int q = 0; q < G; ++q) {
        acc[r][q][0] = fmaf(t[q][0], scale_g, acc[r][q][0]);  // c0, c1: row g
        acc[r][q][1] = fmaf(t[q][1], scale_g, acc[r][q][1]);
        acc[r][q][2] = fmaf(t[q][2], scale_g8, acc[r][q][2]);  // c2, c3: row g + 8
        acc[r][q][3] = fmaf(t[q][3], scale_g8, acc[r][q][3]);
      }
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int step = 2 * u + half;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      uint32_t a[4];
      DequantStep<Fmt>(v[r], s[r], step, a);
#pragma unroll
      for (int q = 0; q < G; ++q) {
        if (q == 0 || q < used) {
          Mma(acc[r][q], a, half == 0 ? b[q].x : b[q].z, half == 0 ? b[q].y : b[q].w);
        }
      }
    }
  }
}

template <int RW, int G>
__device__ __forceinline__ void ZeroAccumulators(float (&acc)[RW][G][4]) {
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int q = 0; q < G; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][q][e] = 0.f;
}

// B fragments already in registers (loaded a chunk ahead).
template <class Fmt, int RW, int G>
__device__ __forceinline__ void MultiplyChunkLoaded(const uint4 (&v)[RW],
                                                    const typename Fmt::Scale (&s)[RW],
                                                    const uint4 (&b)[G][2],
                                                    float (&acc)[RW][G][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint4 bu[G];
#pragma unroll
    for (int q = 0; q < G; ++q) bu[q] = b[q][u];
    MultiplyHalfChunk<Fmt, RW, G>(v, s, u, bu, acc);
  }
}

// B fragments loaded here, half a chunk at a time (fewer live registers for large G).
template <class Fmt, int RW, int G>
__device__ __forceinline__ void MultiplyChunk(const uint4 (&v)[RW],
                                              const typename Fmt::Scale (&s)[RW],
                                              const uint4* const (&b_rows)[G], int chunk,
                                              float (&acc)[RW][G][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint4 b[G];
#pragma unroll
    for (int q = 0; q < G; ++q) {
      b[q] = b_rows[q] != nullptr ? LoadCoherent(b_rows[q] + chunk * kActChunkVectors + u)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
    MultiplyHalfChunk<Fmt, RW, G>(v, s, u, b, acc);
  }
}

// ---- Stage 5a: GEMM1 epilogue. Tile rows 0..7 are gate j, rows 8..15 up j (repack.h), so a
// lane holds gate and up of the same (j, token) in c0/c2 and c1/c3: the activation is local.
// Activations with the kind a template argument: an epilogue dispatches once (WithActKind), so a
// thread's elements interleave instead of each running a switch, and exp, reciprocal and tanh
// are the hardware's approximations (ex2, rcp and tanh.approx on the MUFU): no branches or
// subroutine calls. The CPU reference's accurate expf / division / tanhf differ by ~1e-6
// relative (exp forms) and ~5e-4 (tanh.approx), far inside the 1e-2 bound of the tests; erff
// stays accurate. Large |x| saturate: ex2 overflows to inf and x * rcp(inf) is 0. ex2 and rcp
// run in their flush-to-zero forms: __expf and __fdividef wrap each MUFU op in a fix-up for
// denormal results (~4 instructions per sigmoid), and here such a result only ever meets 1 + e
// or becomes a sigmoid below 2^-126, so flushing it moves no output by more than ~1e-36.
__device__ __forceinline__ float Ex2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float RcpFtz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kNegLog2e = -1.4426950408889634f;
// sigmoid(x) from y = x * kNegLog2e (so a constant factor of x folds into one multiply).
__device__ __forceinline__ float SigmoidOfScaled(float y) { return RcpFtz(1.f + Ex2Ftz(y)); }
__device__ __forceinline__ float FastSigmoid(float x) { return SigmoidOfScaled(x * kNegLog2e); }
__device__ __forceinline__ float FastTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <ActKind K>
__device__ __forceinline__ float Activate(const ActivationDesc& d, float g, float u) {
  if constexpr (K == ActKind::kSilu) {
    return g * FastSigmoid(g) * u;
  } else if constexpr (K == ActKind::kSwigluOai) {
    g = fminf(g, d.limit);
    u = fminf(fmaxf(u, -d.limit), d.limit);
    return (u + 1.f) * (g * SigmoidOfScaled(g * (d.alpha * kNegLog2e)));
  } else if constexpr (K == ActKind::kSitu) {
    const float gate = d.beta * FastTanh(__fdividef(g, d.beta)) * FastSigmoid(g);
    const float up =
        d.linear_beta > 0.f ? d.linear_beta * FastTanh(__fdividef(u, d.linear_beta)) : u;
    return gate * up;
  } else if constexpr (K == ActKind::kGelu) {
    return 0.5f * g * (1.f + erff(g * 0.70710678118654752f)) * u;
  } else {
    static_assert(K == ActKind::kGeluTanh);
    const float inner = 0.79788456080286536f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.f + FastTanh(inner)) * u;
  }
}

// f(std::integral_constant<ActKind, kind>{}) for a runtime kind (an unknown kind writes nothing;
// the runner only passes the five).
template <class F>
__device__ __forceinline__ void WithActKind(ActKind kind, F&& f) {
  switch (kind) {
    case ActKind::kSilu:
      f(std::integral_constant<ActKind, ActKind::kSilu>{});
      break;
    case ActKind::kSwigluOai:
      f(std::integral_constant<ActKind, ActKind::kSwigluOai>{});
      break;
    case ActKind::kSitu:
      f(std::integral_constant<ActKind, ActKind::kSitu>{});
      break;
    case ActKind::kGelu:
      f(std::integral_constant<ActKind, ActKind::kGelu>{});
      break;
    case ActKind::kGeluTanh:
      f(std::integral_constant<ActKind, ActKind::kGeluTanh>{});
      break;
  }
}

template <int RW, int G>
__device__ __forceinline__ void EpilogueAct(const ExpertGemmParams& p, const ExpertItem& item,
                                            int tile0, int lane, const float (&acc)[RW][G][4]) {
  const int g = lane >> 2, t = lane & 3;
  const float scale_gate = p.ep_scale[item.expert * 3 + 0] * p.acc_unscale;
  const float scale_up = p.ep_scale[item.expert * 3 + 1] * p.acc_unscale;
  WithActKind(p.act.kind, [&](auto kind) {
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int j = (tile0 + r) * 8 + g;
      if ((tile0 + r) * 8 >= p.out_cols) continue;
      const bool real = j < p.out_valid;
      const int64_t bias_at = static_cast<int64_t>(item.expert) * p.out_valid + j;
      const float bias_gate = real ? p.bias_a[bias_at] : 0.f;
      const float bias_up = real ? p.bias_b[bias_at] : 0.f;
      const int pos = (j >> 6) * kChunkK + ActPermIndex(j & 63);
#pragma unroll
      for (int q = 0; q < G; ++q) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = q * kTileTokens + 2 * t + e;
          if (col >= item.count) continue;
          const float value =
              real ? Activate<decltype(kind)::value>(p.act, acc[r][q][e] * scale_gate + bias_gate,
                                                     acc[r][q][2 + e] * scale_up + bias_up)
                   : 0.f;
          const int64_t row = item.slot_begin + col;
          p.act_out[row * p.out_cols + pos] =
              __bfloat16_as_ushort(__float2bfloat16_rn(value * p.act_prescale));
        }
      }
    }
  });
}

// ---- Stage 5b: GEMM2 epilogue: y[route, h] = acc * scale + b2[h], one fp32 row per route.
template <int RW, int G>
__device__ __forceinline__ void EpilogueY(const ExpertGemmParams& p, const ExpertItem& item,
                                          int tile0, int lane, const float (&acc)[RW][G][4]) {
  const int g = lane >> 2, t = lane & 3;
  const float scale = p.ep_scale[item.expert * 3 + 2] * p.acc_unscale;
  int64_t route[G][2];
#pragma unroll
  for (int q = 0; q < G; ++q)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = q * kTileTokens + 2 * t + e;
      const int slot = item.slot_begin + col;
      route[q][e] = col >= item.count         ? -1
                    : p.direct_ids != nullptr ? slot
                                              : p.slot_route[slot];
    }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = (tile0 + r) * kTileRows + g + 8 * half;
      if (h >= p.out_valid) continue;
      const float bias = p.bias_a[static_cast<int64_t>(item.expert) * p.out_valid + h];
#pragma unroll
      for (int q = 0; q < G; ++q)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (route[q][e] < 0) continue;
          p.y_out[route[q][e] * p.out_cols + h] = acc[r][q][2 * half + e] * scale + bias;
        }
    }
  }
}

// Direct routes (ExpertGemmParams::direct_ids): expert slot of item i, or -1.
__device__ __forceinline__ int DirectExpert(const ExpertGemmParams& p, int i) {
  const int routes = p.direct_tokens * p.direct_top_k;
  if (i < routes) return p.direct_ids[i];
  const int r = i - routes, s = r / p.direct_tokens, t = r - s * p.direct_tokens;
  return p.direct_mask != nullptr && p.direct_mask[t] != 0 ? p.direct_experts + s : -1;
}
// Token of direct item (= slot) i.
__device__ __forceinline__ int DirectToken(const ExpertGemmParams& p, int i) {
  const int routes = p.direct_tokens * p.direct_top_k;
  return i < routes ? i / p.direct_top_k : (i - routes) % p.direct_tokens;
}

// Folded combine (ExpertGemmParams::fold_counters), run by the warp that wrote the y rows of
// 16-row tile `tile` (h = tile * 16 + 0..15) of one route of `token` after EpilogueY (and a
// __threadfence after its y stores). Every lane takes the same path (warp-uniform returns only),
// so a warp may call it for several tokens in a row.
__device__ __forceinline__ void FoldCombine(const ExpertGemmParams& p, int token, int tile,
                                            int lane) {
  const int row_blocks = (p.out_valid + kFoldRowsPerBlock - 1) / kFoldRowsPerBlock;
  if (tile >= row_blocks) return;  // past H: no y rows written, nothing counted
  const int row_block = tile;
  const int T = p.fold_tokens, K = p.fold_top_k, routes = T * K;
  const bool marked = p.fold_mask != nullptr && p.fold_mask[token] != 0;
  int participants = marked ? p.fold_shared : 0;
  for (int k = 0; k < K; ++k) participants += p.fold_ids[token * K + k] >= 0 ? 1 : 0;
  __syncwarp();
  int last = 0;
  int32_t* counter = p.fold_counters + static_cast<int64_t>(token) * row_blocks + row_block;
  if (lane == 0) last = atomicAdd(counter, 1) == participants - 1 ? 1 : 0;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (last == 0) return;
  __threadfence();  // the other routes' y stores, before the reads below
  if (lane == 0) *counter = 0;
  const int H = p.out_valid;
  const int h = row_block * kFoldRowsPerBlock + lane;
  if (lane < kFoldRowsPerBlock && h < H) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
      const int route = token * K + k;
      if (p.fold_ids[route] < 0) continue;
      acc += p.fold_weights[route] * __ldcg(p.y_out + static_cast<int64_t>(route) * H + h);
    }
    if (marked) {
      for (int s = 0; s < p.fold_shared; ++s) {
        const int64_t row = routes + static_cast<int64_t>(s) * T + token;
        acc += 1.f * __ldcg(p.y_out + row * H + h);
      }
    }
    const int64_t at = static_cast<int64_t>(token) * H + h;
    if (p.fold_out_bf16) {
      static_cast<uint16_t*>(p.fold_out)[at] = __bfloat16_as_ushort(__float2bfloat16_rn(acc));
    } else {
      static_cast<float*>(p.fold_out)[at] = acc;
    }
  }
  __syncwarp();
}

// Runs `configure` (kernel attributes: cudaFuncSetAttribute) on the current device unless it
// already succeeded there; `done` holds one bit per device (devices past 63: every time).
template <class Configure>
cudaError_t OncePerDevice(std::atomic<uint64_t>& done, Configure configure) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  if (cudaError_t e = configure(); e != cudaSuccess) return e;
  done.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

// Launches `kernel` on a 1-D grid with `smem_bytes` of dynamic shared memory, with the
// programmatic-dependent-launch attribute when asked.
template <typename... Params, typename... Args>
cudaError_t LaunchMaybeProgrammaticShared(void (*kernel)(Params...), unsigned blocks,
                                          unsigned threads, int smem_bytes, bool programmatic,
                                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}
template <typename... Params, typename... Args>
cudaError_t LaunchMaybeProgrammatic(void (*kernel)(Params...), unsigned blocks, unsigned threads,
                                    bool programmatic, cudaStream_t stream, Args... args) {
  return LaunchMaybeProgrammaticShared(kernel, blocks, threads, 0, programmatic, stream, args...);
}

// The tiled kernel family (expert_gemm_tiled.cu), for token_groups 4 and 8.
cudaError_t LaunchTiledGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream);

// GemmItemReadyCount of the tiled kernel family (GEMM1: every warp of a CTA), where the launch's
// GEMM has `rows` rows.
int64_t TiledItemReadyCount(const GemmLaunch& launch, int64_t rows);

// The wgmma kernel (expert_gemm_wgmma.cu), for token_groups kWgmmaTokenGroups (18).
cudaError_t LaunchWgmmaGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                            cudaStream_t stream);

}  // namespace moe::cuda::detail

#endif  // MOE_KERNELS_CUDA_EXPERT_GEMM_STAGES_CUH_
