// Repacking of MXFP4/NVFP4 expert matrices into the layout the CPU FP4 kernels stream
// (fp4_gemm.h), done once per layer by CpuBackend::PrepareLayer.
//
// Layout. Rows go in groups of 16 (two halves of 8); columns in chunks of 8. Chunk c of group g is
// 64 bytes: half h (rows 8h..8h+7 of the group) owns bytes [32h, 32h + 32). Element (row j of
// the half, column 8c + kc) has k-pair u = kc / 2 and parity kk = kc % 2 and sits in byte
// 16 * (j / 4) + 8 * (u % 2) + 2 * (j % 4) + kk of its half, low nibble for u < 2, high nibble
// otherwise. Splitting a half into nibbles, looking the codes up (vpshufb) and interleaving with
// zero bytes (vpunpck[lh]bw) then yields, for u = 0..3, a vector whose int32 lane j holds row j's
// two elements of k-pair u: exactly the operand vpmaddwd needs against a broadcast activation
// pair. A 64-byte zmm yields the same for all 16 rows at once. Block scales keep their raw bytes,
// 16 per (group, block), one per row of the group.
//
// Row order. kPlain keeps the matrix's rows (w2). kGateUp (w13 [2I, H]) puts gate rows
// 8g..8g+7 in the first half of group g and the matching up rows in the second, whatever the
// checkpoint's gate/up layout, so that each group yields 8 outputs of the gated activation.
//
// Thread-safety: pure functions of their arguments. Ownership: PackedFp4Matrix owns its buffers.
#ifndef MOE_KERNELS_CPU_FP4_PACK_H_
#define MOE_KERNELS_CPU_FP4_PACK_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/activation.h"
#include "kernels/cpu/aligned_buffer.h"
#include "kernels/cpu/fp4_gemm.h"
#include "kernels/formats.h"

namespace moe::cpu {

enum class RowPairing : uint8_t { kPlain, kGateUp };

struct PackedFp4Matrix {
  WeightFormat format = WeightFormat::kMxfp4;
  int64_t rows = 0;
  int64_t cols = 0;
  AlignedVector<uint8_t> codes;
  std::vector<uint8_t> scales;
  std::vector<float> row_scale;
  std::vector<float> bias;  // empty: none

  Fp4MatrixRef ref() const;
};

// Source row (in `w`) of packed row p. REQUIRES: 0 <= p < rows; kGateUp needs rows % 16 == 0.
int64_t SourceRow(RowPairing pairing, GateUpLayout layout, int64_t rows, int64_t p);

// Packs `w`. `first_scale` and `second_scale` are the global scales of the source rows (for
// kGateUp: gate and up rows; for kPlain pass the same value twice); `bias` is null or has one
// float per source row. INVALID_ARGUMENT unless w is MXFP4/NVFP4 with rows % 16 == 0 and cols a
// multiple of 32 (MXFP4) or 16 (NVFP4). REQUIRES: ValidateWeightMatrix(w, ...) is OK.
absl::StatusOr<PackedFp4Matrix> PackFp4Matrix(const WeightMatrix& w, RowPairing pairing,
                                              GateUpLayout layout, float first_scale,
                                              float second_scale, const float* bias);

// E2M1 code of packed element (p, k): the inverse of the layout above, for tests.
uint8_t PackedCode(const PackedFp4Matrix& m, int64_t p, int64_t k);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_FP4_PACK_H_
