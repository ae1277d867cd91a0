// Per-block int16 quantization of activation rows for the FP4 kernels (fp4_gemm.h): for each
// block of `block` columns, scale = amax / 16383 and q = round-to-nearest-even(x / scale), so
// |q| <= 16383 and the relative rounding error is at most 2^-15 of the block's largest value.
// An all-zero block gets scale 0; a block holding NaN or Inf gets scale NaN (and q = 0), so that
// the GEMM result is NaN where the fp32 reference's would not be finite either.
//
// Called by the CPU backend and benchmarks. Pure functions of their arguments; each call writes
// only its own rows: thread-safe for disjoint rows.
#ifndef MOE_KERNELS_CPU_QUANTIZE_ROWS_H_
#define MOE_KERNELS_CPU_QUANTIZE_ROWS_H_

#include <cstdint>

namespace moe::cpu {

// One row of `cols` fp32 values into q[cols] and scales[cols / block].
// REQUIRES: block in {16, 32}, cols % block == 0.
void QuantizeRowInt16(const float* x, int64_t cols, int block, int16_t* q, float* scales);

// Same for a BF16 row (raw bits).
void QuantizeBf16RowInt16(const uint16_t* x, int64_t cols, int block, int16_t* q, float* scales);

// int8 (the optional W4A8 panel path): scale = amax / 127, q = round(x / scale), and
// bias[b] = kInt8WeightBias * (sum of the block's q) (fp4_gemm.h). Non-finite blocks as above.
void QuantizeRowInt8(const float* x, int64_t cols, int block, int8_t* q, float* scales,
                     int32_t* bias);

// BF16 bits to fp32 (exact).
void Bf16RowToFloat(const uint16_t* x, int64_t cols, float* out);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_QUANTIZE_ROWS_H_
