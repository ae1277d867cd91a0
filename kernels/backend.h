// The expert-execution backend interface and its factory: the seam between the shard service and
// the compute backends (CPU reference, optimized CPU, CUDA). The service never sees which one runs.
//
// Called by the shard's executor and by benchmarks.
// Thread-safety: Run and RunParts may be called from up to MaxConcurrentRuns() threads at once
// (1 for most backends: one thread at a time); create one backend per executor.
// Ownership: the backend never owns the layer weights; PrepareLayer may keep derived copies
// (repacked or device-resident) that it owns.
#ifndef MOE_KERNELS_BACKEND_H_
#define MOE_KERNELS_BACKEND_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/experts.h"

namespace moe {

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // "cpu-reference", "cpu", "cuda".
  virtual absl::string_view name() const = 0;
  // Human-readable device ("2-core x86-64 (AVX-512)", "NVIDIA H200 ...").
  virtual std::string device() const = 0;

  // FAILED_PRECONDITION naming the missing combination when this backend cannot run `layer`.
  [[nodiscard]] virtual absl::Status CheckSupported(const ExpertLayer& layer) const = 0;

  // Called once per (layer index, layer) after the weights are loaded or replaced; the layer must
  // stay alive and unchanged until the next PrepareLayer for the same index.
  [[nodiscard]] virtual absl::Status PrepareLayer(int layer_index, const ExpertLayer& layer) = 0;

  // Runs one staged batch. REQUIRES: PrepareLayer(layer_index, layer) succeeded.
  [[nodiscard]] virtual absl::Status Run(int layer_index, const ExpertLayer& layer,
                                         const ExpertsRequest& request) = 0;

  // Runs a batch whose hidden states and output lie in several host buffers, split by rows (a
  // shard's merged batch: one part per request, in order). `request` holds the batch's ids,
  // weights and mask whole, and hidden_states / out with the batch's dtypes and [tokens, H]
  // shapes at the first part's addresses (never read or written through); hidden_parts[i] and
  // out_parts[i] are [rows_i, H] of those dtypes, their rows adding up to the batch's tokens.
  // UNIMPLEMENTED, with nothing run or read, where the backend cannot take the parts as they are:
  // the caller then concatenates them and calls Run. The default (REQUIRES as Run).
  [[nodiscard]] virtual absl::Status RunParts(int layer_index, const ExpertLayer& layer,
                                              const ExpertsRequest& request,
                                              absl::Span<const TensorView> hidden_parts,
                                              absl::Span<const TensorView> out_parts) {
    (void)layer_index;
    (void)layer;
    (void)request;
    (void)hidden_parts;
    (void)out_parts;
    return absl::UnimplementedError("this backend runs merged batches from one buffer");
  }

  // How many Run / RunParts calls may be in progress at once (from as many threads); the shard's
  // executor runs that many batches concurrently. 1 (the default): one at a time.
  virtual int MaxConcurrentRuns() const { return 1; }

  // The CUDA device whose memory Run takes as hidden states and output (ExpertsRequest::
  // hidden_on_device, out_on_device), or -1: host memory only (the default).
  virtual int DeviceForTensors() const { return -1; }

  // Long-lived host memory whose bytes later requests will hold as tensors (a same-host
  // frontend's shared-memory region): a backend may pin it once, so that the hidden states and
  // output of batches inside it move without a staging copy. An optimization only: an error means
  // the memory is used as any other. The range must stay mapped until UnregisterHostMemory(data)
  // has returned; that waits for a Run in progress. Unlike Run, both may be called from any thread
  // at any time. The defaults do nothing.
  [[nodiscard]] virtual absl::Status RegisterHostMemory(void* data, size_t bytes) {
    (void)data;
    (void)bytes;
    return absl::OkStatus();
  }
  // No-op for memory that was never registered (or whose registration failed).
  virtual void UnregisterHostMemory(void* data) { (void)data; }
};

// name: "auto" (CUDA when a device is present and the binary has CUDA, else CPU), "cpu",
// "cpu-reference", "cuda". cuda_device: the CUDA device a CUDA backend runs on (numbered as the
// process sees them, i.e. under CUDA_VISIBLE_DEVICES); the CPU backends ignore it.
// INVALID_ARGUMENT for an unknown name or a negative device; FAILED_PRECONDITION for "cuda"
// without a device, with the reason, or with a device index past the devices present.
// cuda_concurrent_runs: CudaBackendOptions::concurrent_runs of a CUDA backend (0: its default;
// INVALID_ARGUMENT outside 0..8); the CPU backends ignore it.
absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateBackend(absl::string_view name,
                                                             int cuda_device = 0,
                                                             int cuda_concurrent_runs = 0);

}  // namespace moe

#endif  // MOE_KERNELS_BACKEND_H_
