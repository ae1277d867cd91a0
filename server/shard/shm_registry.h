// ShmRegistry: the POSIX shared-memory regions frontends registered with a shard
// (proto/moe/v1/shm.proto). A region is mapped read-write once at registration; requests borrow
// it through a Lease, which keeps the mapping alive and makes Unregister fail with
// FAILED_PRECONDITION while any request is using the region. Lease::Range is the one place byte
// ranges from the network are checked against the region (overflow-safe).
//
// Optional hooks see every mapping right after it is made and right before it is undone (the
// shard pins regions for a CUDA backend with them, ExpertBackend::RegisterHostMemory).
//
// Callers: ShmForwardService. Thread-safety: every method may be called concurrently; a Lease is
// used by one thread; the hooks run on the thread that maps or drops the last reference. Ownership:
// the registry owns the mappings (a region is unmapped when unregistered and no lease holds it).
#ifndef MOE_SERVER_SHARD_SHM_REGISTRY_H_
#define MOE_SERVER_SHARD_SHM_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace moe {

class ShmRegistry {
 public:
  // Largest region one registration may map.
  static constexpr uint64_t kMaxRegionBytes = uint64_t{64} << 30;
  static constexpr size_t kMaxRegions = 1024;

  struct Region;

  // A borrowed region: valid (mapped, not unregistrable) until destroyed.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : region_(std::move(other.region_)) {}
    Lease& operator=(Lease&&) = delete;
    ~Lease();

    // [offset, offset + length) of the region. INVALID_ARGUMENT naming `field` when the range
    // leaves the region (including when offset + length overflows).
    absl::StatusOr<absl::Span<uint8_t>> Range(uint64_t offset, uint64_t length,
                                              absl::string_view field) const;

   private:
    friend class ShmRegistry;
    explicit Lease(std::shared_ptr<Region> region) : region_(std::move(region)) {}
    std::shared_ptr<Region> region_;
  };

  // Told about each region's mapping: `mapped` after the mmap (before the region can be used),
  // `unmapping` before the munmap, once the region is unregistered and no lease holds it (or when
  // the registry goes, or a registration fails after mapping). Either may be empty.
  struct Hooks {
    std::function<void(void* base, uint64_t bytes)> mapped;
    std::function<void(void* base)> unmapping;
  };

  ShmRegistry() = default;
  explicit ShmRegistry(Hooks hooks) : hooks_(std::move(hooks)) {}
  ShmRegistry(const ShmRegistry&) = delete;
  ShmRegistry& operator=(const ShmRegistry&) = delete;

  // Maps `byte_size` bytes of the POSIX shared-memory object `shm_key` as `region_id`.
  // INVALID_ARGUMENT for a bad id, key or size (or an object smaller than byte_size); NOT_FOUND
  // when the object cannot be opened; ALREADY_EXISTS for a registered id; RESOURCE_EXHAUSTED past
  // kMaxRegions.
  absl::Status Register(const std::string& region_id, const std::string& shm_key,
                        uint64_t byte_size) ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when unknown; FAILED_PRECONDITION while a Lease holds it.
  absl::Status Unregister(const std::string& region_id) ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when `region_id` is not registered.
  absl::StatusOr<Lease> Acquire(const std::string& region_id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Hooks hooks_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SHM_REGISTRY_H_
