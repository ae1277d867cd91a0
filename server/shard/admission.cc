#include "server/shard/admission.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe {

AdmissionController::Ticket& AdmissionController::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = std::exchange(other.owner_, nullptr);
    client_ = std::move(other.client_);
  }
  return *this;
}

void AdmissionController::Ticket::Release() {
  if (owner_ != nullptr) std::exchange(owner_, nullptr)->Release(client_);
}

absl::StatusOr<AdmissionController::Ticket> AdmissionController::Admit(const std::string& client) {
  absl::MutexLock lock(&mu_);
  if (options_.max_inflight_total > 0 && stats_.in_flight >= options_.max_inflight_total) {
    ++stats_.rejected;
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard is at its bound of ", options_.max_inflight_total, " requests in flight; retry"));
  }
  auto it = per_client_.find(client);
  const int64_t mine = it == per_client_.end() ? 0 : it->second;
  if (options_.max_inflight_per_client > 0 && mine >= options_.max_inflight_per_client) {
    ++stats_.rejected;
    return absl::ResourceExhaustedError(absl::StrCat(
        "client quota of ", options_.max_inflight_per_client, " requests in flight exceeded"));
  }
  ++per_client_[client];
  ++stats_.in_flight;
  ++stats_.admitted;
  return Ticket(this, client);
}

void AdmissionController::Release(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = per_client_.find(client);
  if (it != per_client_.end() && --it->second <= 0) per_client_.erase(it);
  --stats_.in_flight;
}

AdmissionStats AdmissionController::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

int64_t AdmissionController::in_flight(const std::string& client) const {
  absl::MutexLock lock(&mu_);
  auto it = per_client_.find(client);
  return it == per_client_.end() ? 0 : it->second;
}

}  // namespace moe
