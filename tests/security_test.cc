// Authentication, roles and mutual TLS through real processes (a moe_coordinator and two
// moe_shard processes started by LocalCluster with the security flags of
// server/common/security_flags.h).
//
// PlaintextTokens: tokens without TLS. No token or an unknown one is UNAUTHENTICATED; a frontend
// (or internal) token on an admin method is PERMISSION_DENIED and the cluster map and the shards'
// pending load are unchanged afterwards; admin tokens may call everything. Shards and the
// coordinator reach each other with the internal token (the cluster could not form otherwise).
//
// MutualTls: every server requires a client certificate from the test CA. A verified workload
// runs end to end with a valid certificate and a frontend token; a client without a certificate,
// with one from an untrusted CA, or in plaintext is refused at the handshake (gRPC reports
// UNAVAILABLE), even with an admin token, and the load and map it tried to change are unchanged.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/client.h"
#include "client/moectl/workload.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/tls.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/security_fixtures.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr absl::Duration kCallDeadline = absl::Seconds(30);

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  return ctx;
}

std::unique_ptr<v1::Coordinator::Stub> CoordinatorAs(const std::string& address,
                                                     const ChannelSecurity& security) {
  return v1::Coordinator::NewStub(MakeChannel(address, security));
}

std::unique_ptr<v1::ExpertShard::Stub> ShardAs(const std::string& address,
                                               const ChannelSecurity& security) {
  return v1::ExpertShard::NewStub(MakeChannel(address, security));
}

ChannelSecurity Plain(std::string token) { return {grpc::InsecureChannelCredentials(), token}; }

// The pending load every shard has counted so far, collected into the coordinator.
int64_t TotalRoutes(v1::Coordinator::Stub& coordinator) {
  v1::GetLoadStatsRequest request;
  request.set_refresh(true);
  v1::LoadStats stats;
  grpc::Status s = coordinator.GetLoadStats(Ctx().get(), request, &stats);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return stats.total_routes();
}

// A forward of two tokens routed to experts 0 and 1 of layer 0 (valid for the generated model;
// `info` gives its shape and fingerprint).
v1::ForwardRequest SmallForward(const v1::ShardInfo& info) {
  constexpr int64_t kT = 2, kK = 2;
  const int64_t h = info.hidden_size();
  v1::ForwardRequest req;
  req.set_model_fingerprint(info.model_fingerprint());
  req.set_layer(0);
  req.set_map_version(info.map_version());
  req.set_output_dtype(v1::F32);
  req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
  SetWireTensor(req.mutable_hidden_states()->mutable_data(), v1::F32, {kT, h},
                RawBytes(Bf16RoundedNormals(kT * h, 3)));
  SetWireTensor(req.mutable_topk_ids(), v1::I32, {kT, kK},
                RawBytes(std::vector<int32_t>{0, 1, 1, 0}));
  SetWireTensor(req.mutable_topk_weights(), v1::F32, {kT, kK},
                RawBytes(std::vector<float>{0.5f, 0.5f, 0.75f, 0.25f}));
  return req;
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("security");
    model_dir_ = dir_ + "/model";
    model::GenerateOptions gen;
    gen.seed = 41;
    ASSERT_TRUE(model::GenerateModel(gen, model_dir_).ok());
    absl::StatusOr<TokenFiles> tokens = WriteTokenFiles(dir_);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_ = *tokens;
  }
  void TearDown() override { SetDefaultChannelSecurity({}); }

  std::string dir_, model_dir_;
  TokenFiles tokens_;
};

TEST_F(SecurityTest, PlaintextTokens) {
  const std::vector<std::string> flags = {"--auth_tokens_file=" + tokens_.tokens,
                                          "--auth_token_file=" + tokens_.internal};
  // The harness's own client (readiness, map watch) is a frontend.
  SetDefaultChannelSecurity({nullptr, kFrontendToken});
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(
      {.model_dir = model_dir_, .num_shards = 2, .shard_flags = flags, .coordinator_flags = flags});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string coordinator = (*cluster)->coordinator_address();
  const std::string shard0 = (*cluster)->shard_address(0);

  v1::ClusterMap map;
  grpc::Status s;
  // No token, or an unknown one: UNAUTHENTICATED, on both kinds of server.
  s = CoordinatorAs(coordinator, Plain(""))->GetClusterMap(Ctx().get(), {}, &map);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  v1::ShardInfo info;
  s = ShardAs(shard0, Plain(""))->GetInfo(Ctx().get(), {}, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  s = CoordinatorAs(coordinator, Plain("not-a-token"))->GetClusterMap(Ctx().get(), {}, &map);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();

  // Frontend reads work.
  auto frontend = CoordinatorAs(coordinator, Plain(kFrontendToken));
  s = frontend->GetClusterMap(Ctx().get(), {}, &map);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(map.shards_size(), 2);
  const uint64_t version = map.version();
  s = ShardAs(shard0, Plain(kFrontendToken))->GetInfo(Ctx().get(), {}, &info);
  ASSERT_TRUE(s.ok()) << s.error_message();

  // Some load is pending on shard 0 (a frontend forward), to check a refused CollectLoad does
  // not take it.
  v1::ForwardResponse forwarded;
  s = ShardAs(shard0, Plain(kFrontendToken))->Forward(Ctx().get(), SmallForward(info), &forwarded);
  ASSERT_TRUE(s.ok()) << s.error_message();

  // Frontend and internal tokens on admin methods: PERMISSION_DENIED.
  v1::RebalanceRequest rebalance;
  rebalance.set_min_gain(0);
  v1::RebalancePlan plan;
  s = frontend->Rebalance(Ctx().get(), rebalance, &plan);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  v1::DrainRequest drain;
  drain.set_shard_id(map.shards(1).shard_id());
  v1::DrainResponse drained;
  s = frontend->Drain(Ctx().get(), drain, &drained);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = CoordinatorAs(coordinator, Plain(kInternalToken))->Drain(Ctx().get(), drain, &drained);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  v1::LoadDelta delta;
  s = ShardAs(shard0, Plain(kFrontendToken))->CollectLoad(Ctx().get(), {}, &delta);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();

  // Nothing changed: same map version, both shards still mapped and serving, and the forward's
  // 4 routes (2 tokens x top-2 on layer 0, all hosted somewhere) still reach the coordinator.
  auto admin = CoordinatorAs(coordinator, Plain(kAdminToken));
  v1::ClusterMap after;
  ASSERT_TRUE(admin->GetClusterMap(Ctx().get(), {}, &after).ok());
  EXPECT_EQ(after.version(), version);
  ASSERT_EQ(after.shards_size(), 2);
  EXPECT_EQ(after.shards(1).state(), map.shards(1).state());
  EXPECT_EQ(TotalRoutes(*admin), 4);

  // Admin may call everything.
  rebalance.set_dry_run(true);
  s = admin->Rebalance(Ctx().get(), rebalance, &plan);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = ShardAs(shard0, Plain(kAdminToken))->CollectLoad(Ctx().get(), {}, &delta);
  EXPECT_TRUE(s.ok()) << s.error_message();
  drain.set_wait(true);
  s = admin->Drain(Ctx().get(), drain, &drained);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(drained.committed());
  EXPECT_GT(drained.new_map_version(), version);
}

TEST_F(SecurityTest, MutualTls) {
  absl::StatusOr<TestPki> pki = GenerateTestPki(dir_);
  ASSERT_TRUE(pki.ok()) << pki.status();
  const std::vector<std::string> flags = {"--tls_cert=" + pki->node_cert,
                                          "--tls_key=" + pki->node_key,
                                          "--tls_ca=" + pki->ca,
                                          "--tls_require_client_cert",
                                          "--auth_tokens_file=" + tokens_.tokens,
                                          "--auth_token_file=" + tokens_.internal};
  auto tls = [&](const std::string& cert, const std::string& key, const std::string& token) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        MakeChannelCredentials({.cert_file = cert, .key_file = key, .ca_file = pki->ca});
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    return ChannelSecurity{*credentials, token};
  };
  ChannelSecurity valid = tls(pki->node_cert, pki->node_key, kFrontendToken);
  // The roots for the shards' TLS TCP channels too (MakeChannelSecurity sets them from the CA).
  absl::StatusOr<std::shared_ptr<const TlsContext>> tcp_tls = TcpTlsClientFromFile(pki->ca);
  ASSERT_TRUE(tcp_tls.ok()) << tcp_tls.status();
  valid.tcp_tls = *tcp_tls;
  SetDefaultChannelSecurity(valid);
  std::vector<std::string> shard_flags = flags;
  shard_flags.push_back("--tcp_channel");
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start({.model_dir = model_dir_,
                           .num_shards = 2,
                           .shard_flags = shard_flags,
                           .coordinator_flags = flags});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string coordinator = (*cluster)->coordinator_address();
  const std::string shard0 = (*cluster)->shard_address(0);

  // End to end with a valid certificate and token: the demo's verified workload (outputs against
  // the CPU reference, load counts against the client's own).
  WorkloadOptions workload;
  workload.coordinator = coordinator;
  workload.model_dir = model_dir_;
  workload.steps = 6;
  workload.tokens = 5;
  workload.clients = 2;
  workload.seed = 9;
  workload.connect_wait = absl::Seconds(30);
  std::ostringstream text;
  absl::StatusOr<WorkloadReport> report = RunWorkload(workload, text);
  ASSERT_TRUE(report.ok()) << report.status() << "\n" << text.str();
  EXPECT_EQ(report->calls, 6);
  EXPECT_TRUE(report->load_counts_match) << text.str();
  EXPECT_LE(report->worst_relative_error, 1e-2);
  // The workload (moectl's default transport) went over the shards' TCP channels, in TLS.
  for (int r = 0; r < 2; ++r) {
    const std::string log = (*cluster)->shard_process(r).Log();
    EXPECT_NE(log.find("tcp channels on "), std::string::npos) << log;
    EXPECT_NE(log.find("(TLS, the gRPC port's certificate)"), std::string::npos) << log;
    EXPECT_NE(log.find("tcp channel: connection opened (tls)"), std::string::npos) << log;
  }

  auto frontend = CoordinatorAs(coordinator, valid);
  v1::ClusterMap map;
  ASSERT_TRUE(frontend->GetClusterMap(Ctx().get(), {}, &map).ok());
  v1::ShardInfo info;
  ASSERT_TRUE(ShardAs(shard0, valid)->GetInfo(Ctx().get(), {}, &info).ok());
  const v1::ForwardRequest forward = SmallForward(info);
  const int64_t routes_before = TotalRoutes(*frontend);
  v1::ShardStats stats_before;
  ASSERT_TRUE(ShardAs(shard0, valid)->GetStats(Ctx().get(), {}, &stats_before).ok());

  // Refused at the handshake, even with an admin token: no client certificate, a certificate
  // from an untrusted CA, plaintext.
  const std::vector<std::pair<std::string, ChannelSecurity>> refused = {
      {"no client certificate", tls("", "", kAdminToken)},
      {"untrusted certificate", tls(pki->rogue_cert, pki->rogue_key, kAdminToken)},
      {"plaintext", Plain(kAdminToken)}};
  for (const auto& [name, security] : refused) {
    SCOPED_TRACE(name);
    v1::ForwardResponse response;
    grpc::Status s = ShardAs(shard0, security)->Forward(Ctx().get(), forward, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    v1::DrainRequest drain;
    drain.set_shard_id(map.shards(1).shard_id());
    v1::DrainResponse drained;
    s = CoordinatorAs(coordinator, security)->Drain(Ctx().get(), drain, &drained);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // A valid certificate without a token gets past TLS but not authentication.
  v1::ForwardResponse response;
  grpc::Status s = ShardAs(shard0, tls(pki->node_cert, pki->node_key, ""))
                       ->Forward(Ctx().get(), forward, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();

  // Nothing the refused clients sent changed anything.
  v1::ShardStats stats_after;
  ASSERT_TRUE(ShardAs(shard0, valid)->GetStats(Ctx().get(), {}, &stats_after).ok());
  EXPECT_EQ(stats_after.requests(), stats_before.requests());
  EXPECT_EQ(TotalRoutes(*frontend), routes_before);
  v1::ClusterMap after;
  ASSERT_TRUE(frontend->GetClusterMap(Ctx().get(), {}, &after).ok());
  EXPECT_EQ(after.version(), map.version());
  EXPECT_EQ(after.shards_size(), 2);

  // Control: the same forward with valid credentials is counted (4 routes).
  s = ShardAs(shard0, valid)->Forward(Ctx().get(), forward, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(TotalRoutes(*frontend), routes_before + 4);
}

}  // namespace
}  // namespace moe::testing
