// CoordinatorMetrics: the coordinator's Prometheus families, computed from ClusterState (and the
// windowed LoadHistory) each time /metrics is scraped; nothing is counted on the RPC paths.
//
// Series (bounded: per layer and per shard rank; per (layer, expert) only when per_expert is set):
//   moe_coordinator_shards_expected                 shards the map is laid out for
//   moe_coordinator_shards_alive / _ready           registered shards heartbeating / loaded
//   moe_coordinator_map_version                     published cluster-map version (0: none yet)
//   moe_coordinator_layer_routes_total{layer}       routes counted for the layer, cumulative
//   moe_coordinator_layer_balancedness{layer}       mean/max shard load, cumulative (1 when idle)
//   moe_coordinator_layer_window_balancedness{layer} the same over the load window (layers with
//                                                   load in the window only)
//   moe_coordinator_shard_alive{rank}               1 while the shard heartbeats
//   moe_coordinator_shard_routes_total{rank}        routes the shard served, all layers
//   moe_coordinator_shard_requests_total{rank}, _tokens_total{rank}, _batches_total{rank},
//   moe_coordinator_shard_merged_batches_total{rank}  executor totals the shard reported
//   moe_coordinator_expert_routes_total{layer,expert} per_expert only: routes per logical expert
//
// Created by CoordinatorObservability. Thread-safety: Collect is thread-safe (ClusterState and
// LoadHistory are). Ownership: borrows the state and the history, which must outlive the
// metrics endpoint that scrapes this.
#ifndef MOE_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
#define MOE_SERVER_COORDINATOR_COORDINATOR_METRICS_H_

#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/load_history.h"

namespace moe {

class CoordinatorMetrics final : public prometheus::Collectable {
 public:
  CoordinatorMetrics(const ClusterState* state, const LoadHistory* history, int expected_shards,
                     bool per_expert);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const ClusterState* const state_;
  const LoadHistory* const history_;
  const int expected_shards_;
  const bool per_expert_;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
