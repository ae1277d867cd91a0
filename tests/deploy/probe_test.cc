// What the Kubernetes manifests rely on, checked against the real binaries:
//  - a shard answers NOT_SERVING on the standard gRPC health service (the `grpc:` readiness probe)
//    until it is registered with the coordinator AND has loaded the weights of a published map;
//  - --max_connection_age_seconds makes the shard and the coordinator close client connections
//    (GOAWAY), so a client channel leaves READY by itself; with 0 it stays READY.
// The health check is made the way kubelet makes it: grpc.health.v1.Health/Check for service "".
#include <sys/wait.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"

namespace moe::testing {
namespace {

constexpr absl::Duration kStartTimeout = absl::Seconds(60);

// grpc.health.v1.HealthCheckResponse.ServingStatus values.
enum class Health { kRpcFailed = -1, kUnknown = 0, kServing = 1, kNotServing = 2 };

// One Health/Check call with an empty HealthCheckRequest (service ""). The response message is
// field 1 (varint): its encoding is the tag byte 0x08 then the value; an absent field is UNKNOWN.
Health CheckHealth(const std::string& address) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1), response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) return Health::kRpcFailed;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return Health::kRpcFailed;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return Health::kUnknown;
  if (bytes.size() != 2 || bytes[0] != 0x08) return Health::kRpcFailed;
  return static_cast<Health>(bytes[1]);
}

// Bounded polling until `address` answers `want` (true) or `deadline` passes (false).
bool WaitForHealth(const std::string& address, Health want, absl::Time deadline) {
  while (absl::Now() < deadline) {
    if (CheckHealth(address) == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Bounded polling of a process's log for `text`.
bool WaitForLog(ChildProcess& process, absl::string_view text, absl::Time deadline) {
  while (absl::Now() < deadline && process.Running()) {
    if (absl::StrContains(process.Log(), text)) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::StrContains(process.Log(), text);
}

class ProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("probe");
    model_dir_ = dir_ + "/model";
    ASSERT_TRUE(model::GenerateModel({}, model_dir_).ok());
  }

  // Starts a process and waits for its port file; returns "127.0.0.1:PORT".
  std::string Start(const std::string& name, const std::string& binary,
                    std::vector<std::string> args) {
    const std::string port_file = absl::StrCat(dir_, "/", name, ".port");
    args.push_back("--port=0");
    args.push_back("--port_file=" + port_file);
    absl::StatusOr<std::unique_ptr<ChildProcess>> p =
        ChildProcess::Spawn(name, binary, args, absl::StrCat(dir_, "/", name, ".log"));
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    absl::StatusOr<int> port = (*p)->WaitForPortFile(port_file, absl::Now() + kStartTimeout);
    EXPECT_TRUE(port.ok()) << port.status();
    processes_.push_back(*std::move(p));
    return port.ok() ? absl::StrCat("127.0.0.1:", *port) : "";
  }

  std::string StartCoordinator(int num_shards, std::vector<std::string> extra = {}) {
    extra.push_back(absl::StrCat("--num_shards=", num_shards));
    return Start("coordinator", RunfilePath("server/coordinator/moe_coordinator"), extra);
  }

  std::string StartShard(const std::string& name, std::vector<std::string> extra) {
    extra.push_back("--model=" + model_dir_);
    extra.push_back("--backend=cpu");
    return Start(name, RunfilePath("server/shard/moe_shard"), extra);
  }

  ChildProcess& process(int i) { return *processes_[i]; }

  std::string dir_, model_dir_;
  std::vector<std::unique_ptr<ChildProcess>> processes_;
};

TEST_F(ProbeTest, ShardIsNotServingUntilRegisteredAndLoaded) {
  // A coordinator that is not there: the shard listens (port file written) but keeps retrying
  // registration, and must not look ready.
  const std::string orphan =
      StartShard("orphan", {"--coordinator=127.0.0.1:1", "--register_wait_seconds=60"});
  ASSERT_FALSE(orphan.empty());
  EXPECT_EQ(CheckHealth(orphan), Health::kNotServing);

  // Registered, but the coordinator waits for a second shard before it publishes a map: no
  // placement, so no weights, so still NOT_SERVING.
  const std::string coordinator = StartCoordinator(2);
  ASSERT_FALSE(coordinator.empty());
  const std::string first = StartShard("shard0", {"--coordinator=" + coordinator, "--rank=0"});
  ASSERT_FALSE(first.empty());
  ASSERT_TRUE(
      WaitForLog(*processes_.back(), "registered with coordinator", absl::Now() + kStartTimeout))
      << processes_.back()->LogTail();
  EXPECT_EQ(CheckHealth(first), Health::kNotServing);
  EXPECT_EQ(CheckHealth(orphan), Health::kNotServing);

  // The second shard completes the cluster: the map is published, both load and turn SERVING.
  const std::string second = StartShard("shard1", {"--coordinator=" + coordinator, "--rank=1"});
  ASSERT_FALSE(second.empty());
  EXPECT_TRUE(WaitForHealth(first, Health::kServing, absl::Now() + kStartTimeout));
  EXPECT_TRUE(WaitForHealth(second, Health::kServing, absl::Now() + kStartTimeout));
  // The coordinator itself reports SERVING as soon as it listens (its probe target).
  EXPECT_EQ(CheckHealth(coordinator), Health::kServing);
  EXPECT_EQ(CheckHealth(orphan), Health::kNotServing);

  // SIGTERM: a draining shard exits 0 and answers nothing afterwards.
  ChildProcess& shard0 = *processes_[2];
  const int status = shard0.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << shard0.LogTail();
  EXPECT_EQ(CheckHealth(first), Health::kRpcFailed);
  // The orphan is still inside its registration retries, where it does not wait for signals.
  processes_[0]->Stop(absl::Milliseconds(200));
}

// Makes one call so the channel connects, then waits (bounded) for the server to close the
// connection: with a max connection age the channel leaves READY by itself.
bool ChannelLeavesReady(const std::string& address, absl::Duration within) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10)))) {
    ADD_FAILURE() << "cannot connect to " << address;
    return false;
  }
  const absl::Time deadline = absl::Now() + within;
  while (absl::Now() < deadline) {
    if (channel->GetState(false) != GRPC_CHANNEL_READY) return true;
    channel->WaitForStateChange(GRPC_CHANNEL_READY, absl::ToChronoTime(deadline));
  }
  return channel->GetState(false) != GRPC_CHANNEL_READY;
}

TEST_F(ProbeTest, MaxConnectionAgeClosesConnections) {
  const std::string coordinator = StartCoordinator(1, {"--max_connection_age_seconds=1"});
  const std::string aged =
      StartShard("aged", {"--coordinator=" + coordinator, "--max_connection_age_seconds=1"});
  const std::string forever = StartShard("forever", {"--max_connection_age_seconds=0"});
  ASSERT_FALSE(coordinator.empty() || aged.empty() || forever.empty());
  ASSERT_TRUE(WaitForHealth(aged, Health::kServing, absl::Now() + kStartTimeout));

  // gRPC adds +-10% jitter to the age; 1 s plus a generous margin for a loaded 2-core machine.
  EXPECT_TRUE(ChannelLeavesReady(aged, absl::Seconds(8)));
  EXPECT_TRUE(ChannelLeavesReady(coordinator, absl::Seconds(8)));
  // Control: without an age the same wait sees no change (twice the aged shard's age).
  EXPECT_FALSE(ChannelLeavesReady(forever, absl::Seconds(2)));
  // The aged shard's own watch stream to the coordinator outlived the GOAWAY: still serving.
  EXPECT_EQ(CheckHealth(aged), Health::kServing);
}

TEST_F(ProbeTest, NegativeConnectionAgeIsRefused) {
  const std::string log = dir_ + "/bad.log";
  absl::StatusOr<std::unique_ptr<ChildProcess>> p =
      ChildProcess::Spawn("bad", RunfilePath("server/coordinator/moe_coordinator"),
                          {"--port=0", "--max_connection_age_seconds=-1"}, log);
  ASSERT_TRUE(p.ok()) << p.status();
  const absl::Time deadline = absl::Now() + kStartTimeout;
  while ((*p)->Running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  const int status = (*p)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << "wait status " << status;
  EXPECT_TRUE(absl::StrContains((*p)->Log(), "--max_connection_age_seconds must be in [0, "))
      << (*p)->Log();
}

}  // namespace
}  // namespace moe::testing
