// ClusterState with a journal: what a restarted coordinator restores (map version, ranks by
// address, load totals) and how it treats shards coming back.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/journal.h"

namespace moe {
namespace {

v1::ModelShape Model(const std::string& fingerprint) {
  v1::ModelShape model;
  model.set_fingerprint(fingerprint);
  model.set_num_layers(1);
  model.set_num_experts(4);
  model.set_top_k(2);
  model.set_hidden_size(64);
  model.set_intermediate_size(32);
  return model;
}

v1::RegisterShardRequest Registration(const std::string& address, int rank,
                                      const std::string& fingerprint = "fp") {
  v1::RegisterShardRequest request;
  request.set_address(address);
  request.set_device("cpu");
  request.set_backend("cpu-reference");
  request.set_requested_rank(rank);
  *request.mutable_model() = Model(fingerprint);
  return request;
}

std::string FreshDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/cs_journal_", ::getpid());
  std::remove(absl::StrCat(dir, "/coordinator.journal").c_str());
  return dir;
}

TEST(ClusterStateJournalTest, RestartResumesMapRanksAndLoad) {
  const std::string dir = FreshDir();
  std::string old_id;
  {
    JournalState empty;
    auto journal = Journal::Open(dir, &empty);
    ASSERT_TRUE(journal.ok()) << journal.status();
    ClusterOptions options;
    options.num_shards = 2;
    options.journal = journal->get();
    ClusterState state(options);
    ASSERT_TRUE(state.RegisterShard(Registration("a:1", 0)).ok());
    auto b = state.RegisterShard(Registration("b:2", 1));
    ASSERT_TRUE(b.ok());
    old_id = b->shard_id();
    ASSERT_EQ(state.GetClusterMap()->version(), 1u);
    // Rank 1 hosts slots 2 and 3 (rank-major layout); it routed 5 and 9 tokens there.
    v1::HeartbeatRequest beat;
    beat.set_shard_id(old_id);
    beat.set_ready_map_version(1);
    beat.mutable_load()->set_num_layers(1);
    beat.mutable_load()->set_num_physical(4);
    for (int64_t c : {0, 0, 5, 9}) beat.mutable_load()->add_slot_counts(c);
    ASSERT_TRUE(state.Heartbeat(beat).ok());
    state.Shutdown();  // writes a final load snapshot
  }
  JournalState recovered;
  auto journal = Journal::Open(dir, &recovered);
  ASSERT_TRUE(journal.ok()) << journal.status();
  ClusterOptions options;
  options.num_shards = 2;
  options.journal = journal->get();
  ClusterState state(options);
  ASSERT_TRUE(state.Restore(recovered).ok());
  ASSERT_TRUE(state.GetClusterMap().ok());
  EXPECT_EQ(state.GetClusterMap()->version(), 1u);
  const v1::LoadStats stats = state.GetLoadStats();
  ASSERT_EQ(stats.layers_size(), 1);
  EXPECT_EQ(stats.total_routes(), 14);
  EXPECT_EQ(stats.layers(0).expert_load(2), 5);
  EXPECT_EQ(stats.layers(0).expert_load(3), 9);
  // The pre-crash id is unknown: the shard must re-register.
  v1::HeartbeatRequest stale;
  stale.set_shard_id(old_id);
  EXPECT_EQ(state.Heartbeat(stale).status().code(), absl::StatusCode::kNotFound);
  // Another model is refused; the same address gets its old rank back even asking for any.
  EXPECT_EQ(state.RegisterShard(Registration("c:3", -1, "other")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto back = state.RegisterShard(Registration("b:2", -1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rank(), 1u);
  EXPECT_NE(back->shard_id(), old_id);
  EXPECT_EQ(state.GetClusterMap()->version(), 1u);
}

}  // namespace
}  // namespace moe
