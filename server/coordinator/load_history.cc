#include "server/coordinator/load_history.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "glog/logging.h"

namespace moe {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

}  // namespace

double ShardBalancedness(const std::vector<int64_t>& shard_load) {
  if (shard_load.empty()) return kNaN;
  int64_t max = 0, sum = 0;
  for (int64_t v : shard_load) {
    max = std::max(max, v);
    sum += v;
  }
  if (max <= 0) return kNaN;
  return static_cast<double>(sum) / shard_load.size() / max;
}

LoadHistory::LoadHistory(LoadHistoryOptions options) : options_(options) {
  CHECK_GE(options_.window_samples, 1);
  CHECK_GE(options_.history_points, 1);
}

LoadHistory::Snapshot LoadHistory::Flatten(absl::Time time, const v1::LoadStats& stats) {
  Snapshot s;
  s.time = time;
  s.num_layers = stats.layers_size();
  for (const v1::LayerLoad& layer : stats.layers()) {
    s.num_experts = std::max(s.num_experts, layer.expert_load_size());
    s.num_shards = std::max(s.num_shards, layer.shard_load_size());
  }
  s.expert_load.assign(static_cast<size_t>(s.num_layers) * s.num_experts, 0);
  s.shard_load.assign(static_cast<size_t>(s.num_layers) * s.num_shards, 0);
  for (int l = 0; l < s.num_layers; ++l) {
    const v1::LayerLoad& layer = stats.layers(l);
    std::copy(layer.expert_load().begin(), layer.expert_load().end(),
              s.expert_load.begin() + static_cast<size_t>(l) * s.num_experts);
    std::copy(layer.shard_load().begin(), layer.shard_load().end(),
              s.shard_load.begin() + static_cast<size_t>(l) * s.num_shards);
  }
  return s;
}

bool LoadHistory::Difference(const Snapshot& later, const Snapshot& earlier, Snapshot* delta) {
  // Before the first registration there is no model (no layers) and so no load: everything
  // counted since is new, even when the model's first load arrived within one sampling interval.
  if (earlier.num_layers == 0) {
    *delta = later;
    return true;
  }
  if (later.num_layers != earlier.num_layers || later.num_experts != earlier.num_experts ||
      later.num_shards != earlier.num_shards) {
    return false;
  }
  *delta = later;
  for (size_t i = 0; i < delta->expert_load.size(); ++i) {
    delta->expert_load[i] -= earlier.expert_load[i];
    if (delta->expert_load[i] < 0) return false;
  }
  for (size_t i = 0; i < delta->shard_load.size(); ++i) {
    delta->shard_load[i] -= earlier.shard_load[i];
    if (delta->shard_load[i] < 0) return false;
  }
  return true;
}

BalancednessPoint LoadHistory::PointFromDelta(const Snapshot& delta) {
  BalancednessPoint point;
  point.time = delta.time;
  double sum = 0, min = kNaN;
  int active = 0;
  for (int l = 0; l < delta.num_layers; ++l) {
    const auto first = delta.shard_load.begin() + static_cast<size_t>(l) * delta.num_shards;
    const double b = ShardBalancedness(std::vector<int64_t>(first, first + delta.num_shards));
    point.per_layer.push_back(b);
    if (std::isnan(b)) continue;
    sum += b;
    min = active == 0 ? b : std::min(min, b);
    ++active;
  }
  point.mean = active > 0 ? sum / active : kNaN;
  point.min = min;
  return point;
}

void LoadHistory::Add(absl::Time time, const v1::LoadStats& stats) {
  Snapshot snapshot = Flatten(time, stats);
  absl::MutexLock lock(&mu_);
  if (!snapshots_.empty() && time < snapshots_.back().time) return;
  Snapshot delta;
  if (!snapshots_.empty() && !Difference(snapshot, snapshots_.back(), &delta)) {
    LOG(INFO) << "load counts were reset or reshaped; restarting the load history";
    snapshots_.clear();
    points_.clear();
  } else if (!snapshots_.empty()) {
    points_.push_back(PointFromDelta(delta));
    if (points_.size() > static_cast<size_t>(options_.history_points)) points_.pop_front();
  }
  snapshots_.push_back(std::move(snapshot));
  if (snapshots_.size() > static_cast<size_t>(options_.window_samples) + 1) snapshots_.pop_front();
}

LoadWindow LoadHistory::Window(absl::Time now, const v1::LoadStats& current) const {
  Snapshot latest = Flatten(now, current);
  LoadWindow window;
  window.num_layers = latest.num_layers;
  window.num_experts = latest.num_experts;
  window.expert_load.assign(latest.expert_load.size(), 0);
  window.balancedness.assign(latest.num_layers, kNaN);
  absl::MutexLock lock(&mu_);
  Snapshot delta;
  if (snapshots_.empty() || !Difference(latest, snapshots_.front(), &delta)) return window;
  window.span = std::max(absl::ZeroDuration(), now - snapshots_.front().time);
  window.expert_load = std::move(delta.expert_load);
  for (int64_t v : window.expert_load) window.routes += v;
  for (int l = 0; l < delta.num_layers; ++l) {
    const auto first = delta.shard_load.begin() + static_cast<size_t>(l) * delta.num_shards;
    window.balancedness[l] =
        ShardBalancedness(std::vector<int64_t>(first, first + delta.num_shards));
  }
  return window;
}

std::vector<BalancednessPoint> LoadHistory::Balancedness() const {
  absl::MutexLock lock(&mu_);
  return std::vector<BalancednessPoint>(points_.begin(), points_.end());
}

}  // namespace moe
