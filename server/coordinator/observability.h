// CoordinatorObservability: the coordinator's HTTP side. It samples the cluster's cumulative load
// every sample_interval into a LoadHistory, serves Prometheus /metrics (CoordinatorMetrics, read
// at scrape time) and the dashboard (`/` HTML page, `/api/load` JSON) on its own port.
//
// Port convention of both endpoints (server/common/metrics.h): -1 off, 0 a free port (logged and
// written to the port file), otherwise that port. Both bind the loopback address by default.
//
// Created by moe_coordinator's main after the CoordinatorServer has started, destroyed before it.
// Thread-safety: immutable after Start except for its internal sampler thread and the HTTP
// threads, which only read the ClusterState and the (thread-safe) LoadHistory.
// Ownership: borrows the ClusterState (which must outlive this object); owns the rest.
#ifndef MOE_SERVER_COORDINATOR_OBSERVABILITY_H_
#define MOE_SERVER_COORDINATOR_OBSERVABILITY_H_

#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/common/metrics.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/dashboard_http.h"
#include "server/coordinator/dashboard_page.h"
#include "server/coordinator/load_history.h"

namespace moe {

struct ObservabilityOptions {
  HttpEndpointOptions metrics{.port = kHttpPortOff};
  HttpEndpointOptions dashboard{.port = kHttpPortOff};
  // Export moe_coordinator_expert_routes_total{layer,expert} (layers x experts series).
  bool metrics_per_expert = false;
  // How often the cumulative load is sampled for the window and the balancedness history.
  absl::Duration sample_interval = absl::Seconds(1);
  LoadHistoryOptions history;
  // The cluster's shard count (shown as expected shards).
  int expected_shards = 1;
};

// INVALID_ARGUMENT naming the first bad option.
absl::Status ValidateObservabilityOptions(const ObservabilityOptions& options);

class CoordinatorObservability {
 public:
  // Starts whichever endpoints are on (and the sampler when either is); UNAVAILABLE when a port
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorObservability>> Start(
      const ObservabilityOptions& options, const ClusterState* state);

  CoordinatorObservability(const CoordinatorObservability&) = delete;
  CoordinatorObservability& operator=(const CoordinatorObservability&) = delete;
  // Stops the HTTP endpoints, then the sampler.
  ~CoordinatorObservability();

  // Bound ports; 0 for an endpoint that is off.
  int metrics_port() const;
  int dashboard_port() const;

  // What the dashboard shows right now.
  DashboardSnapshot Snapshot() const;

 private:
  CoordinatorObservability(const ObservabilityOptions& options, const ClusterState* state);
  void SampleLoop();
  HttpReply Handle(absl::string_view path, absl::string_view query) const;

  const ObservabilityOptions options_;
  const ClusterState* const state_;
  LoadHistory history_;
  std::shared_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unique_ptr<DashboardHttpServer> dashboard_;
  absl::Notification stop_sampling_;
  std::thread sampler_;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_OBSERVABILITY_H_
