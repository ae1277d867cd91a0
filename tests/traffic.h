// Verified background traffic for the placement-switch and failure tests: client threads send
// routed forwards through a MoeClient until stopped, check every output against the in-process
// CPU reference, and record each call (outcome, latency, attempts, map version) and the routes of
// the successful ones, so a test can assert "zero failed calls", "only calls touching these
// experts failed" or "the coordinator counted exactly these routes".
//
// Callers: tests in //tests. Thread-safety: Start/Stop/WaitForCalls from the test thread; the
// accessors may be called at any time. Ownership: borrows the client and the reference model,
// which must outlive Stop().
#ifndef MOE_TESTS_TRAFFIC_H_
#define MOE_TESTS_TRAFFIC_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "tests/test_util.h"

namespace moe::testing {

struct TrafficOptions {
  int threads = 3;
  int tokens = 8;
  // Expert popularity (r + 1)^-skew over a per-layer random order; 0 is uniform.
  double skew = 1.2;
  uint64_t seed = 1;
  absl::Duration call_deadline = absl::Seconds(30);
  // By expert id: experts whose calls may fail with UNAVAILABLE (lost with a removed shard).
  std::vector<bool> fragile_experts;
};

struct CallRecord {
  absl::Time start;
  absl::Time end;
  int layer = 0;
  absl::Status status;  // INTERNAL when the output did not match the reference
  bool touches_fragile = false;
  int attempts = 0;
  uint64_t map_version = 0;
};

class Traffic {
 public:
  Traffic(MoeClient* client, const ReferenceModel* reference, TrafficOptions options);
  Traffic(const Traffic&) = delete;
  Traffic& operator=(const Traffic&) = delete;
  ~Traffic();  // Stop()

  void Start();
  // Lets every thread finish its current call and joins them; idempotent.
  void Stop();

  // Blocks until `n` calls have finished since Start (bounded polling); false on timeout.
  bool WaitForCalls(int64_t n, absl::Duration timeout) const;
  int64_t finished() const { return finished_.load(); }

  std::vector<CallRecord> records() const;
  // [L][E]: routes (unpadded token x k) of the successful calls.
  std::vector<std::vector<int64_t>> routed() const;

 private:
  void Run(int thread);
  absl::Status OneCall(int thread, uint64_t call, CallRecord& record,
                       std::vector<std::vector<int64_t>>& routed);

  MoeClient* const client_;
  const ReferenceModel* const reference_;
  const TrafficOptions options_;
  std::vector<std::vector<int32_t>> popularity_;  // [L]: experts from most to least popular
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> finished_{0};
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  std::vector<CallRecord> records_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<int64_t>> routed_ ABSL_GUARDED_BY(mu_);
};

// Mean / max of `load` over the entries where `include` is true (1 when all are zero).
double BalancednessOf(const std::vector<int64_t>& load, const std::vector<bool>& include);

}  // namespace moe::testing

#endif  // MOE_TESTS_TRAFFIC_H_
