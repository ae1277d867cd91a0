#include "server/shard/cuda_ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <iterator>
#include <list>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace moe {
namespace {

// cuMemGetAddressRange (v2), fetched from the driver through the runtime so that the binary does
// not link libcuda (it must start on machines without a driver).
using GetAddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

struct Opened {
  std::string handle;
  char* base = nullptr;
  size_t size = 0;
  int borrowed = 0;  // Borrowed ranges in use: not closed meanwhile
};

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("CUDA IPC: ", what, ": ", cudaGetErrorString(e)));
}

}  // namespace

struct CudaIpcMemory::State {
  absl::Mutex mu;
  bool initialized ABSL_GUARDED_BY(mu) = false;
  absl::Status init_status ABSL_GUARDED_BY(mu);
  GetAddressRangeFn get_range ABSL_GUARDED_BY(mu) = nullptr;
  // Copies run here and are waited for: a pageable host-to-device cudaMemcpy may return before
  // its DMA lands, and the frontend (another context) reads the output right after the call.
  cudaStream_t stream ABSL_GUARDED_BY(mu) = nullptr;
  std::list<Opened> open ABSL_GUARDED_BY(mu);  // most recently used first

  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (initialized) return init_status;
    initialized = true;
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
      init_status = absl::FailedPreconditionError(
          absl::StrCat("CUDA IPC: no CUDA device in the shard process (",
                       e != cudaSuccess ? cudaGetErrorString(e) : "0 devices", ")"));
      return init_status;
    }
    if (cudaError_t e = cudaSetDevice(kDevice); e != cudaSuccess) {
      init_status = CudaError(e, "cudaSetDevice(0)");
      return init_status;
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                         cudaEnableDefault, &found);
        e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      init_status = absl::FailedPreconditionError(
          "CUDA IPC: the driver does not provide cuMemGetAddressRange");
      return init_status;
    }
    get_range = reinterpret_cast<GetAddressRangeFn>(fn);
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      init_status = CudaError(e, "cudaStreamCreate");
    }
    return init_status;
  }

  // The opened allocation for `handle`, opening it (and closing the least recently used one past
  // kMaxOpen) when new.
  absl::StatusOr<Opened*> Open(absl::string_view handle, absl::string_view field)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (absl::Status s = Init(); !s.ok()) return s;
    if (handle.size() != kHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".handle: ", handle.size(),
                                                     " bytes, a CUDA IPC handle has ",
                                                     kHandleBytes));
    }
    for (auto it = open.begin(); it != open.end(); ++it) {
      if (it->handle == handle) {
        open.splice(open.begin(), open, it);
        return &open.front();
      }
    }
    cudaSetDevice(kDevice);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* ptr = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();  // clear it: the next call must not see this error
      return absl::InvalidArgumentError(absl::StrCat(field, ".handle: cannot be opened (",
                                                     cudaGetErrorString(e), ")"));
    }
    unsigned long long base = 0;
    size_t size = 0;
    if (get_range(&base, &size, reinterpret_cast<unsigned long long>(ptr)) != 0) {
      cudaIpcCloseMemHandle(ptr);
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".handle: the driver cannot size the allocation"));
    }
    // The handle maps the allocation's base; size is what lies from there.
    size -= static_cast<size_t>(reinterpret_cast<unsigned long long>(ptr) - base);
    if (open.size() >= kMaxOpen) {
      // The least recently used one that no request is using (past kMaxOpen only while all are).
      for (auto it = open.rbegin(); it != open.rend(); ++it) {
        if (it->borrowed > 0) continue;
        cudaIpcCloseMemHandle(it->base);
        open.erase(std::next(it).base());
        break;
      }
    }
    open.push_front(Opened{std::string(handle), static_cast<char*>(ptr), size});
    return &open.front();
  }
};

CudaIpcMemory::CudaIpcMemory() : state_(std::make_unique<State>()) {}

CudaIpcMemory::~CudaIpcMemory() {
  absl::MutexLock lock(&state_->mu);
  for (const Opened& o : state_->open) cudaIpcCloseMemHandle(o.base);
  if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
}

namespace {

absl::Status CheckRange(const Opened& o, uint64_t offset, uint64_t length,
                        absl::string_view field) {
  if (offset > o.size || length > o.size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + length ",
                                                   length, " exceeds the shared allocation of ",
                                                   o.size, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaIpcMemory::Check(absl::string_view handle, uint64_t offset, uint64_t length,
                                  absl::string_view field) {
  absl::MutexLock lock(&state_->mu);
  absl::StatusOr<Opened*> o = state_->Open(handle, field);
  if (!o.ok()) return o.status();
  return CheckRange(**o, offset, length, field);
}

CudaIpcMemory::Borrowed::Borrowed(Borrowed&& other) noexcept
    : owner_(other.owner_), entry_(other.entry_), data_(other.data_) {
  other.entry_ = nullptr;
}

CudaIpcMemory::Borrowed::~Borrowed() {
  if (entry_ == nullptr) return;
  absl::MutexLock lock(&owner_->state_->mu);
  --static_cast<Opened*>(entry_)->borrowed;
}

absl::StatusOr<CudaIpcMemory::Borrowed> CudaIpcMemory::Borrow(absl::string_view handle,
                                                               uint64_t offset, uint64_t length,
                                                               absl::string_view field) {
  absl::MutexLock lock(&state_->mu);
  absl::StatusOr<Opened*> o = state_->Open(handle, field);
  if (!o.ok()) return o.status();
  if (absl::Status s = CheckRange(**o, offset, length, field); !s.ok()) return s;
  ++(*o)->borrowed;  // std::list elements stay where they are while others come and go
  return Borrowed(this, *o, (*o)->base + offset);
}

absl::Status CudaIpcMemory::ZeroDevice(void* data, size_t bytes) {
  absl::MutexLock lock(&state_->mu);
  if (absl::Status s = state_->Init(); !s.ok()) return s;
  cudaSetDevice(kDevice);
  cudaError_t e = cudaMemsetAsync(data, 0, bytes, state_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(state_->stream);
  if (e != cudaSuccess) return CudaError(e, "zeroing the output");
  return absl::OkStatus();
}

absl::Status CudaIpcMemory::CopyToHost(absl::string_view handle, uint64_t offset, uint64_t length,
                                       void* dst, absl::string_view field) {
  return Transfer(handle, offset, length, dst, /*to_device=*/false, field);
}

absl::Status CudaIpcMemory::CopyFromHost(const void* src, absl::string_view handle,
                                         uint64_t offset, uint64_t length,
                                         absl::string_view field) {
  return Transfer(handle, offset, length, const_cast<void*>(src), /*to_device=*/true, field);
}

absl::Status CudaIpcMemory::Transfer(absl::string_view handle, uint64_t offset, uint64_t length,
                                     void* host, bool to_device, absl::string_view field) {
  // The copy runs under the lock: an eviction by another request cannot close the handle
  // meanwhile.
  absl::MutexLock lock(&state_->mu);
  absl::StatusOr<Opened*> o = state_->Open(handle, field);
  if (!o.ok()) return o.status();
  if (absl::Status s = CheckRange(**o, offset, length, field); !s.ok()) return s;
  if (length == 0) return absl::OkStatus();
  cudaSetDevice(kDevice);
  char* device = (*o)->base + offset;
  cudaError_t e = to_device ? cudaMemcpyAsync(device, host, length, cudaMemcpyHostToDevice,
                                              state_->stream)
                            : cudaMemcpyAsync(host, device, length, cudaMemcpyDeviceToHost,
                                              state_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(state_->stream);
  if (e != cudaSuccess) {
    return CudaError(e, absl::StrCat(field, to_device ? ": host-to-device copy"
                                                      : ": device-to-host copy"));
  }
  return absl::OkStatus();
}

}  // namespace moe
