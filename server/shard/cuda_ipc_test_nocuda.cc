// cuda_ipc_test in a build without CUDA (--config=nocuda): nothing to run.
#include "gtest/gtest.h"

TEST(CudaIpcTest, SecondProcessForwardsDeviceTensors) { GTEST_SKIP() << "built without CUDA"; }

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
