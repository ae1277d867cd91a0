#include "kernels/cpu/reference_backend.h"

#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

class CpuReferenceBackend final : public ExpertBackend {
 public:
  absl::string_view name() const override { return "cpu-reference"; }

  std::string device() const override {
    return absl::StrCat("x86-64 CPU, ", std::thread::hardware_concurrency(), " threads");
  }

  // The reference covers every weight format, activation and layout.
  absl::Status CheckSupported(const ExpertLayer&) const override { return absl::OkStatus(); }

  absl::Status PrepareLayer(int, const ExpertLayer& layer) override {
    return ValidateExpertLayer(layer);
  }

  absl::Status Run(int, const ExpertLayer& layer, const ExpertsRequest& request) override {
    return RunExpertsReference(layer, request);
  }
};

}  // namespace

std::unique_ptr<ExpertBackend> MakeCpuReferenceBackend() {
  return std::make_unique<CpuReferenceBackend>();
}

}  // namespace moe
