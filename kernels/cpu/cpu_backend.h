// The optimized CPU expert backend ("cpu"): MXFP4/NVFP4 weights repacked once per layer and
// multiplied with int16-quantized activations by ISA-specific kernels (fp4_gemm.h), BF16 weights
// on an fp32 path, all work split over an explicit thread pool. The embedded default of the
// shard server when no GPU is present.
//
// Built by CreateBackend("cpu" / "auto") and by tests and benchmarks through MakeCpuBackend.
// Thread-safety: as ExpertBackend (one caller at a time); PrepareLayer may also run while another
// thread runs an earlier version of the same layer, because the backend keeps the two newest
// prepared versions of each layer index and finds the one a Run call's layer matches. Ownership:
// owns its thread pool, packed weights and workspace.
#ifndef MOE_KERNELS_CPU_CPU_BACKEND_H_
#define MOE_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace moe {

struct CpuBackendOptions {
  int num_threads = 0;       // 0: std::thread::hardware_concurrency()
  std::string isa = "auto";  // auto | avx2 | avx512 | avx512vnni (tests force avx2)
  // Activations of experts with many routes (the panel path): "int16" (relative error about
  // 1e-4 against the reference) or "int8-w13" (int8 into w13: twice the multiply rate of int16
  // on AVX2, relative error 5e-3 to 7e-3 on the test sweep). int8 into w2 as well would pass
  // 1e-2 on the sweep, hence is not offered.
  std::string activations = "int16";
};

// INVALID_ARGUMENT for a bad option, FAILED_PRECONDITION for an ISA this processor lacks.
absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCpuBackend(const CpuBackendOptions& options);

}  // namespace moe

#endif  // MOE_KERNELS_CPU_CPU_BACKEND_H_
