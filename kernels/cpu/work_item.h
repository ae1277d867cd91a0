// The unit of work the CPU heuristics hand to each thread of a GEMM phase: a range of one expert's
// output units (16-row groups for FP4, 8-row groups for BF16), on one of two paths.
//
// A plain struct shared by the per-ISA kernel units (no inline code). Thread-safety: a value.
#ifndef MOE_KERNELS_CPU_WORK_ITEM_H_
#define MOE_KERNELS_CPU_WORK_ITEM_H_

#include <cstdint>

namespace moe::cpu {

struct GemmWorkItem {
  int32_t expert = 0;
  bool panel = false;  // many-token path (fp4_gemm.h); the BF16 kernels ignore it
  int64_t begin = 0;   // output units [begin, end)
  int64_t end = 0;
};

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_WORK_ITEM_H_
