#include "kernels/backend.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"

namespace moe {

absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateBackend(absl::string_view name,
                                                             int cuda_device,
                                                             int cuda_concurrent_runs) {
  std::string why;
  if (cuda_device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_device=", cuda_device, ": a device index is 0 or more"));
  }
  if (cuda_concurrent_runs < 0 || cuda_concurrent_runs > kMaxConcurrentCudaRuns) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_concurrent_runs=", cuda_concurrent_runs, ": expected 0 (default) to ",
                     kMaxConcurrentCudaRuns));
  }
  if (name == "cpu-reference") return MakeCpuReferenceBackend();
  if (name == "cpu") return MakeCpuBackend(CpuBackendOptions{});
  if (name == "auto") {
    if (cuda::DeviceCount(&why) > 0) return CreateBackend("cuda", cuda_device, cuda_concurrent_runs);
    return MakeCpuBackend(CpuBackendOptions{});
  }
  if (name == "cuda") {
    if (cuda::DeviceCount(&why) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
    }
    CudaBackendOptions options;
    options.device = cuda_device;
    if (cuda_concurrent_runs > 0) options.concurrent_runs = cuda_concurrent_runs;
    return MakeCudaExpertBackend(options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "' (expected auto, cpu, cpu-reference or cuda)"));
}

}  // namespace moe
