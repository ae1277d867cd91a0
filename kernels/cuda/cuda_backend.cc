// CudaExpertBackend: ExpertBackend over expert_runner.h. Host code (abseil allowed), no device
// code. Inputs are copied from the caller's (pageable) host memory on a private stream; the call
// returns after the output is back on the host.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/cuda/expert_runner.h"

namespace moe {
namespace {

using cuda::CudaStatus;
using cuda::DeviceBuffer;

class CudaExpertBackend final : public ExpertBackend {
 public:
  CudaExpertBackend(const CudaBackendOptions& options, cudaStream_t stream)
      : options_(options), stream_(stream) {
    runner_.set_poison_scratch(options.poison_scratch);
    runner_.set_gemm_variant(options.gemm_variant);
    runner_.set_direct_routes(options.direct_routes);
    if (options_.upload_threads <= 0) {
      options_.upload_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
  }
  ~CudaExpertBackend() override {
    cudaSetDevice(options_.device);
    layers_.clear();
    cudaStreamDestroy(stream_);
  }

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
    layers_.erase(layer_index);  // free the old copy before uploading the new one
    absl::StatusOr<std::unique_ptr<cuda::DeviceExpertLayer>> d =
        cuda::UploadExpertLayer(layer, options_.device, options_.upload_threads);
    if (!d.ok()) return d.status();
    layers_[layer_index] = *std::move(d);
    return absl::OkStatus();
  }

  absl::Status Run(int layer_index, const ExpertLayer& layer,
                   const ExpertsRequest& request) override;

 private:
  absl::StatusOr<const cuda::DeviceExpertLayer*> Prepared(int layer_index,
                                                          const ExpertLayer& layer) const;
  absl::Status CopyIn(const ExpertsRequest& request, bool with_mask);

  CudaBackendOptions options_;
  cudaStream_t stream_;
  std::map<int, std::unique_ptr<cuda::DeviceExpertLayer>> layers_;
  cuda::ExpertRunner runner_;
  DeviceBuffer hidden_, ids_, weights_, mask_, out_;
};

absl::StatusOr<const cuda::DeviceExpertLayer*> CudaExpertBackend::Prepared(
    int layer_index, const ExpertLayer& layer) const {
  auto it = layers_.find(layer_index);
  if (it == layers_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: layer ", layer_index, " was not prepared"));
  }
  const cuda::DeviceExpertLayer& d = *it->second;
  if (d.hidden != layer.hidden || d.inter != layer.intermediate ||
      d.num_experts != static_cast<int>(layer.experts.size()) ||
      d.num_shared != static_cast<int>(layer.shared_experts.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend: layer ", layer_index, " differs from the one given to PrepareLayer"));
  }
  return &d;
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
  absl::StatusOr<const cuda::DeviceExpertLayer*> d = Prepared(layer_index, layer);
  if (!d.ok()) return d.status();
  const int64_t tokens = request.hidden_states.dim(0);
  if (tokens == 0) return absl::OkStatus();
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
  if (absl::Status s = runner_.Enqueue(**d, batch, plan, stream_); !s.ok()) return s;
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
