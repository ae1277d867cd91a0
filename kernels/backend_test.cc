// CreateBackend: names, the CUDA device index, and the errors a shard's flags turn into.
#include "kernels/backend.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"
#include "kernels/cuda/device.h"

namespace moe {
namespace {

TEST(CreateBackendTest, CpuBackendsIgnoreTheDevice) {
  absl::StatusOr<std::unique_ptr<ExpertBackend>> cpu = CreateBackend("cpu", 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  absl::StatusOr<std::unique_ptr<ExpertBackend>> ref = CreateBackend("cpu-reference", 1);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ((*ref)->name(), "cpu-reference");
}

// The CPU backends read and write host memory only: they take no device tensors (a shard then
// stages ForwardCuda through host memory) and RegisterHostMemory is a no-op.
TEST(CreateBackendTest, CpuBackendsTakeHostTensorsOnly) {
  for (const char* name : {"cpu", "cpu-reference"}) {
    absl::StatusOr<std::unique_ptr<ExpertBackend>> b = CreateBackend(name);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->DeviceForTensors(), -1) << name;
    int bytes[4] = {};
    EXPECT_TRUE((*b)->RegisterHostMemory(bytes, sizeof(bytes)).ok()) << name;
    (*b)->UnregisterHostMemory(bytes);
    for (const auto& [hidden, out] : {std::pair{true, false}, std::pair{false, true}}) {
      ExpertsRequest request;
      request.hidden_on_device = hidden;
      request.out_on_device = out;
      const absl::Status s = (*b)->Run(0, ExpertLayer{}, request);
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << name;
      EXPECT_EQ(s.message(), absl::StrCat(name == std::string("cpu") ? "cpu backend" : name,
                                          ": hidden states and output must be host memory "
                                          "(device tensors need a CUDA backend)"));
    }
  }
}

TEST(CreateBackendTest, RefusesBadNamesAndNegativeDevices) {
  absl::StatusOr<std::unique_ptr<ExpertBackend>> unknown = CreateBackend("tpu");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("tpu"), absl::string_view::npos);
  for (const char* name : {"cuda", "auto", "cpu"}) {
    absl::StatusOr<std::unique_ptr<ExpertBackend>> negative = CreateBackend(name, -1);
    ASSERT_FALSE(negative.ok()) << name;
    EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(negative.status().message().find("--cuda_device=-1"), absl::string_view::npos);
    for (int runs : {-1, 9}) {
      absl::StatusOr<std::unique_ptr<ExpertBackend>> lanes = CreateBackend(name, 0, runs);
      ASSERT_FALSE(lanes.ok()) << name << " " << runs;
      EXPECT_EQ(lanes.status().code(), absl::StatusCode::kInvalidArgument) << name;
      EXPECT_NE(lanes.status().message().find(absl::StrCat("--cuda_concurrent_runs=", runs)),
                absl::string_view::npos)
          << lanes.status();
    }
  }
}

// A device index past the devices present is refused with their count (no device at all: the
// reason there is none). Where devices exist, the last one serves and names itself.
TEST(CreateBackendTest, CudaDeviceIndexIsChecked) {
  std::string why;
  const int count = cuda::DeviceCount(&why);
  absl::StatusOr<std::unique_ptr<ExpertBackend>> past = CreateBackend("cuda", count);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), absl::StatusCode::kFailedPrecondition);
  if (count > 0) {
    EXPECT_NE(past.status().message().find(std::to_string(count) + " present"),
              absl::string_view::npos)
        << past.status();
    absl::StatusOr<std::unique_ptr<ExpertBackend>> last = CreateBackend("cuda", count - 1);
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ((*last)->name(), "cuda");
  } else {
    // Without a device, auto falls back to the CPU for any valid index.
    absl::StatusOr<std::unique_ptr<ExpertBackend>> fallback = CreateBackend("auto", 2);
    ASSERT_TRUE(fallback.ok()) << fallback.status();
    EXPECT_EQ((*fallback)->name(), "cpu");
  }
}

}  // namespace
}  // namespace moe
