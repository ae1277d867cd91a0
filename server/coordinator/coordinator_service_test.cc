// In-process gRPC tests: a CoordinatorServer on port 0, shards played by the test (and, for load
// collection, by fake ExpertShard servers), every call with a deadline.
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/coordinator/coordinator_server.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kCallTimeout = absl::Seconds(10);

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
}

v1::ModelShape Model(uint32_t layers, uint32_t experts) {
  v1::ModelShape model;
  model.set_fingerprint("fp-test");
  model.set_num_layers(layers);
  model.set_num_experts(experts);
  model.set_top_k(1);
  return model;
}

v1::LoadDelta Delta(uint32_t layers, uint32_t physical, std::vector<int64_t> counts) {
  v1::LoadDelta delta;
  delta.set_num_layers(layers);
  delta.set_num_physical(physical);
  delta.mutable_slot_counts()->Add(counts.begin(), counts.end());
  return delta;
}

// An ExpertShard that only answers CollectLoad, always with the same delta.
class FakeShard final : public v1::ExpertShard::Service {
 public:
  explicit FakeShard(v1::LoadDelta delta) : delta_(std::move(delta)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeShard() override { Stop(); }

  grpc::Status CollectLoad(grpc::ServerContext*, const v1::CollectLoadRequest*,
                           v1::LoadDelta* response) override {
    *response = delta_;
    return grpc::Status::OK;
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void Stop() {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }

 private:
  const v1::LoadDelta delta_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void StartCoordinator(int num_shards) {
    CoordinatorOptions options;
    options.cluster.num_shards = num_shards;
    // Liveness must not depend on how fast the test machine is.
    options.cluster.heartbeat_interval = absl::Seconds(60);
    // The shards here are played by the test and answer no health checks.
    options.supervisor.health_checks = false;
    auto server = CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  grpc::Status Register(const std::string& address, const v1::ModelShape& model,
                        v1::RegisterShardResponse* response) {
    v1::RegisterShardRequest request;
    request.set_address(address);
    request.set_requested_rank(-1);
    *request.mutable_model() = model;
    grpc::ClientContext context;
    SetDeadline(&context);
    return stub_->RegisterShard(&context, request, response);
  }

  grpc::Status Heartbeat(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response) {
    grpc::ClientContext context;
    SetDeadline(&context);
    return stub_->Heartbeat(&context, request, response);
  }

  grpc::Status GetLoadStats(bool refresh, v1::LoadStats* stats, std::string* collect_errors) {
    v1::GetLoadStatsRequest request;
    request.set_refresh(refresh);
    grpc::ClientContext context;
    SetDeadline(&context);
    grpc::Status status = stub_->GetLoadStats(&context, request, stats);
    collect_errors->clear();
    for (const auto& [key, value] : context.GetServerTrailingMetadata()) {
      if (key == kCollectErrorsKey) collect_errors->assign(value.data(), value.size());
    }
    return status;
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorServiceTest, WatchDeliversPublicationThenReadinessAndLoadMatches) {
  StartCoordinator(2);
  const v1::ModelShape model = Model(1, 2);  // P = 2: slot 0 on rank 0, slot 1 on rank 1
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ClusterMap map;
    grpc::Status status = stub_->GetClusterMap(&context, {}, &map);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(status.error_message(), HasSubstr("waiting for 2 more shards"));
  }
  grpc::ClientContext watch_context;
  SetDeadline(&watch_context);
  auto watch = stub_->WatchClusterMap(&watch_context, v1::WatchClusterMapRequest());

  v1::RegisterShardResponse a, b;
  ASSERT_TRUE(Register("127.0.0.1:7001", model, &a).ok());
  ASSERT_TRUE(Register("127.0.0.1:7002", model, &b).ok());
  EXPECT_EQ(a.rank(), 0u);
  EXPECT_EQ(b.rank(), 1u);
  EXPECT_EQ(a.heartbeat_interval_ms(), 60000u);

  v1::ClusterMap map;
  ASSERT_TRUE(watch->Read(&map));
  EXPECT_EQ(map.version(), 1u);
  ASSERT_EQ(map.shards_size(), 2);
  EXPECT_EQ(map.shards(1).address(), "127.0.0.1:7002");
  EXPECT_FALSE(map.shards(0).ready());
  EXPECT_THAT(map.slot_to_rank(), ElementsAre(0, 1));

  // Rank 0 reports 5 routes on its slot and 3 on rank 1's slot (ignored); rank 1 reports 2.
  v1::HeartbeatRequest beat_a;
  beat_a.set_shard_id(a.shard_id());
  beat_a.set_ready_map_version(1);
  *beat_a.mutable_load() = Delta(1, 2, {5, 3});
  beat_a.mutable_load()->set_tokens(8);
  v1::HeartbeatResponse beat_response;
  ASSERT_TRUE(Heartbeat(beat_a, &beat_response).ok());
  EXPECT_EQ(beat_response.map_version(), 1u);
  v1::HeartbeatRequest beat_b;
  beat_b.set_shard_id(b.shard_id());
  *beat_b.mutable_load() = Delta(1, 2, {0, 2});
  ASSERT_TRUE(Heartbeat(beat_b, &beat_response).ok());

  ASSERT_TRUE(watch->Read(&map));
  EXPECT_EQ(map.version(), 1u);
  EXPECT_TRUE(map.shards(0).ready());
  EXPECT_FALSE(map.shards(1).ready());

  v1::LoadStats stats;
  std::string errors;
  ASSERT_TRUE(GetLoadStats(false, &stats, &errors).ok());
  EXPECT_EQ(stats.map_version(), 1u);
  EXPECT_EQ(stats.total_routes(), 7);
  ASSERT_EQ(stats.layers_size(), 1);
  EXPECT_THAT(stats.layers(0).slot_load(), ElementsAre(5, 2));
  EXPECT_THAT(stats.layers(0).expert_load(), ElementsAre(5, 2));
  EXPECT_THAT(stats.layers(0).shard_load(), ElementsAre(5, 2));
  EXPECT_DOUBLE_EQ(stats.layers(0).balancedness(), 3.5 / 5.0);
  ASSERT_EQ(stats.shards_size(), 2);
  EXPECT_EQ(stats.shards(0).tokens(), 8u);
  EXPECT_TRUE(stats.shards(1).alive());

  watch_context.TryCancel();
  EXPECT_FALSE(watch->Read(&map));
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(CoordinatorServiceTest, ErrorsCrossTheWireWithTheirCodes) {
  StartCoordinator(2);
  v1::RegisterShardResponse a;
  ASSERT_TRUE(Register("127.0.0.1:7001", Model(1, 2), &a).ok());
  v1::RegisterShardResponse other;
  v1::ModelShape other_model = Model(1, 2);
  other_model.set_fingerprint("fp-other");
  EXPECT_EQ(Register("127.0.0.1:7002", other_model, &other).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  v1::HeartbeatRequest unknown;
  unknown.set_shard_id("shard-9-9");
  v1::HeartbeatResponse response;
  EXPECT_EQ(Heartbeat(unknown, &response).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::HeartbeatRequest bad_load;
  bad_load.set_shard_id(a.shard_id());
  *bad_load.mutable_load() = Delta(1, 3, {1, 1, 1});
  EXPECT_EQ(Heartbeat(bad_load, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorServiceTest, RefreshPullsLoadFromShardsAndReportsFailures) {
  StartCoordinator(3);
  const v1::ModelShape model = Model(1, 3);  // one slot per rank
  v1::LoadDelta delta_a = Delta(1, 3, {4, 0, 0});
  delta_a.set_requests(2);
  FakeShard shard_a(delta_a);
  FakeShard shard_b(Delta(1, 3, {0, 6, 0}));
  FakeShard gone(Delta(1, 3, {0, 0, 1}));
  gone.Stop();

  v1::RegisterShardResponse a, b, c;
  ASSERT_TRUE(Register(shard_a.address(), model, &a).ok());
  ASSERT_TRUE(Register(shard_b.address(), model, &b).ok());
  ASSERT_TRUE(Register(gone.address(), model, &c).ok());

  v1::LoadStats stats;
  std::string errors;
  ASSERT_TRUE(GetLoadStats(true, &stats, &errors).ok());
  EXPECT_THAT(stats.layers(0).slot_load(), ElementsAre(4, 6, 0));
  EXPECT_THAT(errors, HasSubstr(c.shard_id() + ": UNAVAILABLE"));
  EXPECT_THAT(errors, ::testing::Not(HasSubstr(a.shard_id())));

  // Deltas accumulate: the fakes hand out the same counts again.
  ASSERT_TRUE(GetLoadStats(true, &stats, &errors).ok());
  EXPECT_THAT(stats.layers(0).slot_load(), ElementsAre(8, 12, 0));
  EXPECT_THAT(stats.layers(0).shard_load(), ElementsAre(8, 12, 0));
  EXPECT_DOUBLE_EQ(stats.layers(0).balancedness(), (20.0 / 3.0) / 12.0);
  EXPECT_EQ(stats.shards(0).requests(), 4u);
  EXPECT_EQ(stats.total_routes(), 20);
}

TEST_F(CoordinatorServiceTest, PlacementCallsCrossTheWireWithTheirCodes) {
  StartCoordinator(2);
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::RebalancePlan plan;
    EXPECT_EQ(stub_->Rebalance(&context, v1::RebalanceRequest(), &plan).error_code(),
              grpc::StatusCode::UNAVAILABLE);  // no map yet
  }
  v1::RegisterShardResponse a, b;
  ASSERT_TRUE(Register("127.0.0.1:7101", Model(1, 2), &a).ok());
  ASSERT_TRUE(Register("127.0.0.1:7102", Model(1, 2), &b).ok());
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::RebalanceRequest request;
    request.set_dry_run(true);
    v1::RebalancePlan plan;
    ASSERT_TRUE(stub_->Rebalance(&context, request, &plan).ok());
    EXPECT_EQ(plan.layers_size(), 1);
    EXPECT_EQ(plan.new_map_version(), 0u);
  }
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::DrainRequest request;
    request.set_shard_id("nobody");
    v1::DrainResponse response;
    EXPECT_EQ(stub_->Drain(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    // Draining rank 1 moves its slot to rank 0, which never reports it loaded: with `wait`, the
    // call returns at its deadline, not committed.
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::DrainRequest request;
    request.set_shard_id(b.shard_id());
    request.set_wait(true);
    v1::DrainResponse response;
    ASSERT_TRUE(stub_->Drain(&context, request, &response).ok());
    EXPECT_EQ(response.new_map_version(), 2u);
    EXPECT_FALSE(response.committed());
  }
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::GetLoadStatsRequest request;
    request.set_window_seconds(-1);
    v1::LoadStats stats;
    EXPECT_EQ(stub_->GetLoadStats(&context, request, &stats).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(CoordinatorServiceTest, ShutdownEndsWatchStreams) {
  StartCoordinator(1);
  grpc::ClientContext watch_context;
  SetDeadline(&watch_context);
  auto watch = stub_->WatchClusterMap(&watch_context, v1::WatchClusterMapRequest());
  v1::RegisterShardResponse a;
  ASSERT_TRUE(Register("127.0.0.1:7001", Model(1, 1), &a).ok());
  v1::ClusterMap map;
  ASSERT_TRUE(watch->Read(&map));  // the handler is running

  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Seconds(30));
  // The stream ended on its own instead of being cut at the end of the grace period.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(watch->Read(&map));
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(CoordinatorServiceTest, HealthServiceReportsServing) {
  StartCoordinator(1);
  grpc::GenericStub generic(
      grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(&context);
  // An empty HealthCheckRequest asks about the server as a whole.
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  // HealthCheckResponse{status: SERVING}: field 1, varint, value 1.
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST(CoordinatorOptionsTest, ValidationNamesTheBadFlag) {
  CoordinatorOptions options;
  EXPECT_TRUE(ValidateOptions(options).ok());
  options.cluster.num_shards = 0;
  EXPECT_THAT(ValidateOptions(options).message(), HasSubstr("--num_shards"));
  options = CoordinatorOptions();
  options.port = 70000;
  EXPECT_THAT(ValidateOptions(options).message(), HasSubstr("--port"));
  options = CoordinatorOptions();
  options.cluster.redundant_slots = -1;
  EXPECT_THAT(ValidateOptions(options).message(), HasSubstr("--redundant_slots"));
}

TEST(PortFileTest, HoldsThePortAndANewline) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/coordinator.port";
  ASSERT_TRUE(WritePortFile(path, 43117).ok());
  std::ifstream in(path);
  std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(contents, "43117\n");
  EXPECT_FALSE(WritePortFile("/nonexistent-dir/x.port", 1).ok());
}

}  // namespace
}  // namespace moe
