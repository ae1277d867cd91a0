// The MoE matrix product of reference problem D (shared/spec/performance.md), as ggml's
// MUL_MAT_ID op defines it: out[t, k] = W[ids[t, k]] x[t] for every token t and top-k slot k,
// without activation or combine. MoeMatmul runs it on the optimized CPU kernels (route grouping,
// int16 activation quantization, FP4 GEMM); ReferenceMoeMatmul the way RunExpertsReference
// computes each product (dequantize the expert to fp32, then an fp32 dot per route).
//
// Used by bench/cpu_bench. Thread-safety: one Run at a time per MoeMatmul. Ownership: MoeMatmul
// owns its packed copy of the weights and its workspace; the pool is borrowed.
#ifndef MOE_BENCH_CPU_MOE_OP_H_
#define MOE_BENCH_CPU_MOE_OP_H_

#include <cstdint>
#include <vector>

#include "kernels/cpu/aligned_buffer.h"
#include "kernels/cpu/cpu_heuristics.h"
#include "kernels/cpu/fp4_pack.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/formats.h"

namespace moe::bench {

// What the benchmark's numbers mean, recorded in its JSON.
extern const char kDefinitions[];

class MoeMatmul {
 public:
  // REQUIRES: every matrix is MXFP4 or NVFP4 with the same shape, rows % 16 == 0. `int8`: the
  // panel path (experts with more than 4 routes) takes int8 activations (W4A8).
  MoeMatmul(const std::vector<WeightMatrix>& experts, cpu::ThreadPool& pool,
            const cpu::CpuKernels& kernels, bool int8);

  // ids: [tokens][top_k] expert indices (no -1). The result stays in the workspace.
  void Run(const float* x, const int32_t* ids, int64_t tokens, int64_t top_k);

  // Runs both implementations on the same inputs; returns the relative error of the optimized
  // output (Frobenius norm over all routes).
  double CheckAgainstReference(const std::vector<WeightMatrix>& experts, const float* x,
                               const int32_t* ids, int64_t tokens, int64_t top_k);

 private:
  cpu::ThreadPool& pool_;
  const cpu::CpuKernels kernels_;
  const bool int8_;
  int64_t rows_ = 0;
  int64_t cols_ = 0;
  int block_ = 32;
  std::vector<cpu::PackedFp4Matrix> packed_;
  std::vector<cpu::Fp4MatrixRef> refs_;
  std::vector<int64_t> route_begin_;
  std::vector<int64_t> fill_;
  std::vector<int32_t> input_row_;
  std::vector<int32_t> route_of_;
  cpu::AlignedVector<int16_t> x_q_;
  std::vector<float> x_scales_;
  cpu::AlignedVector<int8_t> x_q8_;
  std::vector<float> x_scales8_;
  std::vector<int32_t> x_bias8_;
  cpu::AlignedVector<float> out_;
  cpu::GemmPlan plan_;
  std::vector<cpu::AlignedVector<int16_t>> panels_;
  std::vector<cpu::AlignedVector<float>> panel_scales_;
  std::vector<cpu::AlignedVector<float>> acc_;
  std::vector<cpu::Fp4Scratch> scratch_;
};

// out[(t * top_k + k) * rows + n], computed as the reference computes it.
std::vector<float> ReferenceMoeMatmul(const std::vector<WeightMatrix>& experts, const float* x,
                                      const int32_t* ids, int64_t tokens, int64_t top_k);

// Sum of n floats with AVX2 loads (the read-bandwidth probe).
float SumFloats(const float* p, size_t n);

}  // namespace moe::bench

#endif  // MOE_BENCH_CPU_MOE_OP_H_
