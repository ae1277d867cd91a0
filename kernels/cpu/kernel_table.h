// The runtime-to-kernel dispatch of the optimized CPU backend in one visible table: which
// compiled variant of each ISA-specific kernel family runs for a chosen instruction set.
//
// Called by the CPU backend and benchmarks. Pure: thread-safe.
#ifndef MOE_KERNELS_CPU_KERNEL_TABLE_H_
#define MOE_KERNELS_CPU_KERNEL_TABLE_H_

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/fp4_gemm.h"

namespace moe::cpu {

struct CpuKernels {
  CpuIsa isa = CpuIsa::kAvx2;
  Fp4GemmFn fp4_gemm = nullptr;
};

// REQUIRES: the running processor supports `isa` (ChooseIsa checked it).
CpuKernels KernelsFor(CpuIsa isa);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_KERNEL_TABLE_H_
