#include "server/coordinator/coordinator_metrics.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/metrics.h"

namespace moe {
namespace {

using Label = prometheus::ClientMetric::Label;

std::vector<prometheus::MetricFamily> LayerFamilies(const v1::LoadStats& stats,
                                                    const LoadWindow& window) {
  prometheus::MetricFamily routes = CounterFamily(
      "moe_coordinator_layer_routes_total", "Routes counted for the layer (all its experts).");
  prometheus::MetricFamily balance =
      GaugeFamily("moe_coordinator_layer_balancedness",
                  "Mean shard load / max shard load of the layer, cumulative (1 when idle).");
  prometheus::MetricFamily window_balance = GaugeFamily(
      "moe_coordinator_layer_window_balancedness",
      "Mean shard load / max shard load of the layer over the load window (absent when idle).");
  for (const v1::LayerLoad& layer : stats.layers()) {
    const std::string l = absl::StrCat(layer.layer());
    int64_t total = 0;
    for (int64_t v : layer.expert_load()) total += v;
    AddSample(routes, static_cast<double>(total), {{"layer", l}});
    AddSample(balance, layer.balancedness(), {{"layer", l}});
    if (layer.layer() < window.balancedness.size() &&
        !std::isnan(window.balancedness[layer.layer()])) {
      AddSample(window_balance, window.balancedness[layer.layer()], {{"layer", l}});
    }
  }
  return {std::move(routes), std::move(balance), std::move(window_balance)};
}

std::vector<prometheus::MetricFamily> ShardFamilies(const v1::LoadStats& stats) {
  prometheus::MetricFamily alive =
      GaugeFamily("moe_coordinator_shard_alive", "1 while the shard's heartbeats are current.");
  prometheus::MetricFamily routes = CounterFamily("moe_coordinator_shard_routes_total",
                                                  "Routes the shard served, summed over layers.");
  prometheus::MetricFamily requests =
      CounterFamily("moe_coordinator_shard_requests_total", "Forward requests the shard reported.");
  prometheus::MetricFamily tokens =
      CounterFamily("moe_coordinator_shard_tokens_total", "Tokens the shard reported.");
  prometheus::MetricFamily batches =
      CounterFamily("moe_coordinator_shard_batches_total", "Executor batches the shard reported.");
  prometheus::MetricFamily merged =
      CounterFamily("moe_coordinator_shard_merged_batches_total",
                    "Executor batches that merged several requests, as the shard reported.");
  for (const v1::ShardLoad& shard : stats.shards()) {
    std::vector<Label> rank = {{"rank", absl::StrCat(shard.rank())}};
    int64_t served = 0;
    for (const v1::LayerLoad& layer : stats.layers()) {
      if (shard.rank() < static_cast<uint32_t>(layer.shard_load_size())) {
        served += layer.shard_load(shard.rank());
      }
    }
    AddSample(alive, shard.alive() ? 1 : 0, rank);
    AddSample(routes, static_cast<double>(served), rank);
    AddSample(requests, static_cast<double>(shard.requests()), rank);
    AddSample(tokens, static_cast<double>(shard.tokens()), rank);
    AddSample(batches, static_cast<double>(shard.batches()), rank);
    AddSample(merged, static_cast<double>(shard.merged_batches()), rank);
  }
  return {std::move(alive),  std::move(routes),  std::move(requests),
          std::move(tokens), std::move(batches), std::move(merged)};
}

prometheus::MetricFamily ExpertFamily(const v1::LoadStats& stats) {
  prometheus::MetricFamily experts =
      CounterFamily("moe_coordinator_expert_routes_total",
                    "Routes per logical expert, summed over its replicas.");
  for (const v1::LayerLoad& layer : stats.layers()) {
    const std::string l = absl::StrCat(layer.layer());
    for (int e = 0; e < layer.expert_load_size(); ++e) {
      AddSample(experts, static_cast<double>(layer.expert_load(e)),
                {{"layer", l}, {"expert", absl::StrCat(e)}});
    }
  }
  return experts;
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(const ClusterState* state, const LoadHistory* history,
                                       int expected_shards, bool per_expert)
    : state_(state),
      history_(history),
      expected_shards_(expected_shards),
      per_expert_(per_expert) {}

std::vector<prometheus::MetricFamily> CoordinatorMetrics::Collect() const {
  const v1::LoadStats stats = state_->GetLoadStats();
  const absl::StatusOr<v1::ClusterMap> map = state_->GetClusterMap();
  int alive = 0, ready = 0;
  for (const v1::ShardLoad& shard : stats.shards()) alive += shard.alive() ? 1 : 0;
  if (map.ok()) {
    for (const v1::ShardEntry& shard : map->shards()) ready += shard.ready() ? 1 : 0;
  }
  std::vector<prometheus::MetricFamily> families;
  auto gauge = [&families](const char* name, const char* help, double value) {
    families.push_back(GaugeFamily(name, help));
    AddSample(families.back(), value);
  };
  gauge("moe_coordinator_shards_expected", "Shards the cluster map is laid out for.",
        expected_shards_);
  gauge("moe_coordinator_shards_alive", "Registered shards whose heartbeats are current.", alive);
  gauge("moe_coordinator_shards_ready", "Shards with the current map's weights loaded.", ready);
  gauge("moe_coordinator_map_version", "Published cluster-map version (0: none yet).",
        static_cast<double>(stats.map_version()));
  const LoadWindow window = history_->Window(absl::Now(), stats);
  for (auto& f : LayerFamilies(stats, window)) families.push_back(std::move(f));
  for (auto& f : ShardFamilies(stats)) families.push_back(std::move(f));
  if (per_expert_) families.push_back(ExpertFamily(stats));
  return families;
}

}  // namespace moe
