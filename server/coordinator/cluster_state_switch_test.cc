// ClusterState's placement changes with a hand-driven clock: the two-phase rebalance (pending,
// readiness, commit, drain period), load attribution across versions, removal of a failed shard
// with and without replicas, restoration, drains, and abandoned switches.
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/cluster_state.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class SwitchTest : public ::testing::Test {
 protected:
  // `shards` shards, E = 4 experts, 2 layers, `redundant` redundant slots; each shard registered
  // (rank i at "s<i>:1") and ready for version 1.
  void Start(int shards, int redundant) {
    ClusterOptions options;
    options.num_shards = shards;
    options.redundant_slots = redundant;
    options.heartbeat_interval = absl::Milliseconds(500);
    options.switch_drain = absl::Seconds(2);
    options.switch_timeout = absl::Seconds(30);
    options.load_window = absl::Seconds(10);
    options.now = [this] { return now_; };
    state_ = std::make_unique<ClusterState>(options);
    v1::ModelShape model;
    model.set_fingerprint("fp");
    model.set_num_layers(2);
    model.set_num_experts(4);
    model.set_top_k(2);
    model.set_hidden_size(64);
    model.set_intermediate_size(32);
    model.set_expert_bytes(1000);
    for (int r = 0; r < shards; ++r) {
      v1::RegisterShardRequest request;
      request.set_address(absl::StrCat("s", r, ":1"));
      request.set_requested_rank(r);
      *request.mutable_model() = model;
      absl::StatusOr<v1::RegisterShardResponse> response = state_->RegisterShard(request);
      ASSERT_TRUE(response.ok()) << response.status();
      ids_.push_back(response->shard_id());
    }
    for (int r = 0; r < shards; ++r) ASSERT_TRUE(Beat(r, 1).ok());
  }

  absl::StatusOr<v1::HeartbeatResponse> Beat(int rank, uint64_t ready,
                                             const v1::LoadDelta* load = nullptr) {
    v1::HeartbeatRequest request;
    request.set_shard_id(ids_[rank]);
    request.set_ready_map_version(ready);
    if (load != nullptr) *request.mutable_load() = *load;
    return state_->Heartbeat(request);
  }

  v1::ClusterMap Map() { return state_->GetClusterMap().value(); }

  static std::vector<int32_t> Layer(const v1::ClusterMap& map, int l) {
    return {map.layers(l).physical_to_logical().begin(), map.layers(l).physical_to_logical().end()};
  }

  static v1::LoadDelta Delta(uint64_t version, std::vector<int64_t> counts) {
    v1::LoadDelta delta;
    delta.set_num_layers(2);
    delta.set_num_physical(static_cast<uint32_t>(counts.size() / 2));
    delta.set_map_version(version);
    delta.mutable_slot_counts()->Add(counts.begin(), counts.end());
    return delta;
  }

  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  std::unique_ptr<ClusterState> state_;
  std::vector<std::string> ids_;
};

// 2 shards, P = 6: slots 0 1 2 on rank 0 hold experts 0 1 2, slots 3 4 5 on rank 1 hold 3 0 2.
// Expert 3 is hot in both layers (rank 1: 100 + a little), the rest cold.
TEST_F(SwitchTest, RebalanceIsTwoPhase) {
  Start(2, 2);
  v1::LoadDelta hot = Delta(1, {0, 0, 0, 100, 1, 1,  //
                                0, 0, 0, 100, 1, 1});
  v1::LoadDelta cold = Delta(1, {1, 1, 1, 0, 0, 0,  //
                                 1, 1, 1, 0, 0, 0});
  ASSERT_TRUE(Beat(1, 1, &hot).ok());
  ASSERT_TRUE(Beat(0, 1, &cold).ok());

  v1::RebalanceRequest dry;
  dry.set_dry_run(true);
  absl::StatusOr<v1::RebalancePlan> plan = state_->Rebalance(dry);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->new_map_version(), 0u);
  EXPECT_EQ(plan->window_routes(), 210);
  ASSERT_EQ(plan->layers_size(), 2);
  // Window load of layer 0: experts 0 and 2 have 2 routes over two replicas each, 1 has 1, 3
  // has 100. Before: rank 0 = 1 + 1 + 1 = 3, rank 1 = 100 + 1 + 1 = 102.
  EXPECT_NEAR(plan->layers(0).balancedness_before(), 52.5 / 102, 1e-12);
  // After: 3 takes both extra slots (33.3 per replica); DeepSeek's packing: 33.3 -> A, 33.3 -> B,
  // 33.3 -> A (tie), 2 -> B, 2 -> B (full), 1 -> A: max 67.67 against a mean of 52.5.
  EXPECT_NEAR(plan->layers(0).balancedness_after(), 52.5 / (100.0 * 2 / 3 + 1), 1e-12);
  EXPECT_TRUE(plan->layers(0).changed());
  EXPECT_GT(plan->moved_experts(), 0u);
  EXPECT_EQ(plan->bytes_to_move(), plan->moved_experts() * 1000);
  EXPECT_EQ(Map().version(), 1u);
  EXPECT_FALSE(Map().has_pending());

  v1::RebalanceRequest apply;
  plan = state_->Rebalance(apply);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->new_map_version(), 2u);
  v1::ClusterMap map = Map();
  EXPECT_EQ(map.version(), 1u);  // clients keep routing with version 1
  ASSERT_TRUE(map.has_pending());
  EXPECT_EQ(map.pending().version(), 2u);
  EXPECT_EQ(map.min_accepted_version(), 1u);
  EXPECT_EQ(state_->GetLoadStats().pending_version(), 2u);
  const std::vector<int32_t> planned = Layer(map.pending(), 0);
  EXPECT_EQ(std::count(planned.begin(), planned.end(), 3), 3);
  // A second rebalance waits for this one.
  EXPECT_EQ(state_->Rebalance(apply).status().code(), absl::StatusCode::kFailedPrecondition);

  // Both shards host slots of version 2, so both must load it before it commits.
  ASSERT_TRUE(Beat(0, 2).ok());
  EXPECT_EQ(Map().version(), 1u);
  EXPECT_TRUE(Map().shards(0).ready());  // it still holds version 1
  EXPECT_FALSE(state_->AwaitCommit(2, now_).value());
  ASSERT_TRUE(Beat(1, 2).ok());
  map = Map();
  EXPECT_EQ(map.version(), 2u);
  EXPECT_FALSE(map.has_pending());
  EXPECT_EQ(Layer(map, 0), planned);
  EXPECT_TRUE(state_->AwaitCommit(2, now_).value());
  EXPECT_EQ(map.min_accepted_version(), 1u);  // version 1 calls may still be in flight

  // Counts under both versions aggregate through their own placements: slot 3 held expert 3 in
  // version 1; in version 2 slot `s3` holds whatever the plan put there.
  const int32_t expert_at_slot_1 = planned[1];
  v1::LoadDelta mixed = Delta(2, {0, 7, 0, 0, 0, 0,  //
                                  0, 0, 0, 0, 0, 0});
  *mixed.add_other_versions() = Delta(1, {0, 0, 0, 0, 0, 0,  //
                                          0, 0, 0, 0, 0, 0});
  mixed.mutable_other_versions(0)->set_slot_counts(1, 5);  // slot 1 held expert 1 in version 1
  const int64_t before_1 = state_->GetLoadStats().layers(0).expert_load(1);
  const int64_t before_new = state_->GetLoadStats().layers(0).expert_load(expert_at_slot_1);
  ASSERT_TRUE(Beat(0, 2, &mixed).ok());
  const v1::LoadStats stats = state_->GetLoadStats();
  if (expert_at_slot_1 == 1) {
    EXPECT_EQ(stats.layers(0).expert_load(1), before_1 + 12);
  } else {
    EXPECT_EQ(stats.layers(0).expert_load(1), before_1 + 5);
    EXPECT_EQ(stats.layers(0).expert_load(expert_at_slot_1), before_new + 7);
  }

  // The drain period ends: version 1 is no longer accepted.
  now_ += absl::Seconds(1);
  ASSERT_TRUE(Beat(0, 2).ok() && Beat(1, 2).ok());
  state_->Tick();
  EXPECT_EQ(Map().min_accepted_version(), 1u);
  now_ += absl::Seconds(1);
  ASSERT_TRUE(Beat(0, 2).ok() && Beat(1, 2).ok());
  state_->Tick();
  EXPECT_EQ(Map().min_accepted_version(), 2u);
}

TEST_F(SwitchTest, MinimumGainLeavesTheMapAlone) {
  Start(2, 2);
  // One route on every slot: every replica carries 1, both shards 3. Nothing to gain.
  v1::LoadDelta rank0 = Delta(1, {1, 1, 1, 0, 0, 0,  //
                                  1, 1, 1, 0, 0, 0});
  v1::LoadDelta rank1 = Delta(1, {0, 0, 0, 1, 1, 1,  //
                                  0, 0, 0, 1, 1, 1});
  ASSERT_TRUE(Beat(0, 1, &rank0).ok());
  ASSERT_TRUE(Beat(1, 1, &rank1).ok());
  v1::RebalanceRequest apply;
  apply.set_min_gain(0.05);
  absl::StatusOr<v1::RebalancePlan> plan = state_->Rebalance(apply);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->new_map_version(), 0u);
  EXPECT_FALSE(plan->layers(0).changed());
  EXPECT_DOUBLE_EQ(plan->layers(0).balancedness_before(), 1.0);
  EXPECT_EQ(plan->moved_experts(), 0u);
  EXPECT_FALSE(Map().has_pending());
}

// P = 8 over 2 shards: rank 0 holds 0 1 2 3, rank 1 holds 0 1 2 3 again (R = E).
TEST_F(SwitchTest, SilentShardIsRemovedAndItsSlotsRestoredOnSurvivors) {
  Start(2, 4);
  EXPECT_THAT(Layer(Map(), 0), ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  now_ += absl::Milliseconds(1000);
  ASSERT_TRUE(Beat(0, 1).ok());
  now_ += absl::Milliseconds(501);  // rank 1: silent for more than 3 intervals
  state_->Tick();
  v1::ClusterMap map = Map();
  // Removed at once: every expert of rank 1 has a replica on rank 0, so its slots are vacant.
  EXPECT_EQ(map.version(), 2u);
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_FAILED);
  EXPECT_FALSE(map.shards(1).ready());
  EXPECT_THAT(Layer(map, 0), ElementsAre(0, 1, 2, 3, -1, -1, -1, -1));
  // The capacity comes back through a switch: rank 0 takes rank 1's slots.
  ASSERT_TRUE(map.has_pending());
  EXPECT_EQ(map.pending().version(), 3u);
  EXPECT_THAT(map.pending().slot_to_rank(), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(Layer(map.pending(), 1), ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  ASSERT_TRUE(Beat(0, 3).ok());
  EXPECT_EQ(Map().version(), 3u);
  // The removed shard's heartbeat is refused: it must register again.
  EXPECT_EQ(Beat(1, 1).status().code(), absl::StatusCode::kNotFound);
  // It does, and gets its rank back with nothing to host until a rebalance gives it slots.
  v1::RegisterShardRequest again;
  again.set_address("s1:1");
  *again.mutable_model() = Map().model();
  absl::StatusOr<v1::RegisterShardResponse> response = state_->RegisterShard(again);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->rank(), 1u);
  EXPECT_EQ(Map().shards(1).state(), v1::SHARD_ACTIVE);
  EXPECT_TRUE(Map().shards(1).ready());
  ids_[1] = response->shard_id();
  ASSERT_TRUE(Beat(1, 0).ok());
  absl::StatusOr<v1::RebalancePlan> plan = state_->Rebalance(v1::RebalanceRequest());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->new_map_version(), 4u);
  EXPECT_THAT(Map().pending().slot_to_rank(), ElementsAre(0, 0, 0, 0, 1, 1, 1, 1));
}

// P = 4 over 2 shards: rank 0 holds experts 0 1, rank 1 holds 2 3, no replicas.
TEST_F(SwitchTest, UnhealthyShardWithoutReplicasLeavesOrphansUntilReloaded) {
  Start(2, 0);
  ASSERT_TRUE(state_->ReportUnhealthy(ids_[1], "health check: connection refused").ok());
  v1::ClusterMap map = Map();
  // Nothing can be vacated: experts 2 and 3 stay on the failed rank (clients fail fast on them).
  EXPECT_EQ(map.version(), 1u);
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_FAILED);
  EXPECT_THAT(Layer(map, 0), ElementsAre(0, 1, 2, 3));
  ASSERT_TRUE(map.has_pending());
  EXPECT_THAT(map.pending().slot_to_rank(), ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(Layer(map.pending(), 0), ElementsAre(0, 1, 2, 3));
  EXPECT_FALSE(state_->AwaitCommit(2, now_).value());
  ASSERT_TRUE(Beat(0, 2).ok());
  EXPECT_EQ(Map().version(), 2u);
  // Reporting it again changes nothing.
  ASSERT_TRUE(state_->ReportUnhealthy(ids_[1], "again").ok());
  EXPECT_EQ(Map().version(), 2u);
  EXPECT_FALSE(Map().has_pending());
  EXPECT_EQ(state_->ReportUnhealthy("nobody", "x").code(), absl::StatusCode::kNotFound);
}

TEST_F(SwitchTest, DrainMovesSlotsThenStopsTheShard) {
  Start(2, 2);
  v1::DrainRequest request;
  request.set_shard_id(ids_[1]);
  absl::StatusOr<v1::DrainResponse> response = state_->Drain(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->new_map_version(), 2u);
  EXPECT_EQ(response->moved_slots(), 3u);
  v1::ClusterMap map = Map();
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_DRAINING);
  EXPECT_THAT(map.pending().slot_to_rank(), ElementsAre(0, 0, 0, 0, 0, 0));
  // The draining shard keeps serving version 1 and need not load version 2.
  ASSERT_TRUE(Beat(0, 2).ok());
  map = Map();
  EXPECT_EQ(map.version(), 2u);
  EXPECT_TRUE(map.shards(1).ready());  // hosts nothing now
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_DRAINING);
  // The last active shard cannot be drained.
  request.set_shard_id(ids_[0]);
  EXPECT_EQ(state_->Drain(request).status().code(), absl::StatusCode::kFailedPrecondition);
  now_ += absl::Seconds(2);
  ASSERT_TRUE(Beat(0, 2).ok() && Beat(1, 1).ok());
  state_->Tick();
  map = Map();
  EXPECT_EQ(map.shards(1).state(), v1::SHARD_DRAINED);
  EXPECT_EQ(map.min_accepted_version(), 2u);
  // A drained shard is not probed or failed.
  EXPECT_EQ(state_->ProbeTargets().size(), 1u);
  now_ += absl::Seconds(5);
  ASSERT_TRUE(Beat(0, 2).ok());
  state_->Tick();
  EXPECT_EQ(Map().shards(1).state(), v1::SHARD_DRAINED);
}

TEST_F(SwitchTest, SwitchNeverReadyIsAbandoned) {
  Start(2, 2);
  ASSERT_TRUE(state_
                  ->Drain([&] {
                    v1::DrainRequest r;
                    r.set_shard_id(ids_[1]);
                    return r;
                  }())
                  .ok());
  for (int i = 0; i < 61; ++i) {
    now_ += absl::Milliseconds(500);
    ASSERT_TRUE(Beat(0, 1).ok() && Beat(1, 1).ok());
    state_->Tick();
  }
  EXPECT_FALSE(Map().has_pending());
  EXPECT_EQ(Map().version(), 1u);
  EXPECT_FALSE(state_->AwaitCommit(2, now_ + absl::Seconds(30)).value());
}

TEST_F(SwitchTest, FailureDuringASwitchAbandonsItAndRestores) {
  Start(3, 2);  // P = 6: slots 0 1 | 2 3 | 4 5 hold experts 0 1 | 2 3 | 0 2
  v1::DrainRequest drain;
  drain.set_shard_id(ids_[2]);
  ASSERT_TRUE(state_->Drain(drain).ok());
  EXPECT_EQ(Map().pending().version(), 2u);
  EXPECT_THAT(Map().pending().slot_to_rank(), ElementsAre(0, 0, 1, 1, 1, 0));
  ASSERT_TRUE(state_->ReportUnhealthy(ids_[1], "gone").ok());
  v1::ClusterMap map = Map();
  // Rank 1's expert 2 is also on the (still serving) draining rank 2: its slot is vacated at
  // once; expert 3 has no other replica and stays.
  EXPECT_EQ(map.version(), 3u);
  EXPECT_THAT(Layer(map, 1), ElementsAre(0, 1, -1, 3, 0, 2));
  // The drain's switch is replaced by one that moves both rank 1's and the draining rank 2's
  // slots to rank 0, every expert back in its slot.
  ASSERT_TRUE(map.has_pending());
  EXPECT_EQ(map.pending().version(), 4u);
  EXPECT_THAT(map.pending().slot_to_rank(), ElementsAre(0, 0, 0, 0, 0, 0));
  EXPECT_THAT(Layer(map.pending(), 1), ElementsAre(0, 1, 2, 3, 0, 2));
}

}  // namespace
}  // namespace moe
