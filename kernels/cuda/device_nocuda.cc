// Device discovery for builds without CUDA (--config=nocuda).
#include <string>

#include "kernels/cuda/device.h"

namespace moe::cuda {

bool BuiltWithCuda() { return false; }

int DeviceCount(std::string* why) {
  if (why != nullptr) *why = "built without CUDA (--config=nocuda)";
  return 0;
}

std::string DeviceDescription(int) { return "built without CUDA"; }

void* DeviceAlloc(size_t) { return nullptr; }
void DeviceFree(void*) {}
bool CopyAnyBytes(void*, const void*, size_t) { return false; }
std::string IpcHandleOf(void*) { return ""; }

}  // namespace moe::cuda
