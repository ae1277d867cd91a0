// Activation staging (numerics.md section 3): MXFP8 (UE8M0 scales packed four per int32, or fp32
// scales), NVFP4 per token, BF16 copy, shared-expert scale copies, L2 alpha, padding and top-k
// repack, plus the matching dequantizers that the reference expert path reads.
//
// Called by the shard's staging step, by the client when it quantizes before sending, and by
// tests. Pure: thread-safe.
#ifndef MOE_KERNELS_STAGING_H_
#define MOE_KERNELS_STAGING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"

namespace moe {

inline constexpr int64_t kMxfp8Group = 32;           // hidden elements per scale
inline constexpr int64_t kNvfp4ActGroup = 16;        // hidden elements per E4M3 scale
inline constexpr float kMxfp8AmaxFloor = 1e-4f;      // amax floor before the scale is taken
inline constexpr float kNvfp4TokenDivisor = 2688.f;  // 6 * 448

// x F32 or BF16 [T, H] with H % 128 == 0 -> q E4M3 [T, H], scales I32 [T, H/128] (byte g of
// word w, least significant first, is the UE8M0 scale of group 4w+g).
[[nodiscard]] absl::Status QuantizeMxfp8(const TensorView& x, TensorView q, TensorView scales);
// Same quantization with the unrounded fp32 scale s = amax/448 stored, F32 [T, H/32];
// values are q = e4m3(x / s). H % 32 == 0.
[[nodiscard]] absl::Status QuantizeMxfp8Fp32Scale(const TensorView& x, TensorView q,
                                                  TensorView scales);
// q E4M3 [T, H] with scales I32 [T, H/128] (packed UE8M0) or F32 [T, H/32] -> out F32 [T, H].
[[nodiscard]] absl::Status DequantizeMxfp8(const TensorView& q, const TensorView& scales,
                                           TensorView out);

// x F32 or BF16 [T, H], H % 64 == 0 -> q U8 [T, H/2] packed E2M1, block_scales I32 [T, H/64]
// (E4M3 bytes, byte j of word w = group 4w+j), token_scale F32 [T] = max(row_amax, tiny)/2688
// with tiny = FLT_MIN (an all-zero row gets a positive scale and all-zero codes).
[[nodiscard]] absl::Status QuantizeNvfp4PerToken(const TensorView& x, TensorView q,
                                                 TensorView block_scales, TensorView token_scale);
[[nodiscard]] absl::Status DequantizeNvfp4PerToken(const TensorView& q,
                                                   const TensorView& block_scales,
                                                   const TensorView& token_scale, TensorView out);

// BF16 copy: x F32 or BF16 [T, H] -> out BF16 [T, H] (round-to-nearest-even from F32).
[[nodiscard]] absl::Status StageBf16(const TensorView& x, TensorView out);

// Copies packed UE8M0 scales I32 [T, H/128] into the shared-expert layout for row block
// `block_m` (numerics.md section 3): out I32 [rows >= ceil(T/B) * ceil(B/128)*128, H/128].
[[nodiscard]] absl::Status WriteSharedExpertScales(const TensorView& scales, int64_t block_m,
                                                   TensorView out);

// l2_alpha[e] = w2_global_scale[e] * l2_activation_scale for every local expert.
[[nodiscard]] absl::Status ComputeL2Alpha(absl::Span<const float> w2_global_scale,
                                          float l2_activation_scale, absl::Span<float> l2_alpha);

// Padding and top-k repack: ids I32 or I64 [T, K], weights F32 or BF16 [T, K], optional
// is_padding BOOL [T] -> out_ids I32 [T, K], out_weights F32 [T, K]; padded tokens get ids -1 and
// weights 0. INVALID_ARGUMENT for mismatched shapes, ids outside [-1, num_experts), NaN/Inf
// weights (of unpadded tokens).
[[nodiscard]] absl::Status RepackTopk(const TensorView& ids, const TensorView& weights,
                                      const TensorView& is_padding, int32_t num_experts,
                                      TensorView out_ids, TensorView out_weights);

}  // namespace moe

#endif  // MOE_KERNELS_STAGING_H_
