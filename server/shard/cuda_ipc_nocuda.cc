// CUDA IPC for builds without CUDA (--config=nocuda): every call is refused.
#include "server/shard/cuda_ipc.h"

namespace moe {

struct CudaIpcMemory::State {};

CudaIpcMemory::CudaIpcMemory() = default;
CudaIpcMemory::~CudaIpcMemory() = default;

absl::Status CudaIpcMemory::Check(absl::string_view, uint64_t, uint64_t, absl::string_view) {
  return absl::FailedPreconditionError("CUDA IPC: this shard was built without CUDA");
}

CudaIpcMemory::Borrowed::Borrowed(Borrowed&& other) noexcept
    : owner_(other.owner_), entry_(other.entry_), data_(other.data_) {
  other.entry_ = nullptr;
}
CudaIpcMemory::Borrowed::~Borrowed() = default;

absl::StatusOr<CudaIpcMemory::Borrowed> CudaIpcMemory::Borrow(absl::string_view, uint64_t,
                                                               uint64_t, absl::string_view) {
  return absl::FailedPreconditionError("CUDA IPC: this shard was built without CUDA");
}

absl::Status CudaIpcMemory::ZeroDevice(void*, size_t) {
  return absl::FailedPreconditionError("CUDA IPC: this shard was built without CUDA");
}

absl::Status CudaIpcMemory::CopyToHost(absl::string_view, uint64_t, uint64_t, void*,
                                       absl::string_view) {
  return absl::FailedPreconditionError("CUDA IPC: this shard was built without CUDA");
}

absl::Status CudaIpcMemory::CopyFromHost(const void*, absl::string_view, uint64_t, uint64_t,
                                         absl::string_view) {
  return absl::FailedPreconditionError("CUDA IPC: this shard was built without CUDA");
}

}  // namespace moe
