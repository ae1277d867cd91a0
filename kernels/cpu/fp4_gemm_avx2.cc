// FP4 expert GEMM kernels compiled for avx2 (see fp4_gemm_impl.h and the BUILD copts).
#define MOE_CPU_ISA avx2
#include "kernels/cpu/simd_avx2.h"
// The kernels need the primitives above first.
#include "kernels/cpu/fp4_gemm_impl.h"

namespace moe::cpu {

void RunFp4GemmAvx2(const Fp4GemmParams& params, int thread_index) {
  avx2::RunFp4Gemm(params, thread_index);
}

}  // namespace moe::cpu
