// Byte copies run by the SMs (see LaunchCopyBytes in expert_kernels.h): 16-byte vectors,
// grid-stride, the tail past the last whole vector by one thread.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/expert_kernels.h"

namespace moe::cuda {
namespace {

constexpr int kCopyThreads = 256;
// Enough blocks to keep many PCIe reads or writes in flight (2 per SM of an H200); a small
// batch takes one block per 4 KB.
constexpr int64_t kMaxCopyBlocks = 264;

__global__ void __launch_bounds__(kCopyThreads)
    CopyBytesKernel(const uint4* __restrict__ from, uint4* __restrict__ to, int64_t vectors,
                    const unsigned char* __restrict__ tail_from, unsigned char* __restrict__ tail_to,
                    int tail) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x; i < vectors;
       i += stride) {
    to[i] = from[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int i = 0; i < tail; ++i) tail_to[i] = tail_from[i];
  }
}

}  // namespace

cudaError_t LaunchCopyBytes(const void* from, void* to, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(from) % 16 != 0 || reinterpret_cast<uintptr_t>(to) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t vectors = static_cast<int64_t>(bytes / 16);
  const int tail = static_cast<int>(bytes % 16);
  const int64_t blocks =
      std::clamp<int64_t>((vectors + kCopyThreads - 1) / kCopyThreads, 1, kMaxCopyBlocks);
  const auto* f = static_cast<const unsigned char*>(from);
  auto* t = static_cast<unsigned char*>(to);
  CopyBytesKernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(f), reinterpret_cast<uint4*>(t), vectors, f + vectors * 16,
      t + vectors * 16, tail);
  return cudaGetLastError();
}

}  // namespace moe::cuda
