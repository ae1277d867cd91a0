// Host launcher of the GPU staging kernels (staging_kernels.h): uploads an EPLB LayerPlacement to
// the device and validates a StagingParams before enqueueing the fused quantize + remap + load
// kernel. The outputs match kernels/staging.h QuantizeMxfp8 / QuantizeNvfp4PerToken and
// kernels/eplb.h MapLogicalToPhysical / RecordLoad bit for bit.
//
// Called by the CUDA tests and benchmarks (and the shard's GPU staging step). Thread-safety: a
// DevicePlacement is immutable after upload; EnqueueStaging is reentrant. Ownership: a
// DevicePlacement owns its device memory; EnqueueStaging keeps no pointer.
#ifndef MOE_KERNELS_CUDA_STAGING_RUNNER_H_
#define MOE_KERNELS_CUDA_STAGING_RUNNER_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/expert_runner.h"
#include "kernels/cuda/staging_kernels.h"
#include "kernels/eplb.h"

namespace moe::cuda {

// A LayerPlacement's lookup tables in device memory.
struct DevicePlacement {
  DeviceBuffer logical_to_physical;  // int32 [num_logical, max_replicas]
  DeviceBuffer replica_count;        // int32 [num_logical]
  int32_t num_logical = 0;
  int32_t max_replicas = 0;
  int32_t num_physical = 0;

  // Fills the remap fields of `p` (topk_ids, physical_ids etc. stay the caller's).
  void Fill(StagingParams& p) const;
};

// Copies the tables to the current device (synchronously).
absl::StatusOr<std::unique_ptr<DevicePlacement>> UploadPlacement(const LayerPlacement& placement);

// INVALID_ARGUMENT for inconsistent Params (missing outputs, hidden size not a multiple of 128
// (MXFP8) or 64 (NVFP4), num_unpadded outside [0, tokens], negative sizes); otherwise enqueues one
// launch on `stream` and returns its launch status. Only pointer presence is checked, not sizes.
[[nodiscard]] absl::Status EnqueueStaging(const StagingParams& p, cudaStream_t stream);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_STAGING_RUNNER_H_
