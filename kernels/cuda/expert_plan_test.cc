// Route plans checked against hand-counted examples.
#include "kernels/cuda/expert_plan.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe::cuda {
namespace {

TEST(ExpertPlanTest, TokenGroupsCoverTheBusiestSlot) {
  const struct {
    int64_t max_count;
    int groups;
  } cases[] = {{0, 1}, {1, 1}, {8, 1}, {9, 2}, {16, 2}, {17, 4}, {32, 4}, {33, 8}, {5000, 8}};
  for (const auto& c : cases) EXPECT_EQ(ChooseTokenGroups(c.max_count), c.groups) << c.max_count;
}

TEST(ExpertPlanTest, CountsSkipUnroutedIds) {
  // 3 tokens, top-2: slot 0 once, slot 1 once, slot 2 three times, one -1.
  const std::vector<int32_t> ids = {0, 2, -1, 2, 2, 1};
  const RoutePlan plan = PlanRoutes(ids.data(), 3, 2, nullptr, 3, 2);
  EXPECT_EQ(plan.counts, (std::vector<int32_t>{1, 1, 3}));
  EXPECT_EQ(plan.num_shared, 0);  // no mask: shared experts do not run
  EXPECT_EQ(plan.slotted_routes, 5);
  EXPECT_EQ(plan.y_rows, 6);
  EXPECT_EQ(plan.max_count, 3);
  EXPECT_EQ(plan.active_slots, 3);
  EXPECT_EQ(plan.token_groups, 1);
  EXPECT_EQ(plan.num_items, 3);
}

TEST(ExpertPlanTest, SharedExpertsTakeTheMarkedTokens) {
  const std::vector<int32_t> ids = {0, 2, -1, 2, 2, 1};
  const std::vector<uint8_t> mask = {1, 0, 1};
  const RoutePlan plan = PlanRoutes(ids.data(), 3, 2, mask.data(), 3, 2);
  EXPECT_EQ(plan.counts, (std::vector<int32_t>{1, 1, 3, 2, 2}));
  EXPECT_EQ(plan.slotted_routes, 9);
  EXPECT_EQ(plan.y_rows, 12);  // T*K + S*T
  EXPECT_EQ(plan.num_items, 5);
}

TEST(ExpertPlanTest, BusySlotsSplitIntoItemsOf64) {
  // 70 tokens all on slot 1 (top-1), slot 0 empty: 64-token tiles, two items.
  const std::vector<int32_t> ids(70, 1);
  const RoutePlan plan = PlanRoutes(ids.data(), 70, 1, nullptr, 2, 0);
  EXPECT_EQ(plan.max_count, 70);
  EXPECT_EQ(plan.token_groups, 8);
  EXPECT_EQ(plan.num_items, 2);
  EXPECT_EQ(plan.active_slots, 1);
}

TEST(ExpertPlanTest, OneGroupWhenFewSlotsSplit) {
  // 17 slots, top-1. Slot 0 has 9 tokens, slots 1..16 one each: 16-token items 17, 8-token items
  // 18 (<= 17 * 9 / 8): one group, slot 0 in two items.
  std::vector<int32_t> ids(9, 0);
  for (int32_t s = 1; s <= 16; ++s) ids.push_back(s);
  const RoutePlan few = PlanRoutes(ids.data(), static_cast<int64_t>(ids.size()), 1, nullptr, 17, 0);
  EXPECT_EQ(few.max_count, 9);
  EXPECT_EQ(few.token_groups, 1);
  EXPECT_EQ(few.num_items, 18);
  // Slots 0..3 with 9 tokens each and nothing else: 4 items against 8: two groups.
  std::vector<int32_t> busy;
  for (int32_t s = 0; s < 4; ++s) busy.insert(busy.end(), 9, s);
  const RoutePlan many =
      PlanRoutes(busy.data(), static_cast<int64_t>(busy.size()), 1, nullptr, 4, 0);
  EXPECT_EQ(many.token_groups, 2);
  EXPECT_EQ(many.num_items, 4);
}

TEST(ExpertPlanTest, SmallerTilesMeanMoreItems) {
  const std::vector<int32_t> ids(70, 1);
  const RoutePlan plan = WithTokenGroups(PlanRoutes(ids.data(), 70, 1, nullptr, 2, 0), 2);
  EXPECT_EQ(plan.token_groups, 2);
  EXPECT_EQ(plan.num_items, 5);  // ceil(70 / 16)
}

}  // namespace
}  // namespace moe::cuda
