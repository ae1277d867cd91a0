// Pure host heuristics of the optimized CPU backend: how a GEMM phase is cut into per-thread work
// items, which path (weight streaming or panel) each expert takes, panel sizes and the token
// budget of one pass. Kept apart from the kernels so that they can be tested and tuned alone.
//
// Called by the CPU backend and benchmarks. Pure functions; PlanGemm writes only its output.
#ifndef MOE_KERNELS_CPU_CPU_HEURISTICS_H_
#define MOE_KERNELS_CPU_CPU_HEURISTICS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/cpu/work_item.h"

namespace moe::cpu {

struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};

// The index-th of `count` contiguous, near-equal parts of [0, n). REQUIRES: 0 <= index < count.
Range EvenSplit(int64_t n, int index, int count);

// An expert with more routes than this decodes its weights into panels (fp4_gemm.h): below it,
// re-streaming the packed weights for every 4 routes costs less than the panel's stores.
inline constexpr int64_t kStreamMaxRoutes = 4;

// Columns decoded per panel: whole blocks, about 16 KiB of int16 panel (L1-resident with the
// activation rows of a register tile). REQUIRES: block in {16, 32}, cols % block == 0.
int64_t PanelCols(int64_t cols, int block);

// Token rows handled per pass of the backend (bounds the workspace).
inline constexpr int64_t kTokensPerPass = 1024;

// Work items per thread of a phase. The threads claim items in order from a shared cursor, so a
// thread that the (shared, often busy) machine deschedules delays the phase by at most one item.
inline constexpr int kItemsPerThread = 4;

struct GemmPlan {
  std::vector<GemmWorkItem> items;
  int32_t next = 0;  // the claim cursor (fp4_gemm.h); PlanGemm resets it
};

// Cuts the output units [0, units) of every expert that has routes (expert e has
// route_begin[e + 1] - route_begin[e]) into about `pieces` items of equal estimated cost; items
// keep expert and unit order. Reuses `plan`'s storage. REQUIRES: pieces >= 1, route_begin
// non-decreasing.
void PlanGemm(absl::Span<const int64_t> route_begin, int64_t units, int pieces, GemmPlan* plan);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_CPU_HEURISTICS_H_
