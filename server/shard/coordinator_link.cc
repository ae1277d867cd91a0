#include "server/shard/coordinator_link.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "server/common/status.h"

namespace moe {
namespace {

// Adds `from` into `into`: slot counts per map version (a version present in both adds up), and
// the executor totals. The newest version's counts stay at the top level, older ones beside it.
void MergeDelta(const v1::LoadDelta& from, v1::LoadDelta* into) {
  std::map<uint64_t, v1::LoadDelta> by_version;
  auto collect = [&by_version](const v1::LoadDelta& delta) {
    auto add = [&by_version](const v1::LoadDelta& d) {
      if (d.slot_counts_size() == 0) return;
      v1::LoadDelta& slot = by_version[d.map_version()];
      if (slot.slot_counts_size() != d.slot_counts_size()) {
        slot.set_num_layers(d.num_layers());
        slot.set_num_physical(d.num_physical());
        slot.set_map_version(d.map_version());
        slot.mutable_slot_counts()->Assign(d.slot_counts().begin(), d.slot_counts().end());
        return;
      }
      for (int i = 0; i < d.slot_counts_size(); ++i) {
        slot.set_slot_counts(i, slot.slot_counts(i) + d.slot_counts(i));
      }
    };
    add(delta);
    for (const v1::LoadDelta& other : delta.other_versions()) add(other);
  };
  collect(*into);
  collect(from);
  v1::LoadDelta out;
  out.set_requests(into->requests() + from.requests());
  out.set_tokens(into->tokens() + from.tokens());
  out.set_batches(into->batches() + from.batches());
  out.set_merged_batches(into->merged_batches() + from.merged_batches());
  for (auto it = by_version.rbegin(); it != by_version.rend(); ++it) {
    v1::LoadDelta* slot = it == by_version.rbegin() ? &out : out.add_other_versions();
    slot->set_num_layers(it->second.num_layers());
    slot->set_num_physical(it->second.num_physical());
    slot->set_map_version(it->first);
    *slot->mutable_slot_counts() = it->second.slot_counts();
  }
  *into = std::move(out);
}

}  // namespace

CoordinatorLink::CoordinatorLink(std::string coordinator, v1::RegisterShardRequest registration,
                                 ExpertShardService* service)
    : coordinator_(std::move(coordinator)),
      registration_(std::move(registration)),
      service_(service),
      stub_(v1::Coordinator::NewStub(MakeChannel(coordinator_))) {}

CoordinatorLink::~CoordinatorLink() { Stop(); }

absl::Status CoordinatorLink::Register() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::RegisterShardResponse resp;
  grpc::Status s = stub_->RegisterShard(&ctx, registration_, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  absl::MutexLock lock(&mu_);
  shard_id_ = resp.shard_id();
  rank_ = resp.rank();
  if (resp.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = absl::Milliseconds(resp.heartbeat_interval_ms());
  }
  service_->set_identity({resp.shard_id(), registration_.address()});
  LOG(INFO) << "registered with coordinator " << coordinator_ << " as " << resp.shard_id()
            << " (rank " << resp.rank() << ")";
  return absl::OkStatus();
}

absl::Status CoordinatorLink::Start(absl::Duration wait) {
  const absl::Time give_up = absl::Now() + wait;
  absl::Status s;
  for (absl::Duration backoff = absl::Milliseconds(20);;
       backoff = std::min(backoff * 2, absl::Seconds(1))) {
    s = Register();
    // FAILED_PRECONDITION (wrong model) and INVALID_ARGUMENT are final; the rest is retried.
    if (s.ok() || s.code() == absl::StatusCode::kFailedPrecondition ||
        s.code() == absl::StatusCode::kInvalidArgument || absl::Now() >= give_up) {
      break;
    }
    absl::SleepFor(backoff);  // waiting for the coordinator to come up, not synchronization
  }
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("registering with coordinator ", coordinator_, ": ", s.message()));
  }
  watcher_ = std::thread([this] { WatchLoop(); });
  heartbeater_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

void CoordinatorLink::Stop() {
  if (stopping_.exchange(true)) return;
  {
    absl::MutexLock lock(&mu_);
    if (watch_ctx_) watch_ctx_->TryCancel();
    heartbeat_now_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
  if (heartbeater_.joinable()) heartbeater_.join();
  (void)SendHeartbeat();  // flush the last load
}

void CoordinatorLink::WatchLoop() {
  while (!stopping_.load()) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    grpc::ClientContext* raw = ctx.get();
    uint32_t rank;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_.load()) return;
      watch_ctx_ = std::move(ctx);
      rank = rank_;
    }
    v1::WatchClusterMapRequest req;
    req.set_known_version(service_->active_version());
    auto reader = stub_->WatchClusterMap(raw, req);
    v1::ClusterMap map;
    while (reader->Read(&map)) {
      if (!ApplyMap(map, rank)) continue;
      absl::MutexLock lock(&mu_);
      heartbeat_now_ = true;  // report readiness now: a switch may be waiting for it
    }
    reader->Finish();
    if (!stopping_.load()) absl::SleepFor(absl::Milliseconds(200));  // reconnect backoff
  }
}

bool CoordinatorLink::ActivateVersion(const v1::ClusterMap& map, uint32_t rank) {
  absl::StatusOr<std::shared_ptr<const ShardPlacement>> placement =
      ShardPlacement::FromClusterMap(map, rank);
  absl::Status s = placement.ok() ? service_->Activate(*placement) : placement.status();
  if (!s.ok()) LOG(ERROR) << "cannot activate map version " << map.version() << ": " << s;
  return s.ok();
}

bool CoordinatorLink::ApplyMap(const v1::ClusterMap& map, uint32_t rank) {
  bool activated = false;
  // The current version first (clients use it now), then the one being prepared.
  if (!service_->Accepts(map.version()) && map.version() >= map.min_accepted_version()) {
    activated = ActivateVersion(map, rank) || activated;
  }
  if (map.has_pending() && !service_->Accepts(map.pending().version())) {
    activated = ActivateVersion(map.pending(), rank) || activated;
  }
  service_->ReleaseBefore(map.min_accepted_version());
  for (const v1::ShardEntry& entry : map.shards()) {
    if (entry.rank() != rank || entry.state() != v1::SHARD_DRAINED || drained_) continue;
    drained_ = true;
    LOG(INFO) << "the coordinator reports this shard drained: no longer serving";
    service_->StartDraining();
    if (on_drained_) on_drained_();
  }
  return activated;
}

absl::Status CoordinatorLink::SendHeartbeat() {
  // Under the service's hand-off lock until the coordinator answered (see HandOffLoad).
  return service_->HandOffLoad([this](v1::LoadDelta delta) -> absl::Status {
    v1::HeartbeatRequest req;
    {
      absl::MutexLock lock(&mu_);
      MergeDelta(delta, &unsent_);
      req.set_shard_id(shard_id_);
      *req.mutable_load() = unsent_;
    }
    req.set_ready_map_version(service_->active_version());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::HeartbeatResponse resp;
    grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      unsent_.Clear();
      return absl::OkStatus();
    }
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "coordinator forgot this shard; registering again";
      (void)Register();
    }
    return FromGrpcStatus(s);
  });
}

void CoordinatorLink::HeartbeatLoop() {
  while (!stopping_.load()) {
    if (absl::Status s = SendHeartbeat(); !s.ok()) {
      LOG_EVERY_N(WARNING, 20) << "heartbeat failed: " << s;
    }
    absl::MutexLock lock(&mu_);
    auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return heartbeat_now_; };
    mu_.AwaitWithTimeout(absl::Condition(&wake), heartbeat_interval_);
    heartbeat_now_ = false;
  }
}

}  // namespace moe
