// ClusterState's placement changes: EPLB rebalancing, drains, shard removal and restoration, and
// the two-phase switch that carries each of them out (see cluster_state.h).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/eplb_planner.h"
#include "server/coordinator/placement.h"

namespace moe {
namespace {

// Versions older than the oldest accepted one whose placements are kept anyway, so that a load
// delta recorded just before a version stopped being accepted can still be attributed.
constexpr size_t kOldPlacementsKept = 4;

// The planner's GPUs are the eligible ranks in ascending order.
std::vector<int32_t> GpuOfRank(const std::vector<bool>& eligible) {
  std::vector<int32_t> gpu(eligible.size(), -1);
  int next = 0;
  for (size_t r = 0; r < eligible.size(); ++r) {
    if (eligible[r]) gpu[r] = next++;
  }
  return gpu;
}

void FillPlanReport(const EplbPlan& plan, int64_t expert_bytes, v1::RebalancePlan* out) {
  double before = 0, after = 0;
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    const EplbLayerPlan& lp = plan.layers[l];
    v1::LayerRebalance* layer = out->add_layers();
    layer->set_layer(static_cast<uint32_t>(l));
    layer->set_balancedness_before(lp.balancedness_before);
    layer->set_balancedness_after(lp.balancedness_after);
    layer->set_changed(lp.changed);
    layer->set_moved_experts(static_cast<uint32_t>(lp.moved_experts));
    before += lp.balancedness_before;
    after += lp.balancedness_after;
  }
  const double layers = static_cast<double>(std::max<size_t>(plan.layers.size(), 1));
  out->set_mean_balancedness_before(before / layers);
  out->set_mean_balancedness_after(after / layers);
  out->set_moved_experts(static_cast<uint64_t>(plan.moved_experts));
  out->set_bytes_to_move(static_cast<uint64_t>(plan.moved_experts * expert_bytes));
  out->set_hierarchical(plan.hierarchical);
}

}  // namespace

bool ClusterState::Serving(const ShardRecord& shard) {
  return shard.state == v1::SHARD_ACTIVE || shard.state == v1::SHARD_DRAINING;
}

bool ClusterState::HostsSlotLocked(int rank, uint64_t version) const {
  auto it = placements_.find(version);
  if (it == placements_.end()) return false;
  const VersionPlacement& p = it->second;
  for (size_t i = 0; i < p.physical_to_logical.size(); ++i) {
    if (p.slot_to_rank[i % num_physical_] == static_cast<uint32_t>(rank) &&
        p.physical_to_logical[i] >= 0) {
      return true;
    }
  }
  return false;
}

std::vector<bool> ClusterState::RanksLocked(bool active_only) const {
  const absl::Time now = options_.now();
  std::vector<bool> ranks(options_.num_shards, false);
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value()) continue;
    const ShardRecord& shard = *shards_[r];
    ranks[r] =
        active_only ? shard.state == v1::SHARD_ACTIVE && IsAliveLocked(shard, now) : Serving(shard);
  }
  return ranks;
}

uint64_t ClusterState::NewVersionLocked(VersionPlacement placement) {
  placements_[++last_version_] = std::move(placement);
  return last_version_;
}

void ClusterState::StartSwitchLocked(VersionPlacement placement, std::string reason) {
  const uint64_t version = NewVersionLocked(std::move(placement));
  LOG(INFO) << "placement switch to map version " << version << " (" << reason
            << "): shards load their new slots while serving version " << version_;
  pending_ = PendingSwitch{version, std::move(reason), options_.now()};
  MapChangedLocked();
  MaybeCommitLocked();
}

void ClusterState::MaybeCommitLocked() {
  if (!pending_.has_value()) return;
  const uint64_t version = pending_->version;
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value() || !Serving(*shards_[r])) continue;
    if (shards_[r]->ready_map_version < version && HostsSlotLocked(r, version)) return;
  }
  LOG(INFO) << "committed map version " << version << " (" << pending_->reason << ") after "
            << absl::FormatDuration(options_.now() - pending_->started);
  version_ = version;
  committed_at_ = options_.now();
  intended_ = placements_.at(version).physical_to_logical;
  pending_.reset();
  MapChangedLocked();
}

void ClusterState::RemoveShardLocked(int rank, const std::string& why) {
  ShardRecord& shard = *shards_[rank];
  if (!Serving(shard)) return;
  shard.state = v1::SHARD_FAILED;
  LOG(WARNING) << "removing " << shard.shard_id << " (rank " << rank << ", " << shard.address
               << ") from the cluster: " << why;
  if (pending_.has_value()) {
    LOG(WARNING) << "abandoning the switch to map version " << pending_->version << " ("
                 << pending_->reason << ")";
    pending_.reset();
  }
  if (version_ > 0) {
    const VersionPlacement& current = CommittedLocked();
    VersionPlacement removed{current.slot_to_rank,
                             VacateRank(current.physical_to_logical, current.slot_to_rank,
                                        static_cast<uint32_t>(rank), RanksLocked(false))};
    if (removed.physical_to_logical != current.physical_to_logical) {
      version_ = NewVersionLocked(std::move(removed));
      committed_at_ = options_.now();
      LOG(WARNING) << "committed map version " << version_ << " without rank " << rank
                   << "'s replicated slots";
    }
    if (options_.restore_after_failure) StartRestorationLocked();
  }
  MapChangedLocked();
}

void ClusterState::StartRestorationLocked() {
  const std::vector<bool> eligible = RanksLocked(true);
  if (std::find(eligible.begin(), eligible.end(), true) == eligible.end()) {
    LOG(ERROR) << "no active shard left to take the removed shards' slots";
    return;
  }
  const VersionPlacement& current = CommittedLocked();
  VersionPlacement next{BalanceSlotLayout(current.slot_to_rank, eligible), intended_};
  if (next.slot_to_rank == current.slot_to_rank &&
      next.physical_to_logical == current.physical_to_logical) {
    return;
  }
  StartSwitchLocked(std::move(next), "move slots of removed or draining shards");
}

void ClusterState::FinishDrainLocked(absl::Time now) {
  if (version_ == 0 || now - committed_at_ < options_.switch_drain) return;
  bool changed = false;
  if (min_accepted_version_ < version_) {
    min_accepted_version_ = version_;
    changed = true;
    while (placements_.size() > kOldPlacementsKept &&
           placements_.begin()->first + kOldPlacementsKept < min_accepted_version_) {
      placements_.erase(placements_.begin());
    }
  }
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value() || shards_[r]->state != v1::SHARD_DRAINING) continue;
    if (HostsSlotLocked(r, version_) ||
        (pending_.has_value() && HostsSlotLocked(r, pending_->version))) {
      continue;
    }
    shards_[r]->state = v1::SHARD_DRAINED;
    LOG(INFO) << shards_[r]->shard_id << " (rank " << r << ") is drained";
    changed = true;
  }
  if (changed) MapChangedLocked();
}

void ClusterState::Tick() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.now();
  // Before the first map a silent shard simply has not come back yet; it re-registers.
  for (int r = 0; version_ > 0 && r < options_.num_shards; ++r) {
    if (shards_[r].has_value() && Serving(*shards_[r]) && !IsAliveLocked(*shards_[r], now)) {
      RemoveShardLocked(
          r, absl::StrCat("no heartbeat for ", absl::FormatDuration(now - shards_[r]->last_seen)));
    }
  }
  if (pending_.has_value() && now - pending_->started > options_.switch_timeout) {
    LOG(WARNING) << "abandoning the switch to map version " << pending_->version << " ("
                 << pending_->reason << "): shards not ready after "
                 << absl::FormatDuration(options_.switch_timeout);
    pending_.reset();
    MapChangedLocked();
  }
  MaybeCommitLocked();
  FinishDrainLocked(now);
  if (book_.has_value() && version_ > 0) book_->Advance(now, version_, RanksLocked(false));
  JournalLoadLocked(/*force=*/false);
}

absl::Status ClusterState::ReportUnhealthy(const std::string& shard_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  const int rank = FindShardLocked(shard_id);
  if (rank < 0) return absl::NotFoundError(absl::StrCat("unknown shard_id '", shard_id, "'"));
  RemoveShardLocked(rank, why);
  return absl::OkStatus();
}

std::vector<ShardTarget> ClusterState::ProbeTargets() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.now();
  std::vector<ShardTarget> targets;
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value()) continue;
    const ShardRecord& shard = *shards_[r];
    if (Serving(shard) && IsAliveLocked(shard, now) && shard.ready_map_version > 0) {
      targets.push_back({shard.shard_id, shard.address, static_cast<uint32_t>(r)});
    }
  }
  return targets;
}

absl::StatusOr<bool> ClusterState::AwaitCommit(uint64_t version, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  bool timed_out = false;
  while (true) {
    if (shutting_down_) return absl::UnavailableError("coordinator is shutting down");
    if (version_ >= version) return true;
    if (!pending_.has_value() || pending_->version != version || timed_out) return false;
    timed_out = map_changed_.WaitWithDeadline(&mu_, deadline);
  }
}

uint64_t ClusterState::pending_version() const {
  absl::MutexLock lock(&mu_);
  return pending_.has_value() ? pending_->version : 0;
}

absl::StatusOr<v1::RebalancePlan> ClusterState::Rebalance(const v1::RebalanceRequest& request) {
  if (!(request.window_seconds() >= 0) || !(request.min_gain() >= -1)) {
    return absl::InvalidArgumentError("window_seconds must be >= 0 and min_gain >= -1");
  }
  EplbProblem problem;
  VersionPlacement current;
  std::vector<bool> eligible;
  WindowLoad window;
  uint64_t base_version = 0;
  int64_t expert_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    if (version_ == 0) return absl::UnavailableError("the cluster map is not published yet");
    if (pending_.has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat("a placement switch to map version ", pending_->version, " is in progress"));
    }
    eligible = RanksLocked(true);
    if (std::find(eligible.begin(), eligible.end(), true) == eligible.end()) {
      return absl::FailedPreconditionError("no active shard can take slots");
    }
    base_version = version_;
    current = CommittedLocked();
    window = book_->Window(options_.now(), absl::Seconds(request.window_seconds()));
    problem.num_layers = static_cast<int>(model_->num_layers());
    problem.num_logical = static_cast<int>(model_->num_experts());
    expert_bytes = static_cast<int64_t>(model_->expert_bytes());
  }
  const std::vector<int32_t> gpu_of_rank = GpuOfRank(eligible);
  const std::vector<uint32_t> layout = BalanceSlotLayout(current.slot_to_rank, eligible);
  std::vector<int32_t> slot_to_gpu, current_gpu;
  for (size_t p = 0; p < layout.size(); ++p) {
    slot_to_gpu.push_back(gpu_of_rank[layout[p]]);
    current_gpu.push_back(gpu_of_rank[current.slot_to_rank[p]]);
  }
  const std::vector<double> load(window.expert.begin(), window.expert.end());
  problem.load = load;
  problem.slot_to_gpu = slot_to_gpu;
  problem.num_gpus = *std::max_element(gpu_of_rank.begin(), gpu_of_rank.end()) + 1;
  // Nodes are fixed groups of ranks: the hierarchy holds only while every rank serves.
  const bool all_ranks = problem.num_gpus == options_.num_shards;
  problem.num_nodes = all_ranks ? options_.eplb_nodes : 1;
  problem.num_groups = all_ranks ? options_.eplb_groups : 1;
  problem.current = current.physical_to_logical;
  problem.current_slot_to_gpu = current_gpu;
  problem.min_gain = request.min_gain();
  problem.expert_bytes = expert_bytes;
  const absl::Time start = absl::Now();
  absl::StatusOr<EplbPlan> plan = PlanEplb(problem);
  if (!plan.ok()) return plan.status();
  v1::RebalancePlan out;
  out.set_planning_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  FillPlanReport(*plan, expert_bytes, &out);
  int64_t routes = 0;
  for (int64_t count : window.expert) routes += count;
  out.set_window_routes(routes);
  const bool any_change = std::any_of(plan->layers.begin(), plan->layers.end(),
                                      [](const EplbLayerPlan& l) { return l.changed; });
  if (request.dry_run() || !any_change) return out;
  absl::MutexLock lock(&mu_);
  if (version_ != base_version || pending_.has_value()) {
    return absl::AbortedError("the cluster map changed while planning; rebalance again");
  }
  StartSwitchLocked({layout, std::move(plan->physical_to_logical)}, "rebalance");
  out.set_new_map_version(pending_.has_value() ? pending_->version : version_);
  return out;
}

absl::StatusOr<v1::DrainResponse> ClusterState::Drain(const v1::DrainRequest& request) {
  absl::MutexLock lock(&mu_);
  const int rank = FindShardLocked(request.shard_id());
  if (rank < 0) {
    return absl::NotFoundError(absl::StrCat("unknown shard_id '", request.shard_id(), "'"));
  }
  if (version_ == 0) return absl::UnavailableError("the cluster map is not published yet");
  if (shards_[rank]->state != v1::SHARD_ACTIVE) {
    return absl::FailedPreconditionError(absl::StrCat(
        request.shard_id(), " is ", v1::ShardState_Name(shards_[rank]->state), ", not active"));
  }
  if (pending_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a placement switch to map version ", pending_->version, " is in progress"));
  }
  std::vector<bool> eligible = RanksLocked(true);
  eligible[rank] = false;
  if (std::find(eligible.begin(), eligible.end(), true) == eligible.end()) {
    return absl::FailedPreconditionError("cannot drain the last active shard");
  }
  shards_[rank]->state = v1::SHARD_DRAINING;
  LOG(INFO) << "draining " << request.shard_id() << " (rank " << rank << ")";
  const VersionPlacement& current = CommittedLocked();
  VersionPlacement next{BalanceSlotLayout(current.slot_to_rank, eligible), intended_};
  v1::DrainResponse response;
  for (size_t p = 0; p < next.slot_to_rank.size(); ++p) {
    if (next.slot_to_rank[p] != current.slot_to_rank[p]) {
      response.set_moved_slots(response.moved_slots() + 1);
    }
  }
  if (next.slot_to_rank == current.slot_to_rank &&
      next.physical_to_logical == current.physical_to_logical) {
    MapChangedLocked();  // it hosted nothing: drained once older versions are gone
    response.set_committed(true);
    return response;
  }
  StartSwitchLocked(std::move(next), absl::StrCat("drain ", request.shard_id()));
  response.set_new_map_version(pending_.has_value() ? pending_->version : version_);
  return response;
}

}  // namespace moe
