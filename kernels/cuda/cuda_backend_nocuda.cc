// The CUDA backend factory in builds without CUDA (--config=nocuda).
#include "kernels/cuda/cuda_backend.h"

namespace moe {

absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCudaExpertBackend(const CudaBackendOptions&) {
  return absl::FailedPreconditionError("--backend=cuda: built without CUDA (--config=nocuda)");
}

CudaBackendCounters GetCudaBackendCounters(const ExpertBackend&) { return {}; }

}  // namespace moe
