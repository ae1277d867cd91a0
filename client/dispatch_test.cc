#include "client/dispatch.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;

// P = 4 holding experts 0 1 2 3; slots 0 1 on rank 0, 2 3 on rank 1.
class DispatchTest : public ::testing::Test {
 protected:
  const LayerPlacement placement_ = LayerPlacement::Identity(4);
  const std::vector<uint32_t> slot_to_rank_ = {0, 0, 1, 1};
  // Token 0 -> experts 0 1 (rank 0); token 1 -> 2 0 (ranks 1 and 0); token 2 has no route.
  std::vector<int32_t> ids_ = {0, 1, 2, 0, -1, -1};
  TensorView Ids() { return TensorView{DType::kI32, {3, 2}, ids_.data()}; }
};

TEST_F(DispatchTest, SharedExpertFallbackRank) {
  absl::StatusOr<DispatchPlan> plan = PlanDispatch(placement_, slot_to_rank_, 2, Ids(), {},
                                                   /*shared_experts=*/true,
                                                   /*shared_fallback_rank=*/1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->shared_rank, ElementsAre(0, 1, 1));
  EXPECT_THAT(plan->tokens_by_rank[0], ElementsAre(0, 1));
  EXPECT_THAT(plan->tokens_by_rank[1], ElementsAre(1, 2));
}

TEST_F(DispatchTest, ExpertsOnLostRanks) {
  absl::StatusOr<DispatchPlan> plan =
      PlanDispatch(placement_, slot_to_rank_, 2, Ids(), {}, /*shared_experts=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(ExpertsOnLostRanks(placement_, slot_to_rank_, {true, false}, *plan, Ids()),
              ElementsAre(2));
  EXPECT_THAT(ExpertsOnLostRanks(placement_, slot_to_rank_, {false, true}, *plan, Ids()),
              ElementsAre(0, 1));
  EXPECT_TRUE(ExpertsOnLostRanks(placement_, slot_to_rank_, {true, true}, *plan, Ids()).empty());
}

}  // namespace
}  // namespace moe
