// The moe.v1.Coordinator gRPC service: a thin adapter that converts between protos and
// ClusterState calls (the one absl -> grpc status conversion) and pulls shard load on demand.
//
// It uses gRPC's synchronous API: every handler is a short critical section on ClusterState
// except WatchClusterMap, which blocks on ClusterState's condition variable, and GetLoadStats
// with refresh, which waits on outgoing calls. Blocking is allowed on sync-server threads and must
// not happen on callback-API reactor threads; the coordinator's traffic (a heartbeat per shard
// every interval, a handful of watchers) is far from the rates where a thread per in-flight call
// costs anything.
//
// Created by CoordinatorServer (and tests). Thread-safety: thread-safe.
// Ownership: borrows the ClusterState, which must outlive the service; owns its LoadCollector.
#ifndef MOE_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define MOE_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include "absl/time/time.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/load_collector.h"

namespace moe {

// Trailing-metadata key of GetLoadStats(refresh) listing shards whose load could not be pulled,
// as "shard_id: status; ..." (absent when every shard answered).
inline constexpr char kCollectErrorsKey[] = "moe-collect-errors";

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // `collect_timeout` bounds each CollectLoad call of a refresh.
  // REQUIRES: `state` outlives the service.
  CoordinatorService(ClusterState* state, absl::Duration collect_timeout, int max_message_bytes);

  grpc::Status RegisterShard(grpc::ServerContext* context, const v1::RegisterShardRequest* request,
                             v1::RegisterShardResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status GetClusterMap(grpc::ServerContext* context, const v1::GetClusterMapRequest* request,
                             v1::ClusterMap* response) override;
  // Sends the current map as soon as it is published and newer than known_version, then every
  // change (new version, readiness, shard entries). Ends with CANCELLED when the client goes away
  // and with UNAVAILABLE when the coordinator shuts down (a retryable end: watch another one).
  grpc::Status WatchClusterMap(grpc::ServerContext* context,
                               const v1::WatchClusterMapRequest* request,
                               grpc::ServerWriter<v1::ClusterMap>* writer) override;
  grpc::Status GetLoadStats(grpc::ServerContext* context, const v1::GetLoadStatsRequest* request,
                            v1::LoadStats* response) override;
  // With `wait`, these return once the new map version is committed or the call's deadline (at
  // most kMaxSwitchWait) passes; `committed` says which.
  grpc::Status Rebalance(grpc::ServerContext* context, const v1::RebalanceRequest* request,
                         v1::RebalancePlan* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;

 private:
  // Pulls every alive shard's pending load into the state; returns the failures, described.
  std::string RefreshLoad();
  // Waits for `version` to commit until the call's deadline; whether it did.
  bool AwaitCommit(grpc::ServerContext* context, uint64_t version);

  ClusterState* const state_;
  LoadCollector collector_;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
