// LaunchCopyBytes (expert_kernels.h): every byte arrives, between device memory and pinned host
// memory mapped into the device's address space in both directions, for sizes around the 16-byte
// vector and the one-block boundaries; nothing past the end is written; misaligned pointers are
// refused. Needs a GPU (tag "gpu"): skipped without one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/expert_kernels.h"

namespace moe::cuda {
namespace {

bool HaveDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

TEST(DeviceCopyTest, PinnedToDeviceToPinnedKeepsEveryByte) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kMax = (size_t{1} << 20) + 4096;
  constexpr size_t kGuard = 64;
  uint8_t *in = nullptr, *out = nullptr, *dev = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&in), kMax, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&out), kMax + kGuard, cudaHostAllocMapped),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev, kMax + kGuard), cudaSuccess);
  void *in_dev = nullptr, *out_dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&in_dev, in, 0), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&out_dev, out, 0), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::mt19937_64 rng(20261201);
  for (size_t bytes : {size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{4095}, size_t{4096},
                       size_t{4111}, size_t{65536 + 3}, kMax - 5, kMax}) {
    for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<uint8_t>(rng());
    std::memset(out, 0xA5, kMax + kGuard);
    ASSERT_EQ(cudaMemsetAsync(dev, 0x5A, kMax + kGuard, stream), cudaSuccess);
    ASSERT_EQ(LaunchCopyBytes(in_dev, dev, bytes, stream), cudaSuccess);
    ASSERT_EQ(LaunchCopyBytes(dev, out_dev, bytes, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(std::memcmp(in, out, bytes), 0) << bytes << " bytes";
    for (size_t i = bytes; i < bytes + kGuard && i < kMax + kGuard; ++i) {
      ASSERT_EQ(out[i], 0xA5) << "byte " << i << " past " << bytes << " bytes was written";
    }
    // The device side past the end kept its fill too.
    std::vector<uint8_t> tail(kGuard);
    ASSERT_EQ(cudaMemcpy(tail.data(), dev + bytes, kGuard, cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint8_t b : tail) ASSERT_EQ(b, 0x5A) << bytes << " bytes";
  }
  EXPECT_EQ(LaunchCopyBytes(dev + 1, dev + 4096, 64, stream), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCopyBytes(dev, dev + 4104, 64, stream), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCopyBytes(dev + 1, dev + 4096, 0, stream), cudaSuccess);  // nothing to do
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(in);
  cudaFreeHost(out);
}

}  // namespace
}  // namespace moe::cuda
