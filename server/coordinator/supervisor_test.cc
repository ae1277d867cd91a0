// Health probes against real in-process gRPC servers (SERVING, NOT_SERVING, gone) and the
// supervisor removing a shard whose address stopped answering.
#include "server/coordinator/supervisor.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"

namespace moe {
namespace {

// A server with the standard health service (and an unimplemented ExpertShard, since a
// synchronous server needs one service of its own), on a free port.
class HealthServer {
 public:
  explicit HealthServer(bool serving) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&shard_);
    server_ = builder.BuildAndStart();
    server_->GetHealthCheckService()->SetServingStatus(serving);
  }
  ~HealthServer() { Stop(); }
  void Stop() {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  v1::ExpertShard::Service shard_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(HealthProberTest, ClassifiesEachShard) {
  HealthServer serving(true), not_serving(false), gone(true);
  gone.Stop();
  HealthProber prober(absl::Seconds(5));
  const std::vector<ProbeResult> results = prober.ProbeAll(
      {{"a", serving.address(), 0}, {"b", not_serving.address(), 1}, {"c", gone.address(), 2}});
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0].outcome, ProbeOutcome::kServing) << results[0].detail;
  EXPECT_EQ(results[1].outcome, ProbeOutcome::kNotServing) << results[1].detail;
  EXPECT_EQ(results[2].outcome, ProbeOutcome::kUnreachable) << results[2].detail;
  EXPECT_EQ(results[2].target.shard_id, "c");
}

TEST(SupervisorTest, RemovesAShardThatStoppedAnswering) {
  HealthServer a(true), b(true);
  ClusterOptions options;
  options.num_shards = 2;
  // Heartbeats alone would keep both shards alive for the whole test.
  options.heartbeat_interval = absl::Seconds(60);
  ClusterState state(options);
  v1::ModelShape model;
  model.set_fingerprint("fp");
  model.set_num_layers(1);
  model.set_num_experts(2);
  model.set_top_k(1);
  std::vector<std::string> ids;
  for (const HealthServer* server : {&a, &b}) {
    v1::RegisterShardRequest request;
    request.set_address(server->address());
    *request.mutable_model() = model;
    absl::StatusOr<v1::RegisterShardResponse> response = state.RegisterShard(request);
    ASSERT_TRUE(response.ok()) << response.status();
    v1::HeartbeatRequest beat;
    beat.set_shard_id(response->shard_id());
    beat.set_ready_map_version(1);  // loaded: now it is health-checked
    ASSERT_TRUE(state.Heartbeat(beat).ok());
  }
  SupervisorOptions supervisor_options;
  supervisor_options.tick = absl::Milliseconds(5);
  supervisor_options.probe_interval = absl::Milliseconds(20);
  Supervisor supervisor(&state, supervisor_options);
  supervisor.Start();
  b.Stop();
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  v1::ClusterMap map = state.GetClusterMap().value();
  while (map.shards(1).state() != v1::SHARD_FAILED && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));  // bounded polling of the supervisor's effect
    map = state.GetClusterMap().value();
  }
  supervisor.Stop();
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_FAILED);
  EXPECT_EQ(map.shards(0).state(), v1::SHARD_ACTIVE);
  // Expert 1 had no other replica: the switch moving its slot to rank 0 is pending.
  EXPECT_TRUE(map.has_pending());
}

TEST(SupervisorTest, PeriodicPolicyRebalancesASkewedWindow) {
  ClusterOptions options;
  options.num_shards = 2;
  options.redundant_slots = 2;  // P = 6: slots 0-2 on rank 0 (experts 0 1 2), 3-5 on rank 1 (3 0 2)
  options.heartbeat_interval = absl::Seconds(60);
  ClusterState state(options);
  v1::ModelShape model;
  model.set_fingerprint("fp");
  model.set_num_layers(1);
  model.set_num_experts(4);
  model.set_top_k(1);
  std::vector<std::string> ids;
  for (const char* address : {"a:1", "b:1"}) {
    v1::RegisterShardRequest request;
    request.set_address(address);
    *request.mutable_model() = model;
    absl::StatusOr<v1::RegisterShardResponse> response = state.RegisterShard(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ids.push_back(response->shard_id());
  }
  // Expert 3 (slot 3, rank 1) takes nearly every route.
  v1::HeartbeatRequest beat;
  beat.set_shard_id(ids[1]);
  beat.set_ready_map_version(1);
  v1::LoadDelta* load = beat.mutable_load();
  load->set_num_layers(1);
  load->set_num_physical(6);
  load->set_map_version(1);
  for (int64_t count : {0, 0, 0, 100, 1, 1}) load->add_slot_counts(count);
  ASSERT_TRUE(state.Heartbeat(beat).ok());
  SupervisorOptions supervisor_options;
  supervisor_options.tick = absl::Milliseconds(5);
  supervisor_options.health_checks = false;
  supervisor_options.rebalance_interval = absl::Milliseconds(10);
  supervisor_options.rebalance_min_gain = 0.05;
  Supervisor supervisor(&state, supervisor_options);
  supervisor.Start();
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (state.pending_version() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));  // bounded polling of the supervisor's effect
  }
  supervisor.Stop();
  const v1::ClusterMap map = state.GetClusterMap().value();
  ASSERT_TRUE(map.has_pending());
  // Expert 3 gets both redundant slots.
  const auto& p2l = map.pending().layers(0).physical_to_logical();
  EXPECT_EQ(std::count(p2l.begin(), p2l.end(), 3), 3);
}

}  // namespace
}  // namespace moe
