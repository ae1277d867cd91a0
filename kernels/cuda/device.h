// CUDA device discovery for backend selection. No CUDA headers here, so host code that only needs
// to know whether a GPU exists can include it. Thread-safe (the CUDA runtime is).
#ifndef MOE_KERNELS_CUDA_DEVICE_H_
#define MOE_KERNELS_CUDA_DEVICE_H_

#include <cstddef>
#include <string>

namespace moe::cuda {

// True when this binary was built with CUDA support (not --config=nocuda).
bool BuiltWithCuda();

// Number of usable CUDA devices; 0 with `*why` set ("no CUDA device", "built without CUDA", or
// the driver's message) when there is none.
int DeviceCount(std::string* why);

// "NVIDIA H200 (sm_90, 132 SMs, 139 GiB)" for device `ordinal`, or the error text.
std::string DeviceDescription(int ordinal);

// For tests that hand device memory to host-side APIs: `bytes` of memory of the current device
// (null on failure or without CUDA), its release, and a synchronous copy of `bytes` between any
// host or device addresses (false on failure).
void* DeviceAlloc(size_t bytes);
void DeviceFree(void* data);
bool CopyAnyBytes(void* dst, const void* src, size_t bytes);
// The CUDA IPC handle (its 64 bytes) of a DeviceAlloc allocation, for another process on this
// host; empty on failure or without CUDA.
std::string IpcHandleOf(void* data);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_DEVICE_H_
