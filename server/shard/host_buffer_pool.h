// HostBufferPool: page-aligned host buffers that a shard's raw-buffer path (RawForwardService)
// reuses from request to request and registers with the backend once each, so that a CUDA
// backend moves the hidden states and output of a ForwardRaw call straight between them and the
// device (ExpertBackend::RegisterHostMemory) instead of staging them through its own pinned
// buffer, and no request pays for fresh pages.
//
// Buffers come in power-of-two size classes from 4 KiB. A buffer goes back to the pool when its
// Lease is destroyed; the pool keeps at most Options::max_idle_bytes of idle buffers and frees
// (unregisters) the rest. Registration is an optimization only: a buffer the backend refuses
// (its pinning cap) is used unregistered.
//
// Thread-safety: Acquire and Lease destruction may run on any thread. Ownership: leases share the
// pool's state, so a lease may outlive the HostBufferPool object (a gRPC response slice freed
// after the service); the backend must outlive every lease.
#ifndef MOE_SERVER_SHARD_HOST_BUFFER_POOL_H_
#define MOE_SERVER_SHARD_HOST_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"

namespace moe {

struct HostBufferPoolOptions {
  // Idle buffers kept for reuse, in bytes; a released buffer past this is freed.
  size_t max_idle_bytes = size_t{256} << 20;
  // Buffers of at least this size, and at most max_idle_bytes (others are never kept), are
  // registered with the backend when allocated (smaller ones move through the backend's staging
  // buffer in any case).
  size_t register_min_bytes = size_t{64} << 10;
};

struct HostBufferPoolStats {
  int64_t allocations = 0;   // buffers allocated (and, when large enough, registered)
  int64_t reuses = 0;        // Acquire calls served by an idle buffer
  int64_t registered = 0;    // allocations the backend accepted for registration
  int64_t frees = 0;         // buffers freed (past the idle cap, or at the end)
  size_t idle_bytes = 0;     // bytes held by idle buffers now
  size_t lent_bytes = 0;     // bytes held by leases now
};

class HostBufferPool {
 public:
  class Lease;

  // `backend` is borrowed and must outlive the pool and every lease.
  explicit HostBufferPool(ExpertBackend* backend, HostBufferPoolOptions options = {});
  ~HostBufferPool() = default;
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // A buffer of at least `bytes` (REQUIRES: bytes > 0); an empty lease when the allocation fails.
  Lease Acquire(size_t bytes);
  HostBufferPoolStats stats() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// A buffer lent by the pool; returns it on destruction. Move-only.
class HostBufferPool::Lease {
 public:
  Lease() = default;
  ~Lease();
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;

  bool empty() const { return data_ == nullptr; }
  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  friend class HostBufferPool;
  void Return();

  std::shared_ptr<State> state_;
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_HOST_BUFFER_POOL_H_
