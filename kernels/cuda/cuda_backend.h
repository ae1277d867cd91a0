// The CUDA (sm_90a) expert backend behind ExpertBackend: MXFP4 and NVFP4 weights are repacked and
// kept on the device per layer (PrepareLayer); each Run copies the batch (hidden states, local
// ids, top-k weights, shared mask) to the device, runs the expert kernels (expert_kernels.h) and
// copies the F32/BF16 output back. Results are bitwise repeatable run to run.
//
// Called by CreateBackend("cuda") and tests. Thread-safety and ownership as ExpertBackend: one
// thread at a time per instance; device copies of the layers are owned by the instance.
// No CUDA headers here, so the factory can be linked into CPU-only builds (where it reports
// FAILED_PRECONDITION "built without CUDA").
#ifndef MOE_KERNELS_CUDA_CUDA_BACKEND_H_
#define MOE_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace moe {

struct CudaBackendOptions {
  int device = 0;
  // Fill intermediate device buffers with NaN before every Run (tests: unwritten elements show).
  bool poison_scratch = false;
  // Host threads that repack weights in PrepareLayer; 0 = hardware concurrency.
  int upload_threads = 0;
  // GEMM kernel variant (expert_kernels.h GemmLaunch::variant); tests cover all. -1: chosen per
  // batch (kAutoGemmVariant, ExpertRunner::set_gemm_variant).
  int gemm_variant = -1;
  // Direct routes for batches where no expert has two routes (ExpertRunner::set_direct_routes).
  bool direct_routes = true;
  // The wgmma kernel runs both GEMMs when the busiest expert slot of a batch has at least this
  // many tokens (ExpertRunner::set_wgmma_min_tokens); 0 never, -1 the runner's default.
  int wgmma_min_tokens = -1;
  // L2 prefetch bits of the bulk-copy GEMM variants (ExpertRunner::set_l2_prefetch); -1: chosen
  // per batch. Hints only (tests cover them).
  int l2_prefetch = -1;
  // Fold the combine into GEMM2 with grouped routes too (ExpertRunner::set_fold_grouped).
  bool fold_grouped = false;
  // wgmma batches: BF16 hidden rows read in place and y in BF16 (ExpertRunner::set_hidden_in_place,
  // set_y_bf16; false: both off, the staged copy and F32 y), and the L2 prefetch of the next
  // tile's weights (ExpertRunner::set_wgmma_l2_ahead). Tests cover every form.
  bool wgmma_byte_savers = true;
  bool wgmma_l2_ahead = false;
};

// FAILED_PRECONDITION with the reason when the binary has no CUDA or no device is present.
absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCudaExpertBackend(
    const CudaBackendOptions& options = {});

}  // namespace moe

#endif  // MOE_KERNELS_CUDA_CUDA_BACKEND_H_
