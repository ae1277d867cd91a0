// Supervisor: the coordinator's background upkeep thread. Several times per heartbeat interval it
// calls ClusterState::Tick (missed heartbeats, switch commits and timeouts, drain periods,
// balancedness samples); once per interval it health-checks the serving shards through the
// standard grpc.health.v1.Health/Check and removes a shard that is unreachable twice in a row, or
// that times out or answers NOT_SERVING three rounds in a row; with a rebalance interval set it
// runs the periodic EPLB policy (a Rebalance with the configured minimum gain).
//
// Created and stopped by CoordinatorServer. Thread-safety: Start and Stop from one thread; the
// loop runs on its own thread. Ownership: borrows the ClusterState; owns its thread and channels.
#ifndef MOE_SERVER_COORDINATOR_SUPERVISOR_H_
#define MOE_SERVER_COORDINATOR_SUPERVISOR_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "server/coordinator/cluster_state.h"

namespace moe {

struct SupervisorOptions {
  // How often Tick runs; health checks run every `probe_interval`.
  absl::Duration tick = absl::Milliseconds(100);
  absl::Duration probe_interval = absl::Milliseconds(500);
  bool health_checks = true;
  // Periodic rebalancing: 0 turns it off.
  absl::Duration rebalance_interval = absl::ZeroDuration();
  double rebalance_min_gain = 0.05;
};

// How one health check ended.
enum class ProbeOutcome { kServing, kNotServing, kUnreachable, kTimedOut };

struct ProbeResult {
  ShardTarget target;
  ProbeOutcome outcome = ProbeOutcome::kServing;
  std::string detail;  // the RPC error or the reported status
};

// Health-checks every target at once (grpc.health.v1 with an empty service name) and returns one
// result per target, in order, within `timeout`. Keeps one channel per address. Not thread-safe.
class HealthProber {
 public:
  explicit HealthProber(absl::Duration timeout) : timeout_(timeout) {}
  std::vector<ProbeResult> ProbeAll(const std::vector<ShardTarget>& targets);

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);

  const absl::Duration timeout_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_;
};

class Supervisor {
 public:
  // REQUIRES: `state` outlives the supervisor; options.tick > 0 and probe_interval > 0.
  Supervisor(ClusterState* state, SupervisorOptions options);
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  ~Supervisor();  // Stop()

  void Start();
  // Ends the loop and joins the thread; idempotent.
  void Stop();

 private:
  void Loop();
  void Probe();
  void MaybeRebalance();

  ClusterState* const state_;
  const SupervisorOptions options_;
  HealthProber prober_;  // used by the loop thread only
  // Consecutive rounds timed out or NOT_SERVING, by shard id.
  absl::flat_hash_map<std::string, int> strikes_;
  absl::Time next_probe_;
  absl::Time next_rebalance_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_SUPERVISOR_H_
