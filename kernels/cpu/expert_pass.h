// One pass of the optimized CPU backend over a slice of a staged batch (at most kTokensPerPass
// tokens): group the routes by expert, then five thread-pool phases - quantize (or widen) the
// hidden states, w13 GEMM with the fused gated activation, quantize the activations, w2 GEMM,
// weighted combine into the output.
//
// Called by CpuBackend::Run. Thread-safety: one pass at a time per workspace and pool.
// Ownership: the workspace owns every intermediate buffer and only grows, so that steady-state
// calls do not allocate; the input and output views are borrowed.
#ifndef MOE_KERNELS_CPU_EXPERT_PASS_H_
#define MOE_KERNELS_CPU_EXPERT_PASS_H_

#include <cstdint>
#include <vector>

#include "kernels/cpu/aligned_buffer.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/cpu_heuristics.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/prepared_layer.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/experts.h"

namespace moe::cpu {

// The slice of a request one pass computes: `tokens` rows starting at the views' first row.
struct PassInput {
  int64_t tokens = 0;
  int64_t top_k = 0;
  const float* x_f32 = nullptr;  // exactly one of x_f32 / x_bf16: [tokens][hidden]
  const uint16_t* x_bf16 = nullptr;
  const int32_t* ids = nullptr;          // [tokens][top_k] local slots or -1
  const float* weights = nullptr;        // [tokens][top_k]
  const uint8_t* shared_mask = nullptr;  // [tokens] or null
  float* out_f32 = nullptr;              // exactly one of the outputs: [tokens][hidden]
  uint16_t* out_bf16 = nullptr;
};

// int8 activations (W4A8, fp4_gemm.h) for the panel-path experts of w13. Not offered for w2:
// through the activation's heavier tails, int8 into w2 as well costs about 1e-2 of relative
// error.
struct PassOptions {
  bool int8_w13 = false;
};

struct PassWorkspace {
  // Routes grouped by expert (routed experts, then shared ones).
  std::vector<int64_t> route_begin;
  std::vector<int64_t> fill;
  std::vector<int32_t> input_row;        // token of each route
  std::vector<int32_t> route_of;         // [tokens][top_k]
  std::vector<int32_t> shared_route_of;  // [tokens][shared]
  // Activations: quantized (FP4) or fp32 (BF16) hidden states, intermediate, expert outputs.
  AlignedVector<int16_t> x_q;
  std::vector<float> x_scales;
  AlignedVector<float> x_f32;
  AlignedVector<float> act;
  AlignedVector<int16_t> act_q;
  std::vector<float> act_scales;
  // int8 copies (PassOptions).
  AlignedVector<int8_t> x_q8;
  std::vector<float> x_scales8;
  std::vector<int32_t> x_bias8;
  AlignedVector<float> expert_out;
  // Per-thread panel scratch.
  std::vector<AlignedVector<int16_t>> panels;
  std::vector<AlignedVector<float>> panel_scales;
  std::vector<AlignedVector<float>> accumulators;
  std::vector<Fp4Scratch> scratch;
  GemmPlan plan;
  std::vector<Bf16MatrixRef> bf16_w13;
  std::vector<Bf16MatrixRef> bf16_w2;
};

// Runs one pass. REQUIRES: the request the slice comes from passed ValidateExpertsRequest(layer,
// ...), `prepared` was built from `layer`, and input.tokens <= kTokensPerPass.
void RunExpertPass(const PreparedLayer& prepared, const ExpertLayer& layer, const PassInput& input,
                   const PassOptions& options, const CpuKernels& kernels, ThreadPool& pool,
                   PassWorkspace& ws);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_EXPERT_PASS_H_
