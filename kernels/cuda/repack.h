// Host-side repacking of one expert's FP4 matrices (MXFP4 or NVFP4) into the fragment layout the
// CUDA expert GEMMs stream (fp4_fragment.h). Done once per layer by PrepareLayer.
//
// Layout of a packed matrix with `tiles` 16-row tiles and `chunks` 64-element K chunks:
//   values: uint32 [tiles][chunks][32 lanes][4 k-steps], one PackFragmentWord per lane and step;
//   scales: MXFP4 uint32 [tiles][chunks][8 g] (MxScaleByte order), NVFP4 uint32
//           [tiles][chunks][8 g][4 k-steps] (NvScalePair order).
// w13 tiles hold gate rows j..j+7 (tile rows 0..7) and the matching up rows (8..15), j = 8 tile,
// whatever the checkpoint layout, so the GEMM1 epilogue finds gate and up in one lane. w2 tiles
// are plain rows 16 tile..16 tile+15, zero past H. K past the matrix's columns is zero.
// Scales carry the 2^126 that the bit-level E2M1 decode leaves out, minus 2^exponent_shift, which
// the epilogue multiplies back (epilogue_factor): MXFP4 stores the UE8M0 byte b as the bf16
// exponent b + 126 - shift (shift = max(0, max b - 128) keeps it <= 254; blocks that would fall
// below 1 are more than 2^120 under the matrix's largest block and are flushed to zero); NVFP4
// stores e4m3 * 2^(126 - 8) as an exact bf16 with shift 8.
//
// Thread-safety: pure functions writing only the caller's buffers.
#ifndef MOE_KERNELS_CUDA_REPACK_H_
#define MOE_KERNELS_CUDA_REPACK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/activation.h"
#include "kernels/formats.h"

namespace moe::cuda {

struct PackedShape {
  int64_t tiles = 0;
  int64_t chunks = 0;

  int64_t value_words() const { return tiles * chunks * 32 * 4; }
  int64_t scale_words(WeightFormat format) const {
    return tiles * chunks * 8 * (format == WeightFormat::kNvfp4 ? 4 : 1);
  }
};

// w13 [2I, H] -> I/8 tiles x ceil(H/64) chunks; w2 [H, I] -> ceil(H/16) tiles x ceil(I/64).
PackedShape W13PackedShape(int64_t hidden, int64_t inter);
PackedShape W2PackedShape(int64_t hidden, int64_t inter);

// Power-of-two factor the GEMM result must be multiplied by (2^exponent_shift).
struct PackedScaleInfo {
  int exponent_shift = 0;
  float epilogue_factor = 1.f;
};

// REQUIRES: ValidateWeightMatrix(w13, 2 * inter, hidden) is OK, format MXFP4 or NVFP4, inter % 8
// == 0. `values` and `scales` have W13PackedShape sizes. INVALID_ARGUMENT for other formats or
// wrongly sized spans.
[[nodiscard]] absl::Status PackW13(const WeightMatrix& w13, GateUpLayout layout,
                                   absl::Span<uint32_t> values, absl::Span<uint32_t> scales,
                                   PackedScaleInfo* info);

// REQUIRES: ValidateWeightMatrix(w2, hidden, inter) is OK, format MXFP4 or NVFP4.
[[nodiscard]] absl::Status PackW2(const WeightMatrix& w2, absl::Span<uint32_t> values,
                                  absl::Span<uint32_t> scales, PackedScaleInfo* info);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_REPACK_H_
