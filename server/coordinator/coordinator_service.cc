#include "server/coordinator/coordinator_service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/common/status.h"

namespace moe {
namespace {

// How often a blocked WatchClusterMap looks whether its client went away: the sync API has no
// cancellation callback, so the wait on the state is cut into slices of this length.
constexpr absl::Duration kWatchCancelPoll = absl::Milliseconds(100);

// Longest a Rebalance or Drain with `wait` blocks when the caller set no deadline.
constexpr absl::Duration kMaxSwitchWait = absl::Minutes(5);
constexpr absl::Duration kAnswerMargin = absl::Milliseconds(100);

// Metadata values must be printable ASCII.
std::string PrintableAscii(std::string text) {
  for (char& c : text) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return text;
}

}  // namespace

CoordinatorService::CoordinatorService(ClusterState* state, absl::Duration collect_timeout,
                                       int max_message_bytes)
    : state_(state), collector_(collect_timeout, max_message_bytes) {}

grpc::Status CoordinatorService::RegisterShard(grpc::ServerContext*,
                                               const v1::RegisterShardRequest* request,
                                               v1::RegisterShardResponse* response) {
  absl::StatusOr<v1::RegisterShardResponse> result = state_->RegisterShard(*request);
  if (!result.ok()) {
    LOG(WARNING) << "RegisterShard from " << request->address() << ": " << result.status();
    return ToGrpcStatus(result.status());
  }
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*,
                                           const v1::HeartbeatRequest* request,
                                           v1::HeartbeatResponse* response) {
  absl::StatusOr<v1::HeartbeatResponse> result = state_->Heartbeat(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetClusterMap(grpc::ServerContext*,
                                               const v1::GetClusterMapRequest*,
                                               v1::ClusterMap* response) {
  absl::StatusOr<v1::ClusterMap> map = state_->GetClusterMap();
  if (!map.ok()) return ToGrpcStatus(map.status());
  *response = *std::move(map);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::WatchClusterMap(grpc::ServerContext* context,
                                                 const v1::WatchClusterMapRequest* request,
                                                 grpc::ServerWriter<v1::ClusterMap>* writer) {
  uint64_t known_version = request->known_version();
  // Readiness changes after the stream starts count as news even for a client already holding the
  // current version.
  uint64_t known_generation = state_->generation();
  while (!context->IsCancelled()) {
    absl::StatusOr<std::optional<MapUpdate>> update =
        state_->AwaitMapChange(known_version, known_generation, absl::Now() + kWatchCancelPoll);
    if (!update.ok()) return ToGrpcStatus(update.status());
    if (!update->has_value()) continue;
    if (!writer->Write((*update)->map)) break;
    known_version = (*update)->map.version();
    known_generation = (*update)->generation;
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
}

grpc::Status CoordinatorService::GetLoadStats(grpc::ServerContext* context,
                                              const v1::GetLoadStatsRequest* request,
                                              v1::LoadStats* response) {
  if (request->refresh()) {
    const std::string errors = RefreshLoad();
    if (!errors.empty()) context->AddTrailingMetadata(kCollectErrorsKey, PrintableAscii(errors));
  }
  if (!(request->window_seconds() >= 0)) {
    return ToGrpcStatus(absl::InvalidArgumentError("window_seconds must be >= 0"));
  }
  *response = state_->GetLoadStats(absl::Seconds(request->window_seconds()));
  return grpc::Status::OK;
}

bool CoordinatorService::AwaitCommit(grpc::ServerContext* context, uint64_t version) {
  const absl::Time now = absl::Now();
  absl::Time deadline = std::min(absl::FromChrono(context->deadline()), now + kMaxSwitchWait);
  // Answer a little before the caller gives up, so that "not committed yet" reaches it.
  deadline -= std::min(kAnswerMargin, (deadline - now) / 4);
  absl::StatusOr<bool> committed = state_->AwaitCommit(version, deadline);
  return committed.ok() && *committed;
}

grpc::Status CoordinatorService::Rebalance(grpc::ServerContext* context,
                                           const v1::RebalanceRequest* request,
                                           v1::RebalancePlan* response) {
  absl::StatusOr<v1::RebalancePlan> plan = state_->Rebalance(*request);
  if (!plan.ok()) return ToGrpcStatus(plan.status());
  *response = *std::move(plan);
  if (request->wait() && response->new_map_version() > 0) {
    response->set_committed(AwaitCommit(context, response->new_map_version()));
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Drain(grpc::ServerContext* context,
                                       const v1::DrainRequest* request,
                                       v1::DrainResponse* response) {
  absl::StatusOr<v1::DrainResponse> drain = state_->Drain(*request);
  if (!drain.ok()) return ToGrpcStatus(drain.status());
  *response = *std::move(drain);
  if (request->wait() && response->new_map_version() > 0) {
    response->set_committed(AwaitCommit(context, response->new_map_version()));
  }
  return grpc::Status::OK;
}

std::string CoordinatorService::RefreshLoad() {
  std::vector<std::string> errors;
  for (CollectedLoad& collected : collector_.CollectAll(state_->AliveShards())) {
    absl::Status status = collected.delta.status();
    if (status.ok()) status = state_->MergeLoadDelta(collected.target.shard_id, *collected.delta);
    if (status.ok()) continue;
    LOG(WARNING) << "CollectLoad from " << collected.target.shard_id << " at "
                 << collected.target.address << ": " << status;
    errors.push_back(absl::StrCat(collected.target.shard_id, ": ", status.ToString()));
  }
  return absl::StrJoin(errors, "; ");
}

}  // namespace moe
