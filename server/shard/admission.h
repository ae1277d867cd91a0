// Admission control of the shard's Forward path: a bound on the requests each client has in
// flight (its quota) and on the requests in flight in total (which bounds the executor queue).
// A request over either bound is refused at once with RESOURCE_EXHAUSTED, before it is staged or
// queued, so a client flooding the shard cannot starve the others or grow the queue without
// bound. The client identity is the authenticated token's name (auth.h CallerIdentity), else the
// peer address.
//
// Callers: ExpertShardService::Forward / ForwardStream, RawForwardService (ForwardRaw),
// ShmForwardService (Forward, ForwardCuda, channels) and TcpChannelService (one ticket per
// request; ExpertShardService::AdmitCaller).
// Thread-safety: Admit and stats may be called concurrently; a Ticket releases its slot when
// destroyed (on any thread). Ownership: a Ticket borrows its controller, which must outlive it.
#ifndef MOE_SERVER_SHARD_ADMISSION_H_
#define MOE_SERVER_SHARD_ADMISSION_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moe {

struct AdmissionOptions {
  int max_inflight_per_client = 0;  // 0: unlimited
  int max_inflight_total = 0;       // 0: unlimited
};

struct AdmissionStats {
  uint64_t admitted = 0;
  uint64_t rejected = 0;  // over either bound
  int64_t in_flight = 0;
};

class AdmissionController {
 public:
  // Holds one admitted request's slot; move-only. A default-constructed ticket holds nothing.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept { *this = std::move(other); }
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket() { Release(); }

   private:
    friend class AdmissionController;
    Ticket(AdmissionController* owner, std::string client)
        : owner_(owner), client_(std::move(client)) {}
    void Release();

    AdmissionController* owner_ = nullptr;
    std::string client_;
  };

  explicit AdmissionController(AdmissionOptions options) : options_(options) {}
  AdmissionController(const AdmissionController&) = delete;
  AdmissionController& operator=(const AdmissionController&) = delete;

  // A ticket for one request of `client`, or RESOURCE_EXHAUSTED naming the bound it exceeds.
  absl::StatusOr<Ticket> Admit(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  AdmissionStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t in_flight(const std::string& client) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Release(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);

  const AdmissionOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> per_client_ ABSL_GUARDED_BY(mu_);  // only clients in flight
  AdmissionStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_ADMISSION_H_
