// CpuBackend: prepared-layer cache, request slicing into passes, and the ExpertBackend surface.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/expert_pass.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/prepared_layer.h"
#include "kernels/cpu/thread_pool.h"

namespace moe {
namespace {

using cpu::PreparedLayer;

// A prepared version is kept while the service may still run requests of the previous placement.
constexpr size_t kVersionsPerLayer = 2;

class CpuBackend final : public ExpertBackend {
 public:
  CpuBackend(int threads, cpu::CpuIsa isa, const cpu::CpuFeatures& features,
             cpu::PassOptions pass_options)
      : kernels_(cpu::KernelsFor(isa)),
        features_(features),
        threads_(threads),
        pass_options_(pass_options),
        pool_(threads) {}

  absl::string_view name() const override { return "cpu"; }

  std::string device() const override {
    return absl::StrCat("x86-64 CPU, ", threads_, " threads, ", cpu::CpuIsaName(kernels_.isa),
                        " kernels (", cpu::FeatureString(features_), ")");
  }

  // Every weight format, activation, layout and routing the reference covers.
  absl::Status CheckSupported(const ExpertLayer&) const override { return absl::OkStatus(); }

  absl::Status PrepareLayer(int layer_index, const ExpertLayer& layer) override {
    // A pool of its own, so that a placement switch packing new weights does not hold up the
    // requests that Run serves meanwhile with the previous version.
    cpu::ThreadPool pool(threads_);
    absl::StatusOr<std::unique_ptr<PreparedLayer>> prepared = cpu::PrepareCpuLayer(layer, pool);
    if (!prepared.ok()) return prepared.status();
    absl::MutexLock lock(&cache_mu_);
    std::deque<std::shared_ptr<const PreparedLayer>>& versions = cache_[layer_index];
    // Preparing the same weights again replaces their entry instead of evicting another version.
    std::erase_if(versions, [&](const auto& version) { return version->Matches(layer); });
    versions.push_front(std::shared_ptr<const PreparedLayer>(*std::move(prepared)));
    if (versions.size() > kVersionsPerLayer) versions.pop_back();
    return absl::OkStatus();
  }

  absl::Status Run(int layer_index, const ExpertLayer& layer,
                   const ExpertsRequest& request) override {
    if (absl::Status s = RequireHostTensors(request, "cpu backend"); !s.ok()) return s;
    if (absl::Status s = ValidateExpertsRequest(layer, request); !s.ok()) return s;
    std::shared_ptr<const PreparedLayer> prepared = Find(layer_index, layer);
    if (prepared == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("cpu backend: layer ", layer_index,
                       " was not prepared (PrepareLayer) with these weights"));
    }
    absl::MutexLock lock(&run_mu_);
    const int64_t tokens = request.hidden_states.dim(0);
    for (int64_t t0 = 0; t0 < tokens; t0 += cpu::kTokensPerPass) {
      const cpu::PassInput slice =
          Slice(request, prepared->hidden, t0, std::min(tokens - t0, cpu::kTokensPerPass));
      cpu::RunExpertPass(*prepared, layer, slice, pass_options_, kernels_, pool_, workspace_);
    }
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<const PreparedLayer> Find(int layer_index, const ExpertLayer& layer) {
    absl::MutexLock lock(&cache_mu_);
    auto it = cache_.find(layer_index);
    if (it == cache_.end()) return nullptr;
    for (const auto& version : it->second) {
      if (version->Matches(layer)) return version;
    }
    return nullptr;
  }

  // Rows [t0, t0 + n) of the request's views.
  static cpu::PassInput Slice(const ExpertsRequest& r, int64_t hidden, int64_t t0, int64_t n) {
    const int64_t k = r.local_ids.dim(1);
    cpu::PassInput in;
    in.tokens = n;
    in.top_k = k;
    if (r.hidden_states.dtype == DType::kF32) {
      in.x_f32 = r.hidden_states.As<const float>() + t0 * hidden;
    } else {
      in.x_bf16 = r.hidden_states.As<const uint16_t>() + t0 * hidden;
    }
    in.ids = r.local_ids.As<const int32_t>() + t0 * k;
    in.weights = r.topk_weights.As<const float>() + t0 * k;
    if (r.shared_mask.present()) in.shared_mask = r.shared_mask.As<const uint8_t>() + t0;
    if (r.out.dtype == DType::kF32) {
      in.out_f32 = r.out.As<float>() + t0 * hidden;
    } else {
      in.out_bf16 = r.out.As<uint16_t>() + t0 * hidden;
    }
    return in;
  }

  const cpu::CpuKernels kernels_;
  const cpu::CpuFeatures features_;
  const int threads_;
  const cpu::PassOptions pass_options_;
  absl::Mutex cache_mu_;
  std::map<int, std::deque<std::shared_ptr<const PreparedLayer>>> cache_ ABSL_GUARDED_BY(cache_mu_);
  absl::Mutex run_mu_;
  cpu::ThreadPool pool_ ABSL_GUARDED_BY(run_mu_);
  cpu::PassWorkspace workspace_ ABSL_GUARDED_BY(run_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCpuBackend(const CpuBackendOptions& options) {
  if (options.num_threads < 0 || options.num_threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: num_threads ", options.num_threads, " outside [0, 1024]"));
  }
  const cpu::CpuFeatures features = cpu::DetectCpuFeatures();
  absl::StatusOr<cpu::CpuIsa> isa = cpu::ChooseIsa(options.isa, features);
  if (!isa.ok()) return isa.status();
  cpu::PassOptions pass;
  if (options.activations == "int8-w13") {
    pass.int8_w13 = true;
  } else if (options.activations != "int16") {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpu backend: activations '", options.activations, "' (expected int16 or int8-w13)"));
  }
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(threads, *isa, features, pass);
}

}  // namespace moe
