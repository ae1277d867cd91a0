// LoadHistory: window differencing, balancedness per interval (idle = NaN), bounded memory,
// restart on counter reset.
#include "server/coordinator/load_history.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

// One layer per entry of `experts` / `shards` (cumulative counts).
v1::LoadStats Stats(const std::vector<std::vector<int64_t>>& experts,
                    const std::vector<std::vector<int64_t>>& shards) {
  v1::LoadStats stats;
  for (size_t l = 0; l < experts.size(); ++l) {
    v1::LayerLoad* layer = stats.add_layers();
    layer->set_layer(static_cast<uint32_t>(l));
    layer->mutable_expert_load()->Add(experts[l].begin(), experts[l].end());
    layer->mutable_shard_load()->Add(shards[l].begin(), shards[l].end());
  }
  return stats;
}

TEST(LoadHistoryTest, ShardBalancedness) {
  EXPECT_NEAR(ShardBalancedness({10, 30}), 20.0 / 30.0, 1e-12);
  EXPECT_DOUBLE_EQ(ShardBalancedness({7, 7, 7}), 1.0);
  EXPECT_TRUE(std::isnan(ShardBalancedness({0, 0})));
  EXPECT_TRUE(std::isnan(ShardBalancedness({})));
}

TEST(LoadHistoryTest, WindowIsCurrentMinusOldestKeptSnapshot) {
  LoadHistory history({.window_samples = 2, .history_points = 10});
  LoadWindow empty = history.Window(kT0, Stats({{1, 2}}, {{1, 2}}));
  EXPECT_EQ(empty.span, absl::ZeroDuration());
  EXPECT_EQ(empty.routes, 0);
  EXPECT_EQ(empty.expert_load, (std::vector<int64_t>{0, 0}));
  EXPECT_TRUE(std::isnan(empty.balancedness[0]));

  history.Add(kT0, Stats({{1, 2}}, {{1, 2}}));
  history.Add(kT0 + absl::Seconds(1), Stats({{4, 2}}, {{3, 4}}));
  LoadWindow w = history.Window(kT0 + absl::Seconds(2), Stats({{10, 2}}, {{6, 6}}));
  EXPECT_EQ(w.span, absl::Seconds(2));
  EXPECT_EQ(w.num_layers, 1);
  EXPECT_EQ(w.num_experts, 2);
  EXPECT_EQ(w.expert_load, (std::vector<int64_t>{9, 0}));
  EXPECT_EQ(w.routes, 9);
  // Shard deltas {5, 4}: mean 4.5 over max 5.
  EXPECT_NEAR(w.balancedness[0], 0.9, 1e-12);

  // Two more snapshots push the first two out (window_samples + 1 = 3 kept).
  history.Add(kT0 + absl::Seconds(2), Stats({{10, 2}}, {{6, 6}}));
  history.Add(kT0 + absl::Seconds(3), Stats({{10, 8}}, {{9, 9}}));
  w = history.Window(kT0 + absl::Seconds(3), Stats({{10, 8}}, {{9, 9}}));
  EXPECT_EQ(w.span, absl::Seconds(2));
  EXPECT_EQ(w.expert_load, (std::vector<int64_t>{6, 6}));  // minus the snapshot at +1 s
}

TEST(LoadHistoryTest, BalancednessPointsPerIntervalWithIdleLayersAsNaN) {
  LoadHistory history({.window_samples = 1, .history_points = 3});
  history.Add(kT0, Stats({{0, 0}, {0, 0}}, {{0, 0}, {0, 0}}));
  EXPECT_TRUE(history.Balancedness().empty());
  // Interval 1: layer 0 shards {2, 4} (0.75), layer 1 idle.
  history.Add(kT0 + absl::Seconds(1), Stats({{6, 0}, {0, 0}}, {{2, 4}, {0, 0}}));
  // Interval 2: layer 0 {2, 2} (1.0), layer 1 {0, 2} (0.5).
  history.Add(kT0 + absl::Seconds(2), Stats({{10, 0}, {2, 0}}, {{4, 6}, {0, 2}}));
  // Interval 3: idle.
  history.Add(kT0 + absl::Seconds(3), Stats({{10, 0}, {2, 0}}, {{4, 6}, {0, 2}}));
  std::vector<BalancednessPoint> points = history.Balancedness();
  ASSERT_EQ(points.size(), 3u);
  EXPECT_EQ(points[0].time, kT0 + absl::Seconds(1));
  EXPECT_NEAR(points[0].per_layer[0], 0.75, 1e-12);
  EXPECT_TRUE(std::isnan(points[0].per_layer[1]));
  EXPECT_NEAR(points[0].mean, 0.75, 1e-12);  // over the layers with load only
  EXPECT_NEAR(points[0].min, 0.75, 1e-12);
  EXPECT_NEAR(points[1].mean, 0.75, 1e-12);  // (1.0 + 0.5) / 2
  EXPECT_NEAR(points[1].min, 0.5, 1e-12);
  EXPECT_TRUE(std::isnan(points[2].mean));
  EXPECT_TRUE(std::isnan(points[2].min));

  // The series is bounded: a fourth interval drops the oldest point.
  history.Add(kT0 + absl::Seconds(4), Stats({{11, 0}, {2, 0}}, {{5, 6}, {0, 2}}));
  points = history.Balancedness();
  ASSERT_EQ(points.size(), 3u);
  EXPECT_EQ(points[0].time, kT0 + absl::Seconds(2));
}

TEST(LoadHistoryTest, CounterResetOrReshapeRestartsAndOlderSnapshotsAreIgnored) {
  LoadHistory history({.window_samples = 4, .history_points = 10});
  history.Add(kT0, Stats({{5, 5}}, {{5, 5}}));
  history.Add(kT0 + absl::Seconds(1), Stats({{6, 6}}, {{6, 6}}));
  ASSERT_EQ(history.Balancedness().size(), 1u);
  // Older than the newest snapshot: ignored.
  history.Add(kT0 + absl::Milliseconds(500), Stats({{0, 0}}, {{0, 0}}));
  EXPECT_EQ(history.Balancedness().size(), 1u);
  // Counts went down (the coordinator's totals were reset): start over from this snapshot.
  history.Add(kT0 + absl::Seconds(2), Stats({{1, 0}}, {{1, 0}}));
  EXPECT_TRUE(history.Balancedness().empty());
  LoadWindow w = history.Window(kT0 + absl::Seconds(3), Stats({{3, 1}}, {{3, 1}}));
  EXPECT_EQ(w.expert_load, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(w.span, absl::Seconds(1));
  // A different shape (three experts) has no comparable window.
  w = history.Window(kT0 + absl::Seconds(3), Stats({{3, 1, 1}}, {{3, 2}}));
  EXPECT_EQ(w.routes, 0);
  EXPECT_EQ(w.span, absl::ZeroDuration());
  EXPECT_EQ(w.expert_load.size(), 3u);
}

TEST(LoadHistoryTest, LoadArrivingWithTheModelIsNotLost) {
  LoadHistory history({.window_samples = 4, .history_points = 10});
  history.Add(kT0, v1::LoadStats());  // no model registered yet
  // The model and its first routes appear within one interval.
  history.Add(kT0 + absl::Seconds(1), Stats({{3, 1}}, {{3, 1}}));
  std::vector<BalancednessPoint> points = history.Balancedness();
  ASSERT_EQ(points.size(), 1u);
  EXPECT_NEAR(points[0].mean, 2.0 / 3.0, 1e-12);  // shards {3, 1}: mean 2 over max 3
  LoadWindow w = history.Window(kT0 + absl::Seconds(2), Stats({{3, 2}}, {{3, 2}}));
  EXPECT_EQ(w.expert_load, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(w.span, absl::Seconds(2));
}

}  // namespace
}  // namespace moe
