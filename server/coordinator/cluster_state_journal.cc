// ClusterState persistence: restoring from a replayed journal and appending state changes.
// See journal.h for the file format and cluster_state.h for the locking rules.
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/coordinator/cluster_state.h"

namespace moe {

absl::Status ClusterState::Restore(const JournalState& state) {
  absl::MutexLock lock(&mu_);
  if (model_.has_value()) return absl::FailedPreconditionError("Restore after a registration");
  if (!state.map.has_value()) {
    if (!state.shards.empty()) LOG(WARNING) << "journal has shards but no map; starting fresh";
    return absl::OkStatus();
  }
  const v1::ClusterMap& map = *state.map;
  if (absl::Status s = FixModelLocked(map.model()); !s.ok()) return s;
  const size_t layers = map.model().num_layers();
  VersionPlacement placement;
  placement.slot_to_rank.assign(map.slot_to_rank().begin(), map.slot_to_rank().end());
  for (const v1::LayerPlacementProto& layer : map.layers()) {
    placement.physical_to_logical.insert(placement.physical_to_logical.end(),
                                         layer.physical_to_logical().begin(),
                                         layer.physical_to_logical().end());
  }
  const size_t slots = static_cast<size_t>(num_physical_);
  bool ranks_ok = true;
  for (uint32_t r : placement.slot_to_rank) ranks_ok &= r < static_cast<uint32_t>(options_.num_shards);
  if (map.version() == 0 || map.num_physical() != slots || placement.slot_to_rank.size() != slots ||
      placement.physical_to_logical.size() != layers * slots || !ranks_ok) {
    model_.reset();
    book_.reset();
    placements_.clear();
    return absl::FailedPreconditionError(absl::StrCat(
        "journaled map version ", map.version(), " does not fit this coordinator (",
        options_.num_shards, " shards, ", options_.redundant_slots, " redundant slots)"));
  }
  placements_.clear();
  intended_ = placement.physical_to_logical;
  placements_[map.version()] = std::move(placement);
  version_ = map.version();
  min_accepted_version_ = map.version();
  // A pending version may have reached shards before the crash: never hand its number out again.
  last_version_ = std::max(map.version(), map.pending().version());
  journaled_version_ = version_;
  journaled_pending_ = 0;
  committed_at_ = options_.now();
  // Restored shards keep their rank for their address and look alive (but not ready) for one
  // heartbeat timeout: long enough to re-register before being removed. Their old shard ids
  // are not restored, so a heartbeat from before the restart gets NOT_FOUND and re-registers.
  next_shard_serial_ = static_cast<uint64_t>(absl::ToUnixMillis(options_.now()));
  for (const auto& [rank, shard] : state.shards) {
    if (rank >= static_cast<uint32_t>(options_.num_shards)) continue;
    ShardRecord record;
    record.shard_id = absl::StrCat("restored-", rank);
    record.address = shard.address;
    record.last_seen = options_.now();
    record.state = v1::SHARD_ACTIVE;
    shards_[rank] = std::move(record);
  }
  if (state.load.has_value() &&
      !book_->RestoreTotals(state.load->slot, state.load->expert, state.load->shard)) {
    LOG(WARNING) << "journaled load totals do not match the model shape; load starts at zero";
  }
  LOG(INFO) << "restored cluster map version " << version_ << " (next version above "
            << last_version_ << ") with " << state.shards.size() << " known shards";
  return absl::OkStatus();
}

void ClusterState::JournalMapLocked() {
  const uint64_t pending = pending_.has_value() ? pending_->version : 0;
  if (options_.journal == nullptr || version_ == 0 ||
      (version_ == journaled_version_ && pending == journaled_pending_)) {
    return;
  }
  if (absl::Status s = options_.journal->AppendMap(BuildMapLocked()); !s.ok()) {
    LOG(ERROR) << "cannot journal map version " << version_ << ": " << s;
    return;
  }
  journaled_version_ = version_;
  journaled_pending_ = pending;
}

void ClusterState::JournalShardLocked(int rank) {
  if (options_.journal == nullptr || !shards_[rank].has_value()) return;
  JournalShard shard;
  shard.rank = static_cast<uint32_t>(rank);
  shard.shard_id = shards_[rank]->shard_id;
  shard.address = shards_[rank]->address;
  if (model_.has_value()) shard.model_fingerprint = model_->fingerprint();
  if (absl::Status s = options_.journal->AppendShard(shard); !s.ok()) {
    LOG(ERROR) << "cannot journal the registration of rank " << rank << ": " << s;
  }
}

void ClusterState::JournalLoadLocked(bool force) {
  if (options_.journal == nullptr || !book_.has_value()) return;
  if (!force && ++ticks_since_snapshot_ < options_.load_snapshot_ticks) return;
  ticks_since_snapshot_ = 0;
  JournalLoad load;
  book_->Totals(&load.slot, &load.expert, &load.shard);
  if (absl::Status s = options_.journal->AppendLoad(load); !s.ok()) {
    LOG(ERROR) << "cannot journal a load snapshot: " << s;
  }
}

}  // namespace moe
