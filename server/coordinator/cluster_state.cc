#include "server/coordinator/cluster_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "glog/logging.h"
#include "server/coordinator/placement.h"

namespace moe {
namespace {

// Bounds on what a registration may ask the coordinator to allocate ([L, P] counters and
// placements); far above real models (DeepSeek-V3: 58 layers x 288 slots).
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxExperts = 1 << 16;
constexpr int64_t kMaxLayerSlots = int64_t{1} << 24;
// One collection interval cannot plausibly route more than this to one slot; the bound keeps the
// cumulative int64 counters far from overflow.
constexpr int64_t kMaxDeltaCount = int64_t{1} << 40;

absl::Status ValidateModel(const v1::ModelShape& model, const ClusterOptions& options) {
  if (model.num_layers() < 1 || model.num_layers() > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("model.num_layers must be in [1, ", kMaxLayers,
                                                   "], got ", model.num_layers()));
  }
  if (model.num_experts() < 1 || model.num_experts() > kMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("model.num_experts must be in [1, ", kMaxExperts,
                                                   "], got ", model.num_experts()));
  }
  if (model.top_k() < 1 || model.top_k() > model.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat("model.top_k must be in [1, num_experts = ",
                                                   model.num_experts(), "], got ", model.top_k()));
  }
  const int64_t num_physical = int64_t{model.num_experts()} + options.redundant_slots;
  if (num_physical * model.num_layers() > kMaxLayerSlots) {
    return absl::InvalidArgumentError(absl::StrCat("model has ", model.num_layers(), " layers x ",
                                                   num_physical, " slots, above the limit of ",
                                                   kMaxLayerSlots));
  }
  if (num_physical < options.num_shards) {
    return absl::FailedPreconditionError(
        absl::StrCat("model has ", model.num_experts(), " experts + ", options.redundant_slots,
                     " redundant slots, fewer than the ", options.num_shards, " shards"));
  }
  return absl::OkStatus();
}

// Names every field in which `got` differs from the fixed model; empty when they agree.
std::string DescribeModelMismatch(const v1::ModelShape& fixed, const v1::ModelShape& got) {
  std::vector<std::string> diffs;
  if (fixed.fingerprint() != got.fingerprint()) {
    diffs.push_back(
        absl::StrCat("fingerprint '", got.fingerprint(), "' != '", fixed.fingerprint(), "'"));
  }
  const struct {
    const char* name;
    uint32_t fixed;
    uint32_t got;
  } fields[] = {
      {"num_layers", fixed.num_layers(), got.num_layers()},
      {"num_experts", fixed.num_experts(), got.num_experts()},
      {"top_k", fixed.top_k(), got.top_k()},
      {"hidden_size", fixed.hidden_size(), got.hidden_size()},
      {"intermediate_size", fixed.intermediate_size(), got.intermediate_size()},
  };
  for (const auto& f : fields) {
    if (f.fixed != f.got) diffs.push_back(absl::StrCat(f.name, " ", f.got, " != ", f.fixed));
  }
  return absl::StrJoin(diffs, ", ");
}

}  // namespace

ClusterState::ClusterState(ClusterOptions options) : options_(std::move(options)) {
  CHECK_GE(options_.num_shards, 1);
  CHECK_GE(options_.redundant_slots, 0);
  CHECK_GT(options_.heartbeat_interval, absl::ZeroDuration());
  CHECK_GE(options_.missed_heartbeats_until_dead, 1);
  CHECK(options_.now != nullptr);
  absl::MutexLock lock(&mu_);
  shards_.resize(options_.num_shards);
}

absl::StatusOr<v1::RegisterShardResponse> ClusterState::RegisterShard(
    const v1::RegisterShardRequest& request) {
  if (request.address().empty()) return absl::InvalidArgumentError("address is empty");
  if (!request.has_model()) return absl::InvalidArgumentError("model is missing");
  if (absl::Status s = ValidateModel(request.model(), options_); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  if (absl::Status s = FixModelLocked(request.model()); !s.ok()) return s;
  absl::StatusOr<int> rank = ChooseRankLocked(request);
  if (!rank.ok()) return rank.status();

  ShardRecord record;
  if (shards_[*rank].has_value()) {
    // The same address coming back (a restart), or a new shard taking over a removed rank: the
    // rank's counters continue, so they stay monotonic.
    record = *std::move(shards_[*rank]);
    record.ready_map_version = 0;
    record.state = v1::SHARD_ACTIVE;
  }
  record.shard_id = absl::StrCat("shard-", *rank, "-", next_shard_serial_++);
  record.address = request.address();
  record.device = request.device();
  record.backend = request.backend();
  record.last_seen = options_.now();
  LOG(INFO) << "registered " << record.shard_id << " at " << record.address << " (rank " << *rank
            << ", " << record.backend << " " << record.device << ")";
  shards_[*rank] = std::move(record);
  JournalShardLocked(*rank);

  if (version_ == 0 && RegisteredCountLocked() == options_.num_shards) {
    version_ = 1;
    min_accepted_version_ = 1;
    committed_at_ = options_.now();
    LOG(INFO) << "published cluster map version 1: " << options_.num_shards << " shards, "
              << num_physical_ << " slots per layer";
  }
  if (version_ > 0) MapChangedLocked();

  v1::RegisterShardResponse response;
  response.set_shard_id(shards_[*rank]->shard_id);
  response.set_rank(static_cast<uint32_t>(*rank));
  response.set_heartbeat_interval_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return response;
}

absl::Status ClusterState::FixModelLocked(const v1::ModelShape& model) {
  if (model_.has_value()) {
    const std::string mismatch = DescribeModelMismatch(*model_, model);
    if (mismatch.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("shard serves a different model than the cluster: ", mismatch));
  }
  model_ = model;
  const int num_logical = static_cast<int>(model.num_experts());
  num_physical_ = num_logical + options_.redundant_slots;
  VersionPlacement initial;
  initial.slot_to_rank = RankMajorSlotToRank(num_physical_, options_.num_shards);
  if (!EveryRankHostsASlot(initial.slot_to_rank, options_.num_shards)) {
    LOG(WARNING) << num_physical_ << " slots over " << options_.num_shards
                 << " shards leaves the last ranks without slots (rank-major layout)";
  }
  const std::vector<int32_t> layer =
      InitialPhysicalToLogical(num_logical, options_.redundant_slots);
  for (uint32_t l = 0; l < model.num_layers(); ++l) {
    initial.physical_to_logical.insert(initial.physical_to_logical.end(), layer.begin(),
                                       layer.end());
  }
  intended_ = initial.physical_to_logical;
  // Version 1 once every shard has registered.
  placements_[1] = std::move(initial);
  last_version_ = 1;
  LoadBookOptions book;
  book.num_layers = static_cast<int>(model.num_layers());
  book.num_logical = num_logical;
  book.num_physical = num_physical_;
  book.num_shards = options_.num_shards;
  book.bucket = options_.heartbeat_interval;
  book.window = options_.load_window;
  book.max_history = options_.balancedness_history;
  book_.emplace(book, options_.now());
  return absl::OkStatus();
}

absl::StatusOr<int> ClusterState::ChooseRankLocked(const v1::RegisterShardRequest& request) const {
  for (int r = 0; r < options_.num_shards; ++r) {
    if (shards_[r].has_value() && shards_[r]->address == request.address()) return r;
  }
  // A rank is free when nobody holds it or its holder was removed (failed or drained).
  auto free = [this](int r) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !shards_[r].has_value() || !Serving(*shards_[r]);
  };
  const int requested = request.requested_rank();
  if (requested >= 0 && requested < options_.num_shards && free(requested)) return requested;
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value()) return r;
  }
  for (int r = 0; r < options_.num_shards; ++r) {
    if (free(r)) return r;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("all ", options_.num_shards, " shard ranks are taken"));
}

absl::StatusOr<v1::HeartbeatResponse> ClusterState::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  const int rank = FindShardLocked(request.shard_id());
  if (rank < 0) {
    return absl::NotFoundError(
        absl::StrCat("unknown shard_id '", request.shard_id(), "': register again"));
  }
  ShardRecord& shard = *shards_[rank];
  if (shard.state == v1::SHARD_FAILED) {
    // Removed while it was still running (a false alarm or a partition): it must come back as a
    // new shard, with nothing loaded.
    return absl::NotFoundError(absl::StrCat("shard '", request.shard_id(),
                                            "' was removed from the cluster: register again"));
  }
  shard.last_seen = options_.now();
  const bool was_ready = IsReadyLocked(shard);
  const uint64_t was_loaded = shard.ready_map_version;
  shard.ready_map_version = request.ready_map_version();
  if (IsReadyLocked(shard) != was_ready) MapChangedLocked();
  if (shard.ready_map_version != was_loaded) MaybeCommitLocked();

  if (request.has_load()) {
    if (absl::Status s = MergeLoadDeltaLocked(rank, request.load()); !s.ok()) return s;
  }
  v1::HeartbeatResponse response;
  response.set_map_version(version_);
  return response;
}

absl::Status ClusterState::MergeLoadDelta(const std::string& shard_id, const v1::LoadDelta& delta) {
  absl::MutexLock lock(&mu_);
  const int rank = FindShardLocked(shard_id);
  if (rank < 0) return absl::NotFoundError(absl::StrCat("unknown shard_id '", shard_id, "'"));
  return MergeLoadDeltaLocked(rank, delta);
}

absl::Status ClusterState::CheckDeltaLocked(const v1::LoadDelta& delta) const {
  const int64_t num_layers = model_->num_layers();
  const int64_t num_physical = num_physical_;
  // A delta without slot counts (all dimensions 0) carries only executor totals: a shard that
  // has not seen a map yet does not know P.
  if (delta.num_layers() == 0 && delta.num_physical() == 0 && delta.slot_counts_size() == 0) {
    return absl::OkStatus();
  }
  if (delta.num_layers() != num_layers || delta.num_physical() != num_physical ||
      delta.slot_counts_size() != num_layers * num_physical) {
    return absl::InvalidArgumentError(
        absl::StrCat("load delta is [", delta.num_layers(), ", ", delta.num_physical(), "] with ",
                     delta.slot_counts_size(), " counts; the cluster has [", num_layers, ", ",
                     num_physical, "]"));
  }
  for (int i = 0; i < delta.slot_counts_size(); ++i) {
    const int64_t count = delta.slot_counts(i);
    if (count < 0 || count > kMaxDeltaCount) {
      return absl::InvalidArgumentError(
          absl::StrCat("load delta slot_counts[", i, "] = ", count, " is out of range"));
    }
  }
  return absl::OkStatus();
}

bool ClusterState::AddCountsLocked(int rank, const v1::LoadDelta& delta) {
  if (delta.slot_counts_size() == 0) return false;
  // Counts are attributed through the placement they were recorded under; 0 (a peer that does
  // not name it) means the current map.
  const uint64_t version =
      delta.map_version() > 0 ? delta.map_version() : std::max<uint64_t>(version_, 1);
  auto it = placements_.find(version);
  if (it == placements_.end()) {
    LOG_EVERY_N(WARNING, 100) << "load delta of rank " << rank << " names map version " << version
                              << ", which is no longer kept; its counts are dropped";
    return false;
  }
  return book_->Add(rank, it->second, delta.slot_counts(), options_.now());
}

absl::Status ClusterState::MergeLoadDeltaLocked(int rank, const v1::LoadDelta& delta) {
  // A shard's model is fixed by registration, so model_ is set here.
  if (absl::Status s = CheckDeltaLocked(delta); !s.ok()) return s;
  for (const v1::LoadDelta& other : delta.other_versions()) {
    if (absl::Status s = CheckDeltaLocked(other); !s.ok()) return s;
  }
  ShardRecord& shard = *shards_[rank];
  bool foreign = AddCountsLocked(rank, delta);
  for (const v1::LoadDelta& other : delta.other_versions()) {
    foreign = AddCountsLocked(rank, other) || foreign;
  }
  if (foreign && !shard.warned_foreign_slots) {
    shard.warned_foreign_slots = true;
    LOG(WARNING) << shard.shard_id << " (rank " << rank
                 << ") reported load for slots it does not host; those counts are ignored";
  }
  shard.requests += delta.requests();
  shard.tokens += delta.tokens();
  shard.batches += delta.batches();
  shard.merged_batches += delta.merged_batches();
  return absl::OkStatus();
}

absl::StatusOr<v1::ClusterMap> ClusterState::GetClusterMap() const {
  absl::MutexLock lock(&mu_);
  if (version_ == 0) {
    const int registered = RegisteredCountLocked();
    return absl::UnavailableError(absl::StrCat(
        "cluster map not published yet: waiting for ", options_.num_shards - registered,
        " more shards (", registered, " of ", options_.num_shards, " registered)"));
  }
  return BuildMapLocked();
}

uint64_t ClusterState::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

absl::StatusOr<std::optional<MapUpdate>> ClusterState::AwaitMapChange(uint64_t known_version,
                                                                      uint64_t known_generation,
                                                                      absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  bool timed_out = false;
  while (true) {
    if (shutting_down_) return absl::UnavailableError("coordinator is shutting down");
    if (version_ > 0 && (version_ > known_version || generation_ > known_generation)) {
      return MapUpdate{BuildMapLocked(), generation_};
    }
    if (timed_out) return std::nullopt;
    timed_out = map_changed_.WaitWithDeadline(&mu_, deadline);
  }
}

v1::LoadStats ClusterState::GetLoadStats(absl::Duration window) const {
  absl::MutexLock lock(&mu_);
  v1::LoadStats stats;
  stats.set_map_version(version_);
  stats.set_pending_version(pending_.has_value() ? pending_->version : 0);
  const absl::Time now = options_.now();
  if (book_.has_value()) book_->Summarize(now, window, RanksLocked(false), &stats);
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value()) continue;
    const ShardRecord& shard = *shards_[r];
    v1::ShardLoad* out = stats.add_shards();
    out->set_shard_id(shard.shard_id);
    out->set_rank(static_cast<uint32_t>(r));
    out->set_requests(shard.requests);
    out->set_tokens(shard.tokens);
    out->set_batches(shard.batches);
    out->set_merged_batches(shard.merged_batches);
    out->set_alive(IsAliveLocked(shard, now));
  }
  return stats;
}

std::vector<ShardTarget> ClusterState::AliveShards() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.now();
  std::vector<ShardTarget> targets;
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value() || !IsAliveLocked(*shards_[r], now)) continue;
    targets.push_back({shards_[r]->shard_id, shards_[r]->address, static_cast<uint32_t>(r)});
  }
  return targets;
}

void ClusterState::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  JournalLoadLocked(/*force=*/true);
  map_changed_.SignalAll();
}

int ClusterState::FindShardLocked(const std::string& shard_id) const {
  for (int r = 0; r < options_.num_shards; ++r) {
    if (shards_[r].has_value() && shards_[r]->shard_id == shard_id) return r;
  }
  return -1;
}

int ClusterState::RegisteredCountLocked() const {
  int count = 0;
  for (const auto& shard : shards_) count += shard.has_value() ? 1 : 0;
  return count;
}

bool ClusterState::IsAliveLocked(const ShardRecord& shard, absl::Time now) const {
  return now - shard.last_seen <=
         options_.heartbeat_interval * options_.missed_heartbeats_until_dead;
}

bool ClusterState::IsReadyLocked(const ShardRecord& shard) const {
  // Shards keep the versions they loaded until told they drained, so a shard that loaded a newer
  // (pending) version still serves the current one.
  return version_ > 0 && Serving(shard) && shard.ready_map_version >= version_;
}

void ClusterState::FillPlacementLocked(uint64_t version, v1::ClusterMap* map) const {
  const VersionPlacement& placement = placements_.at(version);
  map->set_version(version);
  *map->mutable_model() = *model_;
  map->set_num_physical(static_cast<uint32_t>(num_physical_));
  map->mutable_slot_to_rank()->Add(placement.slot_to_rank.begin(), placement.slot_to_rank.end());
  const std::vector<int32_t>& p2l = placement.physical_to_logical;
  for (size_t begin = 0; begin < p2l.size(); begin += num_physical_) {
    map->add_layers()->mutable_physical_to_logical()->Add(p2l.begin() + begin,
                                                          p2l.begin() + begin + num_physical_);
  }
}

v1::ClusterMap ClusterState::BuildMapLocked() const {
  v1::ClusterMap map;
  FillPlacementLocked(version_, &map);
  for (int r = 0; r < options_.num_shards; ++r) {
    if (!shards_[r].has_value()) continue;
    const ShardRecord& shard = *shards_[r];
    v1::ShardEntry* entry = map.add_shards();
    entry->set_shard_id(shard.shard_id);
    entry->set_address(shard.address);
    entry->set_rank(static_cast<uint32_t>(r));
    // A serving shard that hosts nothing has nothing to load.
    entry->set_ready(IsReadyLocked(shard) || (Serving(shard) && !HostsSlotLocked(r, version_)));
    entry->set_state(shard.state);
  }
  if (pending_.has_value()) FillPlacementLocked(pending_->version, map.mutable_pending());
  map.set_min_accepted_version(min_accepted_version_);
  return map;
}

void ClusterState::MapChangedLocked() {
  JournalMapLocked();
  ++generation_;
  map_changed_.SignalAll();
}

}  // namespace moe
