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

struct CopyPartsParams {
  const uint4* from[kMaxCopyParts];
  uint4* to[kMaxCopyParts];
  int64_t vectors[kMaxCopyParts];
};

// blockIdx.y: the part; its blocks copy it grid-stride.
__global__ void __launch_bounds__(kCopyThreads) CopyPartsKernel(const CopyPartsParams p) {
  const int part = blockIdx.y;
  const uint4* __restrict__ from = p.from[part];
  uint4* __restrict__ to = p.to[part];
  const int64_t vectors = p.vectors[part];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x; i < vectors;
       i += stride) {
    to[i] = from[i];
  }
}

}  // namespace

cudaError_t LaunchCopyParts(const CopyPart* parts, int count, cudaStream_t stream) {
  if (count < 0 || count > kMaxCopyParts) return cudaErrorInvalidValue;
  CopyPartsParams p = {};
  int64_t most = 0, total = 0;
  for (int i = 0; i < count; ++i) {
    if (reinterpret_cast<uintptr_t>(parts[i].from) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(parts[i].to) % 16 != 0 || parts[i].bytes % 16 != 0) {
      return cudaErrorInvalidValue;
    }
    p.from[i] = static_cast<const uint4*>(parts[i].from);
    p.to[i] = static_cast<uint4*>(parts[i].to);
    p.vectors[i] = static_cast<int64_t>(parts[i].bytes / 16);
    most = std::max(most, p.vectors[i]);
    total += p.vectors[i];
  }
  if (total == 0) return cudaSuccess;
  // As LaunchCopyBytes: one block per 4 KB of the largest part, at most kMaxCopyBlocks in all.
  const int64_t per_part = std::clamp<int64_t>((most + kCopyThreads - 1) / kCopyThreads, 1,
                                               std::max<int64_t>(1, kMaxCopyBlocks / count));
  CopyPartsKernel<<<dim3(static_cast<unsigned>(per_part), static_cast<unsigned>(count)),
                    kCopyThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

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
