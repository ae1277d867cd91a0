// CudaExpertBackend: ExpertBackend over expert_runner.h. Host code (abseil allowed), no device
// code. Inputs are copied from the caller's (pageable) host memory on a private stream; the call
// returns after the output is back on the host.
//
// Device weights are kept per (layer index, host weights): during a two-phase placement switch
// the shard serves the old and the new map version at once, so PrepareLayer for the new version
// must not replace the copy the old one is still running with. Up to kVersionsPerLayer copies per
// layer; Run picks the one uploaded from the same host weights (their addresses identify them)
// and holds a reference while it runs, so evicting a version never frees memory in use.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/cuda/expert_runner.h"

namespace moe {
namespace {

using cuda::CudaStatus;
using cuda::DeviceBuffer;

// What identifies the host weights a device copy was uploaded from: format, shapes and the
// addresses of every expert's packed values (read as numbers, never dereferenced).
struct HostIdentity {
  WeightFormat format = WeightFormat::kMxfp4;
  int64_t hidden = 0, inter = 0;
  std::vector<const void*> values;

  static HostIdentity Of(const ExpertLayer& layer) {
    HostIdentity id{layer.format, layer.hidden, layer.intermediate, {}};
    for (const auto* list : {&layer.experts, &layer.shared_experts}) {
      for (const ExpertWeights& e : *list) {
        id.values.push_back(e.w13.values.data);
        id.values.push_back(e.w2.values.data);
      }
    }
    return id;
  }
  bool operator==(const HostIdentity&) const = default;
};

struct DeviceVersion {
  HostIdentity host;
  std::unique_ptr<cuda::DeviceExpertLayer> device;
};

class CudaExpertBackend final : public ExpertBackend {
 public:
  CudaExpertBackend(const CudaBackendOptions& options, cudaStream_t stream)
      : options_(options), stream_(stream) {
    runner_.set_poison_scratch(options.poison_scratch);
    runner_.set_gemm_variant(options.gemm_variant);
    if (options.wgmma_min_tokens >= 0) runner_.set_wgmma_min_tokens(options.wgmma_min_tokens);
    runner_.set_direct_routes(options.direct_routes);
    runner_.set_l2_prefetch(options.l2_prefetch);
    runner_.set_fold_grouped(options.fold_grouped);
    runner_.set_hidden_in_place(options.wgmma_byte_savers);
    runner_.set_y_bf16(options.wgmma_byte_savers);
    runner_.set_wgmma_l2_ahead(options.wgmma_l2_ahead);
    if (options_.upload_threads <= 0) {
      options_.upload_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
  }
  ~CudaExpertBackend() override {
    cudaSetDevice(options_.device);
    {
      absl::MutexLock lock(&layers_mu_);
      layers_.clear();
    }
    cudaStreamDestroy(stream_);
  }

  // Device copies kept per layer index (the shard keeps up to 4 map versions).
  static constexpr size_t kVersionsPerLayer = 4;

  absl::string_view name() const override { return "cuda"; }
  std::string device() const override { return cuda::DeviceDescription(options_.device); }

  absl::Status CheckSupported(const ExpertLayer& layer) const override {
    if (layer.format != WeightFormat::kMxfp4 && layer.format != WeightFormat::kNvfp4) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda backend: weight format ", WeightFormatName(layer.format),
          " is not supported (MXFP4 and NVFP4 only)"));
    }
    const size_t slots = layer.experts.size() + layer.shared_experts.size();
    if (slots == 0 || slots > static_cast<size_t>(cuda::kMaxPrologueSlots)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda backend: ", slots, " expert slots in a layer; 1..", cuda::kMaxPrologueSlots,
          " supported"));
    }
    return absl::OkStatus();
  }

  absl::Status PrepareLayer(int layer_index, const ExpertLayer& layer) override {
    if (absl::Status s = ValidateExpertLayer(layer); !s.ok()) return s;
    if (absl::Status s = CheckSupported(layer); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
      return s;
    }
    HostIdentity host = HostIdentity::Of(layer);
    {
      // The same weights again: replace their copy (freed here) before uploading.
      absl::MutexLock lock(&layers_mu_);
      std::erase_if(layers_[layer_index], [&](const auto& v) { return v->host == host; });
    }
    absl::StatusOr<std::unique_ptr<cuda::DeviceExpertLayer>> d =
        cuda::UploadExpertLayer(layer, options_.device, options_.upload_threads);
    if (!d.ok()) return d.status();
    auto version = std::make_shared<DeviceVersion>(DeviceVersion{std::move(host), *std::move(d)});
    absl::MutexLock lock(&layers_mu_);
    std::deque<std::shared_ptr<const DeviceVersion>>& versions = layers_[layer_index];
    versions.push_front(std::move(version));
    // The oldest goes; a Run still using it holds its own reference.
    if (versions.size() > kVersionsPerLayer) versions.pop_back();
    return absl::OkStatus();
  }

  absl::Status Run(int layer_index, const ExpertLayer& layer,
                   const ExpertsRequest& request) override;

 private:
  absl::StatusOr<std::shared_ptr<const DeviceVersion>> Prepared(int layer_index,
                                                                const ExpertLayer& layer)
      ABSL_LOCKS_EXCLUDED(layers_mu_);
  absl::Status CopyIn(const ExpertsRequest& request, bool with_mask)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);

  CudaBackendOptions options_;
  cudaStream_t stream_;
  absl::Mutex layers_mu_;
  std::map<int, std::deque<std::shared_ptr<const DeviceVersion>>> layers_
      ABSL_GUARDED_BY(layers_mu_);
  // One Run at a time on the private stream and its buffers (the executor calls from one
  // thread; this keeps other callers correct too).
  absl::Mutex run_mu_;
  cuda::ExpertRunner runner_ ABSL_GUARDED_BY(run_mu_);
  DeviceBuffer hidden_ ABSL_GUARDED_BY(run_mu_), ids_ ABSL_GUARDED_BY(run_mu_),
      weights_ ABSL_GUARDED_BY(run_mu_), mask_ ABSL_GUARDED_BY(run_mu_),
      out_ ABSL_GUARDED_BY(run_mu_);
};

absl::StatusOr<std::shared_ptr<const DeviceVersion>> CudaExpertBackend::Prepared(
    int layer_index, const ExpertLayer& layer) {
  const HostIdentity host = HostIdentity::Of(layer);
  absl::MutexLock lock(&layers_mu_);
  auto it = layers_.find(layer_index);
  if (it == layers_.end() || it->second.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: layer ", layer_index, " was not prepared"));
  }
  for (const std::shared_ptr<const DeviceVersion>& v : it->second) {
    if (v->host == host) return v;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cuda backend: layer ", layer_index,
      " was not prepared (PrepareLayer) with these weights"));
}

absl::Status CudaExpertBackend::CopyIn(const ExpertsRequest& request, bool with_mask) {
  const struct {
    DeviceBuffer& buf;
    const TensorView& view;
  } inputs[] = {{hidden_, request.hidden_states},
                {ids_, request.local_ids},
                {weights_, request.topk_weights},
                {mask_, request.shared_mask}};
  for (const auto& in : inputs) {
    if (&in.view == &request.shared_mask && !with_mask) continue;
    const size_t bytes = static_cast<size_t>(in.view.NumBytes());
    if (absl::Status s = in.buf.Reserve(bytes); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(in.buf.get(), in.view.data, bytes,
                                                    cudaMemcpyHostToDevice, stream_),
                                    "input copy");
        !s.ok()) {
      return s;
    }
  }
  return out_.Reserve(static_cast<size_t>(request.out.NumBytes()));
}

absl::Status CudaExpertBackend::Run(int layer_index, const ExpertLayer& layer,
                                    const ExpertsRequest& request) {
  if (absl::Status s = ValidateExpertsRequest(layer, request); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<const DeviceVersion>> version = Prepared(layer_index, layer);
  if (!version.ok()) return version.status();
  const cuda::DeviceExpertLayer& d = *(*version)->device;
  const int64_t tokens = request.hidden_states.dim(0);
  if (tokens == 0) return absl::OkStatus();
  absl::MutexLock lock(&run_mu_);
  if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  const bool with_mask = request.shared_mask.present() && !layer.shared_experts.empty();
  const cuda::RoutePlan plan = cuda::PlanRoutes(
      request.local_ids.As<const int32_t>(), tokens, request.local_ids.dim(1),
      with_mask ? request.shared_mask.As<const uint8_t>() : nullptr,
      static_cast<int>(layer.experts.size()), static_cast<int>(layer.shared_experts.size()));
  if (absl::Status s = CopyIn(request, with_mask); !s.ok()) return s;
  cuda::DeviceBatch batch;
  batch.hidden = hidden_.get();
  batch.hidden_bf16 = request.hidden_states.dtype == DType::kBF16;
  batch.ids = ids_.as<int32_t>();
  batch.weights = weights_.as<float>();
  batch.shared_mask = with_mask ? mask_.as<uint8_t>() : nullptr;
  batch.out = out_.get();
  batch.out_bf16 = request.out.dtype == DType::kBF16;
  if (absl::Status s = runner_.Enqueue(d, batch, plan, stream_); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(request.out.data, out_.get(),
                                                  static_cast<size_t>(request.out.NumBytes()),
                                                  cudaMemcpyDeviceToHost, stream_),
                                  "output copy");
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaStreamSynchronize(stream_), "expert kernels");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCudaExpertBackend(
    const CudaBackendOptions& options) {
  std::string why;
  const int count = cuda::DeviceCount(&why);
  if (count == 0) return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
  if (options.gemm_variant < -1 || options.gemm_variant > cuda::kMaxGemmVariant) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: gemm_variant ",
                                                   options.gemm_variant, " is not in 0..",
                                                   cuda::kMaxGemmVariant));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--backend=cuda: device ", options.device, " requested, ", count, " present"));
  }
  if (absl::Status s = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  cudaStream_t stream = nullptr;
  if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                  "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  return std::make_unique<CudaExpertBackend>(options, stream);
}

}  // namespace moe
