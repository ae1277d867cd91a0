#include "server/coordinator/placement.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

struct SlotToRankCase {
  int num_physical;
  int num_shards;
  std::vector<uint32_t> expected;
  bool every_rank_hosts;
};

TEST(RankMajorSlotToRankTest, HandWorkedLayouts) {
  const SlotToRankCase cases[] = {
      {8, 2, {0, 0, 0, 0, 1, 1, 1, 1}, true},
      {4, 4, {0, 1, 2, 3}, true},
      {3, 1, {0, 0, 0}, true},
      // ceil(10 / 4) = 3 slots per rank, the last rank gets the remainder.
      {10, 4, {0, 0, 0, 1, 1, 1, 2, 2, 2, 3}, true},
      // ceil(5 / 4) = 2: rank 3 ends up with no slot.
      {5, 4, {0, 0, 1, 1, 2}, false},
      {6, 3, {0, 0, 1, 1, 2, 2}, true},
  };
  for (const SlotToRankCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "P=" << c.num_physical << " shards=" << c.num_shards);
    const std::vector<uint32_t> slot_to_rank = RankMajorSlotToRank(c.num_physical, c.num_shards);
    EXPECT_THAT(slot_to_rank, ElementsAreArray(c.expected));
    EXPECT_EQ(EveryRankHostsASlot(slot_to_rank, c.num_shards), c.every_rank_hosts);
  }
}

struct PlacementCase {
  int num_logical;
  int num_redundant;
  std::vector<int32_t> expected;
};

TEST(InitialPhysicalToLogicalTest, RedundantSlotsSpreadOverExperts) {
  const PlacementCase cases[] = {
      {4, 0, {0, 1, 2, 3}},
      // r * 8 / 4 for r = 0..3: experts 0, 2, 4, 6.
      {8, 4, {0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6}},
      // r * 4 / 3 for r = 0..2: 0, 1 (4/3), 2 (8/3).
      {4, 3, {0, 1, 2, 3, 0, 1, 2}},
      // More redundant slots than experts: r * 3 / 6 = 0 0 1 1 2 2.
      {3, 6, {0, 1, 2, 0, 0, 1, 1, 2, 2}},
      {1, 2, {0, 0, 0}},
  };
  for (const PlacementCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "E=" << c.num_logical << " R=" << c.num_redundant);
    EXPECT_THAT(InitialPhysicalToLogical(c.num_logical, c.num_redundant),
                ElementsAreArray(c.expected));
  }
}

TEST(InitialPhysicalToLogicalTest, LargeExpertCountDoesNotOverflow) {
  // r * E = 99999 * 65536 exceeds int32; the expected id is floor(99999 * 65536 / 100000).
  const std::vector<int32_t> p2l = InitialPhysicalToLogical(65536, 100000);
  EXPECT_EQ(p2l[65536 + 99999], 65535);
  EXPECT_EQ(p2l[65536 + 50000], 32768);
}

TEST(BalancednessTest, MeanOverMax) {
  EXPECT_DOUBLE_EQ(Balancedness({}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness({0, 0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness({10, 10}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness({30, 10}), 20.0 / 30.0);
  EXPECT_DOUBLE_EQ(Balancedness({6, 0, 0}), 2.0 / 6.0);
}

TEST(VacateRankTest, ReplicatedExpertsLeaveOrphansStay) {
  // 2 layers, P = 6, ranks 0 0 1 1 2 2. Layer 0: rank 1 holds 2 (also on rank 0) and 3 (only
  // there). Layer 1: rank 1 holds 0 (also on rank 2, which is not serving) and 1 (also on rank 0).
  const std::vector<int32_t> p2l = {0, 2, 2, 3, 1, 0,  //
                                    1, 2, 0, 1, 0, 3};
  const std::vector<uint32_t> slot_to_rank = {0, 0, 1, 1, 2, 2};
  const std::vector<bool> serving = {true, false, false};  // rank 1 failed, rank 2 too
  EXPECT_THAT(VacateRank(p2l, slot_to_rank, 1, serving), ElementsAre(0, 2, -1, 3, 1, 0,  //
                                                                     1, 2, 0, -1, 0, 3));
  const std::vector<bool> rank2_serving = {true, false, true};
  EXPECT_THAT(VacateRank(p2l, slot_to_rank, 1, rank2_serving), ElementsAre(0, 2, -1, 3, 1, 0,  //
                                                                           1, 2, -1, -1, 0, 3));
}

TEST(BalanceSlotLayoutTest, MovesSlotsOffIneligibleRanksEvenly) {
  // Rank 1 (slots 2, 3, 4) leaves, highest slot first: slot 4 -> rank 2 (1 slot against rank 0's
  // 2), slot 3 -> rank 0 (2 and 2: the lower rank), slot 2 -> rank 2 (3 against 2).
  const std::vector<uint32_t> layout = {0, 0, 1, 1, 1, 2};
  EXPECT_THAT(BalanceSlotLayout(layout, {true, false, true}), ElementsAre(0, 0, 2, 0, 2, 2));
  // All eligible but uneven (2, 3, 1): rank 1's highest slot moves to rank 2.
  EXPECT_THAT(BalanceSlotLayout(layout, {true, true, true}), ElementsAre(0, 0, 1, 1, 2, 2));
  // Already even: nothing moves.
  EXPECT_THAT(BalanceSlotLayout(std::vector<uint32_t>{0, 1, 1, 0}, {true, true}),
              ElementsAre(0, 1, 1, 0));
  // A rank that came back with no slots receives the highest slots of the fullest ranks.
  EXPECT_THAT(BalanceSlotLayout(std::vector<uint32_t>{0, 0, 0, 0}, {true, true}),
              ElementsAre(0, 0, 1, 1));
}

}  // namespace
}  // namespace moe
