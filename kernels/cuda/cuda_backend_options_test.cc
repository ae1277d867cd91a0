// MakeCudaExpertBackend checks its options before it looks for a device, so this runs on any
// machine of a CUDA build (a build without CUDA refuses every call first; the test skips there).
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"

namespace moe {
namespace {

TEST(CudaBackendOptionsTest, RefusesSettingsOutOfRange) {
  struct Case {
    const char* name;
    void (*set)(CudaBackendOptions&);
  };
  const Case cases[] = {
      {"gemm_variant", [](CudaBackendOptions& o) { o.gemm_variant = 14; }},
      {"gemm_variant", [](CudaBackendOptions& o) { o.gemm_variant = -2; }},
      {"fused_layer", [](CudaBackendOptions& o) { o.fused_layer = 2; }},
      {"fused_layer", [](CudaBackendOptions& o) { o.fused_layer = -2; }},
      {"item_ready", [](CudaBackendOptions& o) { o.item_ready = 2; }},
      {"item_ready", [](CudaBackendOptions& o) { o.item_ready = -7; }},
      {"concurrent_runs", [](CudaBackendOptions& o) { o.concurrent_runs = 0; }},
      {"concurrent_runs", [](CudaBackendOptions& o) { o.concurrent_runs = 9; }},
  };
  for (const Case& c : cases) {
    CudaBackendOptions options;
    c.set(options);
    const absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    ASSERT_FALSE(made.ok()) << c.name;
    if (std::string(made.status().message()).find("built without CUDA") != std::string::npos) {
      GTEST_SKIP() << made.status();
    }
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
    EXPECT_NE(std::string(made.status().message()).find(c.name), std::string::npos)
        << made.status();
  }
}

}  // namespace
}  // namespace moe
