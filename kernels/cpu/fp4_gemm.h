// Expert GEMMs on packed FP4 weights (MXFP4, NVFP4) for the optimized CPU backend: one call runs
// one thread's share of a whole phase (every active expert's w13 or w2 product over its routes).
//
// Numerics: activations arrive quantized per weight block to int16 (quantize_rows.h); E2M1 codes
// are decoded in registers to 2 * value (an integer in [-12, 12]) held in the high byte of an
// int16, multiplied with vpmaddwd (vpdpwssd with VNNI) into exact int32 block sums, and each
// block sum is scaled in fp32 by (weight block scale * activation block scale). The constant
// factors (0.5 for the doubled codes, 2^-8 for the high byte) and NVFP4's global scales are in
// the packed per-row scale. Compared with the fp32 reference only the activation rounding
// (relative 2^-15 per element) differs.
//
// Two paths per expert, chosen by the heuristics (cpu_heuristics.h): weight streaming for few
// tokens (each 64-byte chunk is decoded once and used for up to 4 tokens held in registers) and a
// panel path for many tokens (a [16 rows x panel_cols] slice is decoded once into an int16 panel
// in L1 and reused by register tiles of up to 6 tokens). Both produce bit-identical results.
//
// Called by the CPU backend and benchmarks through KernelsFor(isa). Thread-safety: each thread
// writes only the outputs of the work items it claims and its own scratch. Ownership: everything
// here is borrowed; this header has plain structs only, so that the per-ISA translation units can
// include it without sharing any inline code with the rest of the program.
#ifndef MOE_KERNELS_CPU_FP4_GEMM_H_
#define MOE_KERNELS_CPU_FP4_GEMM_H_

#include <cstdint>

#include "kernels/cpu/work_item.h"

namespace moe::cpu {

// Packed layout (fp4_pack.h): rows in groups of 16, columns in chunks of 8, 64 bytes per chunk.
inline constexpr int kGroupRows = 16;
inline constexpr int kChunkCols = 8;
inline constexpr int kChunkBytes = 64;
// Bound on |quantized activation|: 32 products of 16384 * (12 << 8) stay below 2^31.
inline constexpr int kActQuantMax = 16383;
// int8 activations (optional W4A8 panel path): |q| <= 127, and the weights enter vpmaddubsw as
// unsigned 2 * value + 12, whose excess 12 * (block sum of q) is subtracted per block.
inline constexpr int kActQuantMax8 = 127;
inline constexpr int kInt8WeightBias = 12;
// Routes per register tile of the streaming path.
inline constexpr int kStreamTokens = 4;

// One packed matrix as the kernels read it.
struct Fp4MatrixRef {
  const uint8_t* codes = nullptr;    // [groups][cols / 8][64], 64-byte aligned
  const uint8_t* scales = nullptr;   // [groups][cols / block][16] raw UE8M0 / E4M3 bytes
  const float* row_scale = nullptr;  // [groups * 16]: 2^-9 * global scale of the row
  const float* bias = nullptr;       // [groups * 16] or null
  int64_t groups = 0;
  int64_t cols = 0;
  int32_t block = 32;  // 32 (MXFP4) or 16 (NVFP4)
  bool nvfp4 = false;
};

enum class Fp4Epilogue : uint8_t {
  kStore,  // out[r][16 g + i] = row_scale * acc + bias for the 16 rows of group g
  kGated,  // out[r][8 g + i] = act(gate = row i, up = row 8 + i) through gated_fn
};

// out[i] = act(gate[i], up[i]) for i < n. Defined outside the per-ISA units.
using GatedFn = void (*)(const void* ctx, const float* gate, const float* up, int n, float* out);

// Per-thread memory of the panel path.
struct Fp4Scratch {
  int16_t* panel = nullptr;       // [panel_cols * 16], 64-byte aligned (int8 panels use half)
  float* panel_scales = nullptr;  // [panel_cols / 16 * 16]
  float* acc = nullptr;           // [most routes of one expert * 16]
};

struct Fp4GemmParams {
  const Fp4MatrixRef* experts = nullptr;
  const int64_t* route_begin = nullptr;  // expert e's routes are [route_begin[e], route_begin[e+1])
  const int32_t* input_row = nullptr;    // row of `input` read by route r; null: row r
  const int16_t* input = nullptr;        // quantized activations [*][input_stride]
  int64_t input_stride = 0;
  const float* input_scales = nullptr;  // [*][input_scale_stride], one per block
  int64_t input_scale_stride = 0;
  // Optional int8 copies of the activations (W4A8): when set, experts on the panel path read
  // these; the streaming path always reads the int16 ones.
  const int8_t* input8 = nullptr;        // [*][input_stride]
  const float* input8_scales = nullptr;  // [*][input_scale_stride]
  const int32_t* input8_bias = nullptr;  // [*][input_scale_stride]: 12 * block sum of input8
  float* out = nullptr;                  // [routes][out_stride]
  int64_t out_stride = 0;
  Fp4Epilogue epilogue = Fp4Epilogue::kStore;
  GatedFn gated_fn = nullptr;
  const void* gated_ctx = nullptr;
  const GemmWorkItem* items = nullptr;  // units are 16-row groups
  int32_t num_items = 0;
  int32_t* next_item = nullptr;   // shared claim cursor, 0 before the phase
  Fp4Scratch* scratch = nullptr;  // [thread count]
  int64_t panel_cols = 0;         // multiple of 32
};

// Claims and runs items until none is left, with scratch[thread_index]; call from every thread
// of the phase.
using Fp4GemmFn = void (*)(const Fp4GemmParams& params, int thread_index);

// Per-ISA entry points (fp4_gemm_<isa>.cc); call only on a processor that has the ISA.
void RunFp4GemmAvx2(const Fp4GemmParams& params, int thread_index);
void RunFp4GemmAvx512(const Fp4GemmParams& params, int thread_index);
void RunFp4GemmAvx512Vnni(const Fp4GemmParams& params, int thread_index);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_FP4_GEMM_H_
