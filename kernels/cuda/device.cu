// CUDA device discovery (see device.h). Built by nvcc for sm_90a; linked with the static runtime
// so that a machine without a driver reports "no CUDA device" instead of failing to load.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "kernels/cuda/device.h"

namespace moe::cuda {

bool BuiltWithCuda() { return true; }

int DeviceCount(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = std::string("no CUDA device (") + cudaGetErrorString(err) + ")";
    }
    cudaGetLastError();  // clear the non-sticky error
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "no CUDA device";
  return count;
}

std::string DeviceDescription(int ordinal) {
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDeviceProperties(&prop, ordinal);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %d SMs, %.0f GiB)", prop.name, prop.major,
                prop.minor, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void DeviceFree(void* data) { cudaFree(data); }

bool CopyAnyBytes(void* dst, const void* src, size_t bytes) {
  if (cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

std::string IpcHandleOf(void* data) {
  cudaIpcMemHandle_t h;
  if (cudaIpcGetMemHandle(&h, data) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

}  // namespace moe::cuda
