// Expert GEMMs on BF16 weights for the optimized CPU backend: the simple path (fp32 activations,
// weights widened to fp32 in registers, AVX2 FMA), with the same phase structure and epilogues as
// the FP4 kernels (fp4_gemm.h). BF16 checkpoints are rare for MoE serving; this path favours
// exactness (fp32 products, like the reference) over speed.
//
// Called by the CPU backend. Thread-safety: each thread writes only its own items' outputs.
// Ownership: everything is borrowed.
#ifndef MOE_KERNELS_CPU_BF16_GEMM_H_
#define MOE_KERNELS_CPU_BF16_GEMM_H_

#include <cstdint>

#include "kernels/activation.h"
#include "kernels/cpu/fp4_gemm.h"
#include "kernels/cpu/work_item.h"

namespace moe::cpu {

struct Bf16MatrixRef {
  const uint16_t* values = nullptr;  // [rows][cols] BF16 bits
  const float* bias = nullptr;       // [rows] or null
  int64_t rows = 0;
  int64_t cols = 0;
};

// Output units are 8 consecutive outputs: rows of the matrix for kStore, activation outputs
// j (gate row GateRow(j), up row UpRow(j)) for kGated.
inline constexpr int kBf16UnitOutputs = 8;

struct Bf16GemmParams {
  const Bf16MatrixRef* experts = nullptr;
  const int64_t* route_begin = nullptr;
  const int32_t* input_row = nullptr;  // null: route r reads row r
  const float* input = nullptr;        // [*][input_stride]
  int64_t input_stride = 0;
  float* out = nullptr;  // [routes][out_stride]
  int64_t out_stride = 0;
  Fp4Epilogue epilogue = Fp4Epilogue::kStore;
  GateUpLayout layout = GateUpLayout::kConcatenated;  // kGated: rows of gate/up j
  GatedFn gated_fn = nullptr;
  const void* gated_ctx = nullptr;
  const GemmWorkItem* items = nullptr;
  int32_t num_items = 0;
  int32_t* next_item = nullptr;  // shared claim cursor, 0 before the phase
};

// Claims and runs items until none is left; call from every thread of the phase.
void RunBf16Gemm(const Bf16GemmParams& params);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_BF16_GEMM_H_
