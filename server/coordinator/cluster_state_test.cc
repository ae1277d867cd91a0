#include "server/coordinator/cluster_state.h"

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A clock tests advance by hand, so liveness never depends on how fast the test runs.
class FakeClock {
 public:
  absl::Time Now() const { return now_; }
  void Advance(absl::Duration d) { now_ += d; }

 private:
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

v1::ModelShape Model(const std::string& fingerprint, uint32_t layers, uint32_t experts) {
  v1::ModelShape model;
  model.set_fingerprint(fingerprint);
  model.set_num_layers(layers);
  model.set_num_experts(experts);
  model.set_top_k(2);
  model.set_hidden_size(64);
  model.set_intermediate_size(32);
  return model;
}

v1::RegisterShardRequest Registration(const std::string& address, int requested_rank,
                                      const v1::ModelShape& model) {
  v1::RegisterShardRequest request;
  request.set_address(address);
  request.set_device("cpu");
  request.set_backend("cpu-reference");
  request.set_requested_rank(requested_rank);
  *request.mutable_model() = model;
  return request;
}

v1::LoadDelta Delta(uint32_t layers, uint32_t physical, std::vector<int64_t> counts) {
  v1::LoadDelta delta;
  delta.set_num_layers(layers);
  delta.set_num_physical(physical);
  delta.mutable_slot_counts()->Add(counts.begin(), counts.end());
  return delta;
}

v1::LoadDelta WithTotals(v1::LoadDelta delta, uint64_t requests, uint64_t tokens, uint64_t batches,
                         uint64_t merged_batches) {
  delta.set_requests(requests);
  delta.set_tokens(tokens);
  delta.set_batches(batches);
  delta.set_merged_batches(merged_batches);
  return delta;
}

class ClusterStateTest : public ::testing::Test {
 protected:
  // 3 shards, E = 4, R = 2 (P = 6): slots 0 1 -> rank 0, 2 3 -> rank 1, 4 5 -> rank 2; slot 4
  // replicates expert 0 (0 * 4 / 2) and slot 5 expert 2 (1 * 4 / 2).
  std::unique_ptr<ClusterState> MakeState(int num_shards, int redundant_slots) {
    ClusterOptions options;
    options.num_shards = num_shards;
    options.redundant_slots = redundant_slots;
    options.heartbeat_interval = absl::Milliseconds(500);
    options.now = [this] { return clock_.Now(); };
    return std::make_unique<ClusterState>(options);
  }

  // Registers `address` and returns its shard id, failing the test on error.
  std::string MustRegister(ClusterState& state, const std::string& address, int requested_rank,
                           const v1::ModelShape& model, uint32_t expected_rank) {
    auto response = state.RegisterShard(Registration(address, requested_rank, model));
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return "";
    EXPECT_EQ(response->rank(), expected_rank) << address;
    EXPECT_EQ(response->heartbeat_interval_ms(), 500u);
    return response->shard_id();
  }

  absl::StatusOr<v1::HeartbeatResponse> Beat(ClusterState& state, const std::string& id,
                                             uint64_t ready_version) {
    v1::HeartbeatRequest request;
    request.set_shard_id(id);
    request.set_ready_map_version(ready_version);
    return state.Heartbeat(request);
  }

  FakeClock clock_;
  const v1::ModelShape model_ = Model("fp-a", 2, 4);
};

TEST_F(ClusterStateTest, RanksFollowRequestThenLowestFree) {
  auto state = MakeState(3, 0);
  const std::string a = MustRegister(*state, "a:1", -1, model_, 0);
  MustRegister(*state, "b:1", 2, model_, 2);
  // Rank 2 is taken and 7 is out of range: both fall back to the lowest free rank.
  MustRegister(*state, "c:1", 2, model_, 1);
  auto full = state->RegisterShard(Registration("d:1", 7, model_));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);

  // A restarted shard takes back its rank under a fresh id; the old id is gone.
  const std::string a2 = MustRegister(*state, "a:1", 1, model_, 0);
  EXPECT_NE(a2, a);
  EXPECT_EQ(Beat(*state, a, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Beat(*state, a2, 0).ok());
}

TEST_F(ClusterStateTest, OtherModelIsRejected) {
  auto state = MakeState(2, 0);
  MustRegister(*state, "a:1", -1, model_, 0);
  auto other_fingerprint = state->RegisterShard(Registration("b:1", -1, Model("fp-b", 2, 4)));
  EXPECT_EQ(other_fingerprint.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_fingerprint.status().message(), HasSubstr("fingerprint"));
  auto other_shape = state->RegisterShard(Registration("b:1", -1, Model("fp-a", 2, 8)));
  EXPECT_EQ(other_shape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_shape.status().message(), HasSubstr("num_experts 8 != 4"));
  // The rejected shard took no rank.
  MustRegister(*state, "b:1", -1, model_, 1);
}

TEST_F(ClusterStateTest, MalformedRegistrationsAreInvalid) {
  auto state = MakeState(2, 0);
  v1::RegisterShardRequest no_address = Registration("", -1, model_);
  v1::RegisterShardRequest no_model = Registration("a:1", -1, model_);
  no_model.clear_model();
  v1::RegisterShardRequest no_layers = Registration("a:1", -1, Model("fp", 0, 4));
  v1::RegisterShardRequest no_experts = Registration("a:1", -1, Model("fp", 2, 0));
  v1::RegisterShardRequest big_top_k = Registration("a:1", -1, model_);
  big_top_k.mutable_model()->set_top_k(5);
  for (const auto* request : {&no_address, &no_model, &no_layers, &no_experts, &big_top_k}) {
    EXPECT_EQ(state->RegisterShard(*request).status().code(), absl::StatusCode::kInvalidArgument)
        << request->ShortDebugString();
  }
  // None of them fixed the model.
  MustRegister(*state, "a:1", -1, Model("fp-z", 1, 2), 0);
}

TEST_F(ClusterStateTest, FewerSlotsThanShardsIsAPreconditionFailure) {
  auto state = MakeState(4, 1);  // 2 experts + 1 redundant slot < 4 shards
  auto response = state->RegisterShard(Registration("a:1", -1, Model("fp", 1, 2)));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClusterStateTest, MapIsPublishedOnceAllShardsRegistered) {
  auto state = MakeState(3, 2);
  auto before = state->GetClusterMap();
  EXPECT_EQ(before.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(before.status().message(), HasSubstr("waiting for 3 more shards"));

  const std::string a = MustRegister(*state, "a:1", 2, model_, 2);
  const std::string b = MustRegister(*state, "b:1", -1, model_, 0);
  EXPECT_THAT(state->GetClusterMap().status().message(), HasSubstr("waiting for 1 more shards"));
  EXPECT_EQ(Beat(*state, a, 0)->map_version(), 0u);
  const std::string c = MustRegister(*state, "c:1", -1, model_, 1);

  auto map = state->GetClusterMap();
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_EQ(map->version(), 1u);
  EXPECT_EQ(map->model().fingerprint(), "fp-a");
  EXPECT_EQ(map->num_physical(), 6u);
  ASSERT_EQ(map->shards_size(), 3);
  const std::string ids[] = {b, c, a};
  const std::string addresses[] = {"b:1", "c:1", "a:1"};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(map->shards(r).shard_id(), ids[r]);
    EXPECT_EQ(map->shards(r).address(), addresses[r]);
    EXPECT_EQ(map->shards(r).rank(), static_cast<uint32_t>(r));
    EXPECT_FALSE(map->shards(r).ready());
  }
  EXPECT_THAT(map->slot_to_rank(), ElementsAre(0, 0, 1, 1, 2, 2));
  ASSERT_EQ(map->layers_size(), 2);
  for (const auto& layer : map->layers()) {
    EXPECT_THAT(layer.physical_to_logical(), ElementsAre(0, 1, 2, 3, 0, 2));
  }
  EXPECT_EQ(Beat(*state, a, 0)->map_version(), 1u);
}

TEST_F(ClusterStateTest, ReadinessFollowsHeartbeatsAndBumpsGeneration) {
  auto state = MakeState(2, 0);
  const std::string a = MustRegister(*state, "a:1", -1, model_, 0);
  // Before publication no shard can be ready, whatever it claims.
  ASSERT_TRUE(Beat(*state, a, 1).ok());
  const std::string b = MustRegister(*state, "b:1", -1, model_, 1);
  auto map = state->GetClusterMap();
  ASSERT_TRUE(map.ok());
  EXPECT_TRUE(map->shards(0).ready());  // its last heartbeat named version 1
  EXPECT_FALSE(map->shards(1).ready());

  const uint64_t generation = state->generation();
  ASSERT_TRUE(Beat(*state, b, 1).ok());
  EXPECT_GT(state->generation(), generation);
  EXPECT_TRUE(state->GetClusterMap()->shards(1).ready());

  // A heartbeat that changes nothing is not a map change.
  const uint64_t steady = state->generation();
  ASSERT_TRUE(Beat(*state, b, 1).ok());
  EXPECT_EQ(state->generation(), steady);

  ASSERT_TRUE(Beat(*state, b, 0).ok());
  EXPECT_FALSE(state->GetClusterMap()->shards(1).ready());
}

TEST_F(ClusterStateTest, ShardSilentForThreeIntervalsIsNotAlive) {
  auto state = MakeState(2, 0);
  const std::string a = MustRegister(*state, "a:1", -1, model_, 0);
  const std::string b = MustRegister(*state, "b:1", -1, model_, 1);
  clock_.Advance(absl::Milliseconds(1000));
  ASSERT_TRUE(Beat(*state, b, 0).ok());
  clock_.Advance(absl::Milliseconds(500));  // a: exactly 3 intervals
  EXPECT_EQ(state->AliveShards().size(), 2u);
  clock_.Advance(absl::Milliseconds(1));
  std::vector<ShardTarget> alive = state->AliveShards();
  ASSERT_EQ(alive.size(), 1u);
  EXPECT_EQ(alive[0].shard_id, b);
  EXPECT_EQ(alive[0].address, "b:1");
  EXPECT_EQ(alive[0].rank, 1u);
  v1::LoadStats stats = state->GetLoadStats();
  ASSERT_EQ(stats.shards_size(), 2);
  EXPECT_FALSE(stats.shards(0).alive());
  EXPECT_TRUE(stats.shards(1).alive());

  ASSERT_TRUE(Beat(*state, a, 0).ok());
  EXPECT_EQ(state->AliveShards().size(), 2u);
}

TEST_F(ClusterStateTest, LoadAggregatesAcrossShardsAndDeltas) {
  auto state = MakeState(3, 2);
  const std::string ids[] = {MustRegister(*state, "a:1", 0, model_, 0),
                             MustRegister(*state, "b:1", 1, model_, 1),
                             MustRegister(*state, "c:1", 2, model_, 2)};
  // Rank 0 also reports 9 routes on slot 2, which it does not host: ignored.
  // Each delta: layer 0's six slots, then layer 1's.
  const v1::LoadDelta d0 =
      WithTotals(Delta(2, 6, {5, 1, 9, 0, 0, 0, 0, 2, 0, 0, 0, 0}), 3, 10, 2, 1);
  const v1::LoadDelta d0b =
      WithTotals(Delta(2, 6, {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), 1, 4, 1, 0);
  const v1::LoadDelta d1 =
      WithTotals(Delta(2, 6, {0, 0, 2, 0, 0, 0, 0, 0, 0, 7, 0, 0}), 2, 9, 2, 0);
  const v1::LoadDelta d2 =
      WithTotals(Delta(2, 6, {0, 0, 0, 0, 3, 4, 0, 0, 0, 0, 0, 1}), 5, 20, 1, 1);

  v1::HeartbeatRequest beat;
  beat.set_shard_id(ids[0]);
  *beat.mutable_load() = d0;
  ASSERT_TRUE(state->Heartbeat(beat).ok());
  ASSERT_TRUE(state->MergeLoadDelta(ids[0], d0b).ok());
  ASSERT_TRUE(state->MergeLoadDelta(ids[1], d1).ok());
  ASSERT_TRUE(state->MergeLoadDelta(ids[2], d2).ok());

  const v1::LoadStats stats = state->GetLoadStats();
  EXPECT_EQ(stats.map_version(), 1u);
  EXPECT_EQ(stats.total_routes(), 26);
  ASSERT_EQ(stats.layers_size(), 2);
  // Layer 0 slots 6 1 2 0 3 4: experts 0 = 6 + 3, 2 = 2 + 4; shards 7 2 7.
  EXPECT_THAT(stats.layers(0).slot_load(), ElementsAre(6, 1, 2, 0, 3, 4));
  EXPECT_THAT(stats.layers(0).expert_load(), ElementsAre(9, 1, 6, 0));
  EXPECT_THAT(stats.layers(0).shard_load(), ElementsAre(7, 2, 7));
  EXPECT_DOUBLE_EQ(stats.layers(0).balancedness(), (16.0 / 3.0) / 7.0);
  // Layer 1 slots 0 2 0 7 0 1: shards 2 7 1.
  EXPECT_EQ(stats.layers(1).layer(), 1u);
  EXPECT_THAT(stats.layers(1).expert_load(), ElementsAre(0, 2, 1, 7));
  EXPECT_THAT(stats.layers(1).shard_load(), ElementsAre(2, 7, 1));
  EXPECT_DOUBLE_EQ(stats.layers(1).balancedness(), (10.0 / 3.0) / 7.0);

  ASSERT_EQ(stats.shards_size(), 3);
  const uint64_t expected[3][4] = {{4, 14, 3, 1}, {2, 9, 2, 0}, {5, 20, 1, 1}};
  for (int r = 0; r < 3; ++r) {
    const v1::ShardLoad& shard = stats.shards(r);
    EXPECT_EQ(shard.shard_id(), ids[r]);
    EXPECT_EQ(shard.rank(), static_cast<uint32_t>(r));
    EXPECT_THAT((std::vector<uint64_t>{shard.requests(), shard.tokens(), shard.batches(),
                                       shard.merged_batches()}),
                ElementsAre(expected[r][0], expected[r][1], expected[r][2], expected[r][3]));
    EXPECT_TRUE(shard.alive());
  }
}

TEST_F(ClusterStateTest, IdleClusterIsBalanced) {
  auto state = MakeState(1, 0);
  MustRegister(*state, "a:1", -1, model_, 0);
  const v1::LoadStats stats = state->GetLoadStats();
  ASSERT_EQ(stats.layers_size(), 2);
  EXPECT_THAT(stats.layers(0).expert_load(), ElementsAre(0, 0, 0, 0));
  EXPECT_DOUBLE_EQ(stats.layers(0).balancedness(), 1.0);
  EXPECT_EQ(stats.total_routes(), 0);
}

TEST_F(ClusterStateTest, MalformedDeltasAreRejectedWhole) {
  auto state = MakeState(1, 0);
  const std::string a = MustRegister(*state, "a:1", -1, model_, 0);
  const struct {
    const char* what;
    v1::LoadDelta delta;
  } cases[] = {
      {"layers", Delta(3, 4, std::vector<int64_t>(12, 1))},
      {"physical", Delta(2, 5, std::vector<int64_t>(10, 1))},
      {"count size", Delta(2, 4, std::vector<int64_t>(7, 1))},
      {"negative", Delta(2, 4, {1, 1, 1, 1, 1, 1, 1, -1})},
      {"huge", Delta(2, 4, {1, 1, 1, 1, 1, 1, 1, int64_t{1} << 50})},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(state->MergeLoadDelta(a, c.delta).code(), absl::StatusCode::kInvalidArgument)
        << c.what;
  }
  // Through a heartbeat the delta is rejected but liveness still counts.
  clock_.Advance(absl::Seconds(10));
  v1::HeartbeatRequest beat;
  beat.set_shard_id(a);
  *beat.mutable_load() = cases[0].delta;
  EXPECT_EQ(state->Heartbeat(beat).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state->AliveShards().size(), 1u);
  EXPECT_EQ(state->GetLoadStats().total_routes(), 0);
  EXPECT_EQ(state->MergeLoadDelta("nobody", Delta(2, 4, std::vector<int64_t>(8, 1))).code(),
            absl::StatusCode::kNotFound);

  // A delta without dimensions carries only executor totals.
  v1::LoadDelta totals;
  totals.set_requests(6);
  ASSERT_TRUE(state->MergeLoadDelta(a, totals).ok());
  EXPECT_EQ(state->GetLoadStats().shards(0).requests(), 6u);
  EXPECT_EQ(state->GetLoadStats().total_routes(), 0);
}

TEST_F(ClusterStateTest, AwaitMapChangeWaitsForPublicationAndChanges) {
  auto state = MakeState(2, 0);
  auto none = state->AwaitMapChange(0, state->generation(), absl::Now());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  // A waiter blocked before publication is woken by the registration that publishes.
  absl::StatusOr<std::optional<MapUpdate>> woken;
  std::thread waiter([&] { woken = state->AwaitMapChange(0, 0, absl::Now() + absl::Seconds(30)); });
  MustRegister(*state, "a:1", -1, model_, 0);
  const std::string b = MustRegister(*state, "b:1", -1, model_, 1);
  waiter.join();
  ASSERT_TRUE(woken.ok()) << woken.status();
  ASSERT_TRUE(woken->has_value());
  EXPECT_EQ((*woken)->map.version(), 1u);
  EXPECT_EQ((*woken)->map.shards_size(), 2);

  // Nothing newer than what the caller knows: times out.
  const uint64_t generation = state->generation();
  auto unchanged = state->AwaitMapChange(1, generation, absl::Now() + absl::Milliseconds(1));
  ASSERT_TRUE(unchanged.ok());
  EXPECT_FALSE(unchanged->has_value());

  ASSERT_TRUE(Beat(*state, b, 1).ok());
  auto ready = state->AwaitMapChange(1, generation, absl::Now());
  ASSERT_TRUE(ready.ok() && ready->has_value());
  EXPECT_TRUE((*ready)->map.shards(1).ready());
  EXPECT_GT((*ready)->generation, generation);

  std::thread stopper([&] { state->Shutdown(); });
  auto stopped = state->AwaitMapChange(1, state->generation(), absl::Now() + absl::Seconds(30));
  stopper.join();
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace moe
