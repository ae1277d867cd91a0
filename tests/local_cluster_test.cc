// The harness itself: start-up failures surface as errors carrying the server's log, and servers
// stopped with SIGTERM drain and exit 0.
#include "tests/local_cluster.h"

#include <sys/wait.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/model/generator.h"

namespace moe::testing {
namespace {

TEST(LocalClusterTest, ShardThatCannotOpenItsModelIsReportedWithItsLog) {
  const std::string missing = FreshTestDir("empty") + "/no_such_model";
  absl::StatusOr<std::unique_ptr<StandaloneShard>> shard =
      StandaloneShard::Start(missing, "cpu", absl::Seconds(30));
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kUnavailable) << shard.status();
  EXPECT_TRUE(absl::StrContains(shard.status().message(), "cannot open model")) << shard.status();
}

// Out-of-range TCP channel flags stop the shard before it listens, naming the flag.
TEST(LocalClusterTest, ShardRefusesBadTcpChannelFlags) {
  const std::string model_dir = FreshTestDir("flags_model");
  ASSERT_TRUE(model::GenerateModel({}, model_dir).ok());
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--tcp_channel_spin_us=-1", "--tcp_channel_spin_us=-1: must be in [0, 1000000]"},
           {"--tcp_channel_spin_us=2000000", "--tcp_channel_spin_us=2000000: must be in"},
           {"--tcp_channel_max_connections=0", "--tcp_channel_max_connections=0: must be in"}}) {
    SCOPED_TRACE(flag);
    absl::StatusOr<std::unique_ptr<StandaloneShard>> shard =
        StandaloneShard::Start(model_dir, "cpu", absl::Seconds(30), {"--tcp_channel", flag});
    ASSERT_FALSE(shard.ok());
    EXPECT_TRUE(absl::StrContains(shard.status().message(), message)) << shard.status();
  }
}

TEST(LocalClusterTest, ServersExitZeroOnSigterm) {
  const std::string model_dir = FreshTestDir("model");
  ASSERT_TRUE(model::GenerateModel({}, model_dir).ok());
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start({.model_dir = model_dir, .num_shards = 2, .redundant_slots = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->client().cluster_map().num_physical(), 9u);
  for (int status : (*cluster)->Stop()) {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  }

  absl::StatusOr<std::unique_ptr<StandaloneShard>> shard = StandaloneShard::Start(model_dir);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const int status = (*shard)->process().Stop();
  EXPECT_TRUE(WIFEXITED(status)) << "wait status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << (*shard)->process().LogTail();
  EXPECT_TRUE(absl::StrContains((*shard)->process().Log(), "moe_shard stopped"));
}

}  // namespace
}  // namespace moe::testing
