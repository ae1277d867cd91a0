// LaunchCopyBytes (expert_kernels.h): every byte arrives, between device memory and pinned host
// memory mapped into the device's address space in both directions, for sizes around the 16-byte
// vector and the one-block boundaries; nothing past the end is written; misaligned pointers are
// refused. LaunchCopyParts likewise for several parts in one launch. Needs a GPU (tag "gpu"):
// skipped without one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
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

// Mapped pinned input and output buffers (with their device addresses), a device buffer and a
// stream, freed with the struct. Fill with MakeCopyBuffers.
struct CopyBuffers {
  ~CopyBuffers() {
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaFree(dev);
    cudaFreeHost(in);
    cudaFreeHost(out);
  }
  uint8_t *in = nullptr, *out = nullptr, *dev = nullptr;
  void *in_dev = nullptr, *out_dev = nullptr;
  cudaStream_t stream = nullptr;
};

void MakeCopyBuffers(size_t in_bytes, size_t out_bytes, size_t dev_bytes, CopyBuffers* b) {
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&b->in), in_bytes, cudaHostAllocMapped),
            cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&b->out), out_bytes, cudaHostAllocMapped),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b->dev, dev_bytes), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&b->in_dev, b->in, 0), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&b->out_dev, b->out, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking), cudaSuccess);
}

TEST(DeviceCopyTest, PinnedToDeviceToPinnedKeepsEveryByte) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kMax = (size_t{1} << 20) + 4096;
  constexpr size_t kGuard = 64;
  CopyBuffers b;
  ASSERT_NO_FATAL_FAILURE(MakeCopyBuffers(kMax, kMax + kGuard, kMax + kGuard, &b));
  uint8_t *in = b.in, *out = b.out, *dev = b.dev;
  void *in_dev = b.in_dev, *out_dev = b.out_dev;
  cudaStream_t stream = b.stream;
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
}

// LaunchCopyParts: parts of several sizes gathered from mapped pinned host memory into one device
// region, back to back, and scattered back to other host places; every byte arrives, the gaps
// between the places keep their fill; misaligned parts, odd sizes and too many parts are refused.
TEST(DeviceCopyTest, PartsGatherAndScatterEveryByte) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kHost = size_t{4} << 20;
  CopyBuffers b;
  ASSERT_NO_FATAL_FAILURE(MakeCopyBuffers(kHost, kHost, kHost, &b));
  uint8_t *in = b.in, *out = b.out, *dev = b.dev;
  void *in_dev = b.in_dev, *out_dev = b.out_dev;
  cudaStream_t stream = b.stream;
  std::mt19937_64 rng(20261201);
  for (size_t i = 0; i < kHost; ++i) in[i] = static_cast<uint8_t>(rng());
  // (host offset, bytes) of each part; the device side is packed in order.
  const std::vector<std::pair<size_t, size_t>> places = {
      {0, 16}, {4096, 65536}, {131072 + 48, 4096 * 3}, {1 << 20, 16 * 1000}, {3 << 20, 0},
      {(3 << 20) + 64, 262144}};
  std::vector<CopyPart> gather, scatter;
  size_t packed = 0;
  for (const auto& [at, bytes] : places) {
    gather.push_back({static_cast<uint8_t*>(in_dev) + at, dev + packed, bytes});
    scatter.push_back({dev + packed, static_cast<uint8_t*>(out_dev) + at, bytes});
    packed += bytes;
  }
  std::memset(out, 0xA5, kHost);
  ASSERT_EQ(cudaMemsetAsync(dev, 0x5A, kHost, stream), cudaSuccess);
  ASSERT_EQ(LaunchCopyParts(gather.data(), static_cast<int>(gather.size()), stream), cudaSuccess);
  ASSERT_EQ(LaunchCopyParts(scatter.data(), static_cast<int>(scatter.size()), stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<bool> covered(kHost, false);
  for (const auto& [at, bytes] : places) {
    EXPECT_EQ(std::memcmp(in + at, out + at, bytes), 0) << "part at " << at;
    for (size_t i = at; i < at + bytes; ++i) covered[i] = true;
  }
  for (size_t i = 0; i < kHost; ++i) {
    if (!covered[i]) {
      ASSERT_EQ(out[i], 0xA5) << "byte " << i << " outside every part was written";
    }
  }
  // The device region past the packed parts kept its fill.
  std::vector<uint8_t> tail(64);
  ASSERT_EQ(cudaMemcpy(tail.data(), dev + packed, tail.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (uint8_t b : tail) ASSERT_EQ(b, 0x5A);
  CopyPart bad = {in_dev, dev, 24};  // not a multiple of 16
  EXPECT_EQ(LaunchCopyParts(&bad, 1, stream), cudaErrorInvalidValue);
  bad = {static_cast<uint8_t*>(in_dev) + 8, dev, 32};  // misaligned source
  EXPECT_EQ(LaunchCopyParts(&bad, 1, stream), cudaErrorInvalidValue);
  std::vector<CopyPart> many(kMaxCopyParts + 1, CopyPart{in_dev, dev, 16});
  EXPECT_EQ(LaunchCopyParts(many.data(), static_cast<int>(many.size()), stream),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCopyParts(many.data(), 0, stream), cudaSuccess);  // nothing to do
}

}  // namespace
}  // namespace moe::cuda
