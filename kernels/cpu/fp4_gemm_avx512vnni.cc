// FP4 expert GEMM kernels compiled for avx512vnni (see fp4_gemm_impl.h and the BUILD copts).
#define MOE_CPU_ISA avx512vnni
#include "kernels/cpu/simd_avx512.h"
// The kernels need the primitives above first.
#include "kernels/cpu/fp4_gemm_impl.h"

namespace moe::cpu {

void RunFp4GemmAvx512Vnni(const Fp4GemmParams& params, int thread_index) {
  avx512vnni::RunFp4Gemm(params, thread_index);
}

}  // namespace moe::cpu
