#include "server/shard/host_buffer_pool.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <utility>

namespace moe {
namespace {

constexpr int kMinClass = 12;  // 4 KiB: one page
constexpr int kClasses = 64;

int SizeClass(size_t bytes) {
  return std::max(kMinClass, static_cast<int>(std::bit_width(bytes - 1)));
}

}  // namespace

struct HostBufferPool::State {
  State(ExpertBackend* b, HostBufferPoolOptions o) : backend(b), options(o) {}
  ~State() {
    for (std::vector<uint8_t*>& list : idle) {
      for (uint8_t* p : list) Free(p);
    }
  }

  void Free(uint8_t* p) {
    backend->UnregisterHostMemory(p);
    std::free(p);
  }

  ExpertBackend* const backend;
  const HostBufferPoolOptions options;
  mutable absl::Mutex mu;
  std::vector<uint8_t*> idle[kClasses] ABSL_GUARDED_BY(mu);
  HostBufferPoolStats stats ABSL_GUARDED_BY(mu);
};

HostBufferPool::HostBufferPool(ExpertBackend* backend, HostBufferPoolOptions options)
    : state_(std::make_shared<State>(backend, options)) {}

HostBufferPool::Lease HostBufferPool::Acquire(size_t bytes) {
  const int c = SizeClass(bytes);
  const size_t size = size_t{1} << c;
  Lease lease;
  {
    absl::MutexLock lock(&state_->mu);
    std::vector<uint8_t*>& list = state_->idle[c];
    if (!list.empty()) {
      lease.data_ = list.back();
      list.pop_back();
      state_->stats.idle_bytes -= size;
      state_->stats.lent_bytes += size;
      ++state_->stats.reuses;
    }
  }
  if (lease.data_ == nullptr) {
    // Allocating and pinning take a while: outside the lock.
    void* data = nullptr;
    if (posix_memalign(&data, size_t{1} << kMinClass, size) != 0) return Lease();
    // Pinning pays only for a buffer the pool may keep (pinning costs more than one copy).
    const bool registered = size >= state_->options.register_min_bytes &&
                            size <= state_->options.max_idle_bytes &&
                            state_->backend->RegisterHostMemory(data, size).ok();
    lease.data_ = static_cast<uint8_t*>(data);
    absl::MutexLock lock(&state_->mu);
    ++state_->stats.allocations;
    if (registered) ++state_->stats.registered;
    state_->stats.lent_bytes += size;
  }
  lease.state_ = state_;
  lease.capacity_ = size;
  return lease;
}

HostBufferPoolStats HostBufferPool::stats() const {
  absl::MutexLock lock(&state_->mu);
  return state_->stats;
}

HostBufferPool::Lease::~Lease() { Return(); }

HostBufferPool::Lease::Lease(Lease&& other) noexcept
    : state_(std::move(other.state_)),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

HostBufferPool::Lease& HostBufferPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Return();
    state_ = std::move(other.state_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void HostBufferPool::Lease::Return() {
  if (data_ == nullptr) return;
  uint8_t* const p = std::exchange(data_, nullptr);
  const size_t size = std::exchange(capacity_, 0);
  std::shared_ptr<State> state = std::move(state_);
  {
    absl::MutexLock lock(&state->mu);
    state->stats.lent_bytes -= size;
    if (state->stats.idle_bytes + size <= state->options.max_idle_bytes) {
      state->idle[SizeClass(size)].push_back(p);
      state->stats.idle_bytes += size;
      return;
    }
    ++state->stats.frees;
  }
  state->Free(p);
}

}  // namespace moe
