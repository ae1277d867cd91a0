// On a machine without a GPU (CI) the probe must answer 0 with a reason instead of crashing; on
// the GPU machine it must find the device.
#include "kernels/cuda/device.h"

#include <string>

#include "gtest/gtest.h"

namespace moe::cuda {
namespace {

TEST(DeviceTest, CountIsConsistentWithReason) {
  std::string why;
  const int count = DeviceCount(&why);
  ASSERT_GE(count, 0);
  if (count == 0) {
    EXPECT_FALSE(why.empty());
    EXPECT_NE(why.find(BuiltWithCuda() ? "no CUDA device" : "built without CUDA"),
              std::string::npos)
        << why;
  } else {
    EXPECT_TRUE(BuiltWithCuda());
    EXPECT_NE(DeviceDescription(0).find("sm_"), std::string::npos);
  }
}

}  // namespace
}  // namespace moe::cuda
