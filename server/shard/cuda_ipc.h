// CudaIpcMemory: device allocations of other processes on the same host, opened through CUDA IPC
// handles (moe.v1.CudaIpcRef), and copies between them and host memory. Each handle is opened
// once (opening costs milliseconds) and kept open, at most kMaxOpen of them, least recently used
// closed first. Every range is checked against the allocation's real size (driver query), so a
// client cannot make the shard read or write outside what it shared.
//
// Device 0 of the shard process. Thread-safety: all methods may be called concurrently.
// Built without CUDA (--config=nocuda) every call answers FAILED_PRECONDITION.
#ifndef MOE_SERVER_SHARD_CUDA_IPC_H_
#define MOE_SERVER_SHARD_CUDA_IPC_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

class CudaIpcMemory {
 public:
  static constexpr size_t kMaxOpen = 64;
  static constexpr size_t kHandleBytes = 64;

  CudaIpcMemory();
  ~CudaIpcMemory();  // closes every open handle
  CudaIpcMemory(const CudaIpcMemory&) = delete;
  CudaIpcMemory& operator=(const CudaIpcMemory&) = delete;

  // OK when `handle` opens and [offset, offset + length) lies inside its allocation (checked
  // before any work is done for a request, so a bad output range costs no compute).
  absl::Status Check(absl::string_view handle, uint64_t offset, uint64_t length,
                     absl::string_view field);
  // Copies [offset, offset + length) of the allocation `handle` names into `dst` (host memory).
  // INVALID_ARGUMENT naming `field` for a bad handle or range.
  absl::Status CopyToHost(absl::string_view handle, uint64_t offset, uint64_t length, void* dst,
                          absl::string_view field);
  // Copies `length` host bytes at `src` to [offset, offset + length) of the allocation.
  absl::Status CopyFromHost(const void* src, absl::string_view handle, uint64_t offset,
                            uint64_t length, absl::string_view field);

  // [offset, offset + length) of an opened allocation, used in place by device code: the handle
  // stays open (not closed for kMaxOpen) until the Borrowed is destroyed. Borrowing no more than
  // a request's two ranges at a time keeps the open handles near kMaxOpen.
  class Borrowed {
   public:
    Borrowed(Borrowed&& other) noexcept;
    Borrowed& operator=(Borrowed&&) = delete;
    ~Borrowed();
    char* data() const { return data_; }

   private:
    friend class CudaIpcMemory;
    Borrowed(CudaIpcMemory* owner, void* entry, char* data)
        : owner_(owner), entry_(entry), data_(data) {}
    CudaIpcMemory* owner_;
    void* entry_;  // the open allocation (State's), null once moved from
    char* data_;
  };
  // INVALID_ARGUMENT naming `field` for a bad handle or range (as CopyToHost).
  absl::StatusOr<Borrowed> Borrow(absl::string_view handle, uint64_t offset, uint64_t length,
                                  absl::string_view field);
  // Zeroes `bytes` of device memory at `data` (a Borrowed range) and waits for it.
  absl::Status ZeroDevice(void* data, size_t bytes);
  // The CUDA device the handles are opened on (0), as ExpertBackend::DeviceForTensors counts.
  static constexpr int kDevice = 0;

  struct State;

 private:
  // Copies between [offset, offset + length) of the allocation and `host`, either way.
  absl::Status Transfer(absl::string_view handle, uint64_t offset, uint64_t length, void* host,
                        bool to_device, absl::string_view field);

  std::unique_ptr<State> state_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_CUDA_IPC_H_
