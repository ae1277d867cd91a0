#include "kernels/cpu/kernel_table.h"

namespace moe::cpu {

CpuKernels KernelsFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return {isa, &RunFp4GemmAvx2};
    case CpuIsa::kAvx512:
      return {isa, &RunFp4GemmAvx512};
    case CpuIsa::kAvx512Vnni:
      return {isa, &RunFp4GemmAvx512Vnni};
  }
  return {CpuIsa::kAvx2, &RunFp4GemmAvx2};
}

}  // namespace moe::cpu
