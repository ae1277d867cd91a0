// Element codecs (E2M1, E4M3fn, UE8M0, BF16) and weight-matrix dequantization (MXFP4, NVFP4,
// BF16), exactly as shared/spec/numerics.md sections 1 and 2 define them.
//
// Called by staging, the expert reference, the model loader and every test. Pure functions of
// their arguments: thread-safe. Matrices are views; nothing here owns memory.
#ifndef MOE_KERNELS_FORMATS_H_
#define MOE_KERNELS_FORMATS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"

namespace moe {

// ---- Element codecs -------------------------------------------------------------------------

// E2M1: sign in bit 3, magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
float E2m1ToFloat(uint8_t code);  // uses the low nibble only
// Round-to-nearest-even on the E2M1 grid, saturating at +-6; -0.0 and NaN encode as code 0.
uint8_t FloatToE2m1(float x);

// E4M3fn: max 448, min subnormal 2^-9, no infinities, NaN = 0x7F / 0xFF.
float E4m3ToFloat(uint8_t bits);
// Round-to-nearest-even, saturating to +-448 (also for +-inf); NaN -> 0x7F.
uint8_t FloatToE4m3(float x);

// UE8M0: 2^(b - 127); 255 is NaN.
float Ue8m0ToFloat(uint8_t bits);

// BF16: upper half of fp32; round-to-nearest-even; NaN stays a (quiet) NaN.
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float x);
// The same over n contiguous values (AVX2 where compiled for it); bitwise equal to the scalar
// functions for every input. The data-plane conversions of whole [T, H] payloads use these.
void Bf16ToFloatN(const uint16_t* in, float* out, int64_t n);
void FloatToBf16N(const float* in, uint16_t* out, int64_t n);

// ---- Weight matrices --------------------------------------------------------------------------

inline constexpr int64_t kMxfp4Block = 32;  // K elements per UE8M0 scale
inline constexpr int64_t kNvfp4Block = 16;  // K elements per E4M3 scale

enum class WeightFormat : uint8_t { kMxfp4, kNvfp4, kBf16 };
absl::string_view WeightFormatName(WeightFormat f);

// One expert matrix W [rows = N output channels, cols = K], K contiguous.
//   MXFP4: values U8 [N, K/2] (even element in the low nibble), scales U8 (UE8M0) [N, K/32].
//   NVFP4: values U8 [N, K/2], scales E4M3 [N, K/16]; the fp32 global scale lives with the
//          expert (ExpertWeights), not here, because w13 carries two of them (gate and up).
//   BF16:  values BF16 [N, K], scales absent.
struct WeightMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int64_t rows = 0;
  int64_t cols = 0;
  TensorView values;
  TensorView scales;
};

// INVALID_ARGUMENT unless `w` is a well-formed matrix of [rows, cols]: dtypes and shapes as above,
// cols a multiple of the format's block, no NaN scale (UE8M0 255, E4M3 0x7F/0xFF), no NaN/Inf BF16.
[[nodiscard]] absl::Status ValidateWeightMatrix(const WeightMatrix& w, int64_t rows, int64_t cols,
                                                absl::string_view name);

// Dequantizes rows [row_begin, row_end) of `w` into `out` ([row_end - row_begin, cols] fp32),
// multiplying by `global_scale` (NVFP4's weight_scale_2; pass 1 otherwise).
// REQUIRES: ValidateWeightMatrix(w, ...) is OK and 0 <= row_begin <= row_end <= w.rows.
void DequantizeRows(const WeightMatrix& w, int64_t row_begin, int64_t row_end, float global_scale,
                    float* out);

// Validated whole-matrix entry point: out is F32 [rows, cols].
[[nodiscard]] absl::Status DequantizeMatrix(const WeightMatrix& w, float global_scale,
                                            TensorView out);

// Quantizes an fp32 matrix [rows, cols] into `w`'s format (used by the model generator and tests).
// MXFP4: per block of 32, scale = UE8M0 of ceil(log2(amax / 6)) (so every value fits, no
// saturation); NVFP4: scale = e4m3(amax / 6 / global_scale) per block of 16. MXFP4 and BF16 first
// divide by global_scale (1 leaves them unchanged) so that DequantizeRows(global_scale) inverts
// them; an all-zero MXFP4 block gets scale 2^0. `w` must point at buffers of the right dtypes and
// shapes; INVALID_ARGUMENT otherwise, for a non-finite input or a global_scale that is not > 0.
[[nodiscard]] absl::Status QuantizeMatrix(const float* in, int64_t rows, int64_t cols,
                                          float global_scale, const WeightMatrix& w);

}  // namespace moe

#endif  // MOE_KERNELS_FORMATS_H_
