#include "server/coordinator/load_book.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

LoadBookOptions Options() {
  LoadBookOptions o;
  o.num_layers = 1;
  o.num_logical = 3;
  o.num_physical = 4;
  o.num_shards = 2;
  o.bucket = absl::Seconds(1);
  o.window = absl::Seconds(3);
  o.max_history = 2;
  return o;
}

// Slots 0 1 on rank 0, 2 3 on rank 1.
const VersionPlacement kV1 = {{0, 0, 1, 1}, {0, 1, 2, 0}};
const VersionPlacement kV2 = {{0, 0, 1, 1}, {0, 1, 2, 2}};  // slot 3 now holds expert 2

TEST(LoadBookTest, CountsAreAttributedThroughTheirOwnVersion) {
  LoadBook book(Options(), kStart);
  EXPECT_FALSE(book.Add(1, kV1, std::vector<int64_t>{0, 0, 5, 7}, kStart));
  EXPECT_FALSE(book.Add(1, kV2, std::vector<int64_t>{0, 0, 1, 3}, kStart));
  EXPECT_FALSE(book.Add(0, kV2, std::vector<int64_t>{2, 1, 0, 0}, kStart));
  v1::LoadStats stats;
  book.Summarize(kStart, absl::ZeroDuration(), std::vector<bool>{true, true}, &stats);
  ASSERT_EQ(stats.layers_size(), 1);
  const v1::LayerLoad& l = stats.layers(0);
  // Expert 0: 7 (slot 3 under v1) + 2; expert 1: 1; expert 2: 5 + 1 + 3 (slot 3 under v2).
  EXPECT_THAT(l.expert_load(), ElementsAre(9, 1, 9));
  EXPECT_THAT(l.slot_load(), ElementsAre(2, 1, 6, 10));
  EXPECT_THAT(l.shard_load(), ElementsAre(3, 16));
  EXPECT_DOUBLE_EQ(l.balancedness(), 9.5 / 16);
  EXPECT_EQ(stats.total_routes(), 19);
}

TEST(LoadBookTest, ForeignAndVacantSlotsAreDropped) {
  LoadBook book(Options(), kStart);
  // Rank 0 does not host slot 2.
  EXPECT_TRUE(book.Add(0, kV1, std::vector<int64_t>{1, 0, 4, 0}, kStart));
  const VersionPlacement vacant = {{0, 0, 1, 1}, {0, 1, 2, -1}};
  EXPECT_TRUE(book.Add(1, vacant, std::vector<int64_t>{0, 0, 1, 6}, kStart));
  const WindowLoad w = book.Window(kStart, absl::ZeroDuration());
  EXPECT_THAT(w.expert, ElementsAre(1, 0, 1));
  EXPECT_THAT(w.shard, ElementsAre(1, 1));
}

TEST(LoadBookTest, WindowSlidesOverBuckets) {
  LoadBook book(Options(), kStart);
  const std::vector<bool> live = {true, true};
  book.Add(0, kV1, std::vector<int64_t>{10, 0, 0, 0}, kStart + absl::Milliseconds(500));
  book.Add(0, kV1, std::vector<int64_t>{20, 0, 0, 0}, kStart + absl::Milliseconds(1500));
  const absl::Time t = kStart + absl::Milliseconds(3500);
  book.Add(1, kV1, std::vector<int64_t>{0, 0, 40, 0}, t);
  book.Advance(t, 1, live);
  // Bucket 0 (t < 1 s) left the 3 s window; buckets 1..3 remain.
  const WindowLoad all = book.Window(t, absl::ZeroDuration());
  EXPECT_EQ(all.length, absl::Seconds(3));
  EXPECT_THAT(all.expert, ElementsAre(20, 0, 40));
  EXPECT_THAT(all.shard, ElementsAre(20, 40));
  // The last second only.
  EXPECT_THAT(book.Window(t, absl::Seconds(1)).expert, ElementsAre(0, 0, 40));
  // Longer than configured: the configured window.
  EXPECT_THAT(book.Window(t, absl::Seconds(100)).expert, ElementsAre(20, 0, 40));
  // Cumulative counts keep everything.
  v1::LoadStats stats;
  book.Summarize(t, absl::ZeroDuration(), live, &stats);
  EXPECT_THAT(stats.layers(0).expert_load(), ElementsAre(30, 0, 40));
  EXPECT_THAT(stats.layers(0).window_expert_load(), ElementsAre(20, 0, 40));
  EXPECT_DOUBLE_EQ(stats.layers(0).window_balancedness(), 30.0 / 40);
  EXPECT_EQ(stats.window_routes(), 60);
  EXPECT_DOUBLE_EQ(stats.window_seconds(), 3.0);
  // Only rank 1 counts as live: one shard is always balanced.
  EXPECT_DOUBLE_EQ(book.Window(t, absl::ZeroDuration()).shard[1], 40);
  v1::LoadStats one;
  book.Summarize(t, absl::ZeroDuration(), std::vector<bool>{false, true}, &one);
  EXPECT_DOUBLE_EQ(one.layers(0).window_balancedness(), 1.0);
  // After a silence longer than the window, nothing is left in it.
  EXPECT_THAT(book.Window(t + absl::Seconds(10), absl::ZeroDuration()).expert,
              ElementsAre(0, 0, 0));
}

TEST(LoadBookTest, HistoryHasOneSamplePerBucketAndIsBounded) {
  LoadBook book(Options(), kStart);
  const std::vector<bool> live = {true, true};
  book.Add(0, kV1, std::vector<int64_t>{10, 0, 0, 0}, kStart);
  book.Advance(kStart + absl::Milliseconds(200), 1, live);  // same bucket: no sample
  v1::LoadStats stats;
  book.Summarize(kStart, absl::ZeroDuration(), live, &stats);
  EXPECT_EQ(stats.history_size(), 0);
  book.Advance(kStart + absl::Milliseconds(1200), 1, live);
  book.Add(1, kV1, std::vector<int64_t>{0, 0, 10, 0}, kStart + absl::Milliseconds(1300));
  book.Advance(kStart + absl::Milliseconds(2200), 2, live);
  book.Advance(kStart + absl::Milliseconds(3200), 2, live);
  stats.Clear();
  book.Summarize(kStart, absl::ZeroDuration(), live, &stats);
  ASSERT_EQ(stats.history_size(), 2);  // max_history
  // Samples at 1.2 s (dropped: only 2 kept), 2.2 s and 3.2 s. At 2.2 s the window holds 10 on
  // each shard; at 3.2 s bucket 0 has left it and only rank 1's 10 remain: 5 / 10.
  EXPECT_EQ(stats.history(0).map_version(), 2u);
  EXPECT_DOUBLE_EQ(stats.history(0).mean_balancedness(), 1.0);
  EXPECT_EQ(stats.history(1).unix_millis(), absl::ToUnixMillis(kStart + absl::Milliseconds(3200)));
  EXPECT_THAT(stats.history(1).layer_balancedness(), ElementsAre(0.5));
}

TEST(LoadBookTest, BucketsStretchToBoundTheirNumber) {
  LoadBookOptions o = Options();
  o.bucket = absl::Milliseconds(100);
  o.window = absl::Seconds(64);
  LoadBook book(o, kStart);
  EXPECT_EQ(book.window_length(), absl::Seconds(64));  // 64 buckets of 1 s
}

}  // namespace
}  // namespace moe
