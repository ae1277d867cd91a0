// A layer as the optimized CPU backend runs it: for MXFP4/NVFP4, every expert's w13 and w2
// repacked once (fp4_pack.h), with w13's rows paired gate/up and NVFP4 global scales and biases
// folded into the packed per-row scale and bias; for BF16, nothing is copied (the kernels read
// the layer's own views on each call).
//
// Built by CpuBackend::PrepareLayer, read by the pass (expert_pass.h). Thread-safety: immutable
// after construction. Ownership: owns the packed copies; remembers the source layer's weight
// addresses only to recognise it (Matches), never to read them.
#ifndef MOE_KERNELS_CPU_PREPARED_LAYER_H_
#define MOE_KERNELS_CPU_PREPARED_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/fp4_pack.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/experts.h"

namespace moe::cpu {

struct PreparedLayer {
  WeightFormat format = WeightFormat::kBf16;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t experts = 0;  // routed experts; shared experts follow them in w13/w2
  int64_t shared = 0;
  std::vector<const void*> fingerprint;  // every matrix's values address in the source layer
  std::vector<PackedFp4Matrix> w13;      // FP4 formats only
  std::vector<PackedFp4Matrix> w2;
  std::vector<Fp4MatrixRef> w13_refs;
  std::vector<Fp4MatrixRef> w2_refs;

  // True when `layer` is the layer this was prepared from (same weight buffers).
  bool Matches(const ExpertLayer& layer) const;
};

// Validates `layer` (ValidateExpertLayer) and packs it, experts spread over the pool's threads.
absl::StatusOr<std::unique_ptr<PreparedLayer>> PrepareCpuLayer(const ExpertLayer& layer,
                                                               ThreadPool& pool);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_PREPARED_LAYER_H_
