#include "server/shard/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

struct ShmRegistry::Region {
  Region(std::string id, uint8_t* base, uint64_t size, std::function<void(void*)> unmapping)
      : id(std::move(id)), base(base), size(size), unmapping(std::move(unmapping)) {}
  ~Region() {
    if (unmapping) unmapping(base);
    munmap(base, size);
  }

  const std::string id;
  uint8_t* const base;
  const uint64_t size;
  const std::function<void(void*)> unmapping;
  std::atomic<int64_t> leases{0};  // incremented under the registry mutex (see Unregister)
};

ShmRegistry::Lease::~Lease() {
  if (region_ != nullptr) region_->leases.fetch_sub(1);
}

absl::StatusOr<absl::Span<uint8_t>> ShmRegistry::Lease::Range(uint64_t offset, uint64_t length,
                                                              absl::string_view field) const {
  // Compared without adding, so that offset + length cannot wrap around.
  if (offset > region_->size || length > region_->size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + length ",
                                                   length, " exceeds region '", region_->id,
                                                   "' of ", region_->size, " bytes"));
  }
  return absl::Span<uint8_t>(region_->base + offset, length);
}

absl::Status ShmRegistry::Register(const std::string& region_id, const std::string& shm_key,
                                   uint64_t byte_size) {
  if (region_id.empty() || region_id.size() > 128) {
    return absl::InvalidArgumentError("region_id: must have 1 to 128 characters");
  }
  if (shm_key.size() < 2 || shm_key.size() > 255 || shm_key[0] != '/' ||
      shm_key.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_key: '", shm_key, "' is not a POSIX shared-memory name (\"/name\")"));
  }
  if (byte_size == 0 || byte_size > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: ", byte_size, " outside [1, ",
                                                   kMaxRegionBytes, "]"));
  }
  const int fd = shm_open(shm_key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot open shared memory '", shm_key, "': ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("byte_size: shared memory '", shm_key,
                                                   "' has ", st.st_size, " bytes, fewer than ",
                                                   byte_size));
  }
  void* base = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the object referenced
  if (base == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap of '", shm_key, "': ", std::strerror(errno)));
  }
  if (hooks_.mapped) hooks_.mapped(base, byte_size);
  auto region =
      std::make_shared<Region>(region_id, static_cast<uint8_t*>(base), byte_size, hooks_.unmapping);
  absl::MutexLock lock(&mu_);
  if (regions_.count(region_id) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("shared memory region '", region_id, "' is already registered"));
  }
  if (regions_.size() >= kMaxRegions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", kMaxRegions, " shared memory regions per shard"));
  }
  regions_[region_id] = std::move(region);
  return absl::OkStatus();
}

absl::Status ShmRegistry::Unregister(const std::string& region_id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region '", region_id, "' is not registered"));
  }
  // Leases are only taken under mu_, so none can appear between this check and the erase.
  const int64_t leases = it->second->leases.load();
  if (leases > 0) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory region '", region_id,
                                                      "' is in use by ", leases,
                                                      " request(s); unregister it later"));
  }
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<ShmRegistry::Lease> ShmRegistry::Acquire(const std::string& region_id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region '", region_id, "' is not registered"));
  }
  it->second->leases.fetch_add(1);
  return Lease(it->second);
}

}  // namespace moe
