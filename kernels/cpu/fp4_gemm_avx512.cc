// FP4 expert GEMM kernels compiled for avx512 (see fp4_gemm_impl.h and the BUILD copts).
#define MOE_CPU_ISA avx512
#include "kernels/cpu/simd_avx512.h"
// The kernels need the primitives above first.
#include "kernels/cpu/fp4_gemm_impl.h"

namespace moe::cpu {

void RunFp4GemmAvx512(const Fp4GemmParams& params, int thread_index) {
  avx512::RunFp4Gemm(params, thread_index);
}

}  // namespace moe::cpu
