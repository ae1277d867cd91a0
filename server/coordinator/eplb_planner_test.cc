// Tests of the EPLB planner: the building blocks on hand-worked cases, slot preservation and the
// minimum-gain threshold, the hierarchical policy, input validation, and the quality test of
// performance.md (Zipf 1.2 trace, 61 layers x 256 experts, 32 shards, 288 slots) against the plain
// DeepSeek implementation of eplb_reference.h, written independently of the planner.
#include "server/coordinator/eplb_planner.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/eplb_reference.h"
#include "server/coordinator/eplb_trace.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

std::vector<int32_t> RankMajor(int num_physical, int num_gpus) {
  std::vector<int32_t> gpu(num_physical);
  for (int p = 0; p < num_physical; ++p) gpu[p] = p / (num_physical / num_gpus);
  return gpu;
}

// The experts in the slots of `gpu`, for unordered comparisons.
std::vector<int32_t> ExpertsOn(const std::vector<int32_t>& p2l, const std::vector<int32_t>& gpu_of,
                               int gpu) {
  std::vector<int32_t> out;
  for (size_t s = 0; s < p2l.size(); ++s) {
    if (gpu_of[s] == gpu) out.push_back(p2l[s]);
  }
  return out;
}

TEST(BalancedPackingTest, HandWorkedExample) {
  // Descending: 5 (item 0), 4 (2), 3 (4), 3 (5), 2 (3), 1 (1). 5 -> pack 0; 4 -> 1; 3 -> 1 (4 < 5);
  // 3 -> 0 (5 < 7); 2 -> 1 (7 < 8, now full); 1 -> 0 (the only pack with room). Both packs: 9.
  EXPECT_THAT(BalancedPacking({5, 1, 4, 2, 3, 3}, {3, 3}), ElementsAre(0, 0, 1, 1, 1, 0));
}

TEST(BalancedPackingTest, UnequalCapacities) {
  // 4 -> pack 0 (tie, lower index); 3 -> pack 1; 2 -> pack 1 (3 < 4, now full); 1 -> pack 0.
  EXPECT_THAT(BalancedPacking({4, 3, 2, 1}, {2, 2}), ElementsAre(0, 1, 1, 0));
  // Pack 1 holds one item: 4 -> 0; 3 -> 1 (full); 2 and 1 -> 0.
  EXPECT_THAT(BalancedPacking({4, 3, 2, 1}, {3, 1}), ElementsAre(0, 1, 0, 0));
}

TEST(ReplicateExpertsTest, HandWorkedExample) {
  // Ratios 6 3 1 -> expert 0 (count 2); 3 3 1 -> tie, expert 0 (count 3); 2 3 1 -> expert 1.
  const Replication rep = ReplicateExperts({6, 3, 1}, 6);
  EXPECT_THAT(rep.replica_to_logical, ElementsAre(0, 1, 2, 0, 0, 1));
  EXPECT_THAT(rep.count, ElementsAre(3, 2, 1));
}

TEST(PredictedBalancednessTest, HandWorkedExample) {
  // Per replica: expert 0 -> 2, expert 1 -> 1.5, expert 2 -> 1. GPU 0: 2 + 1.5 + 1 = 4.5;
  // GPU 1: 2 + 2 + 1.5 = 5.5; mean 5 / max 5.5.
  EXPECT_DOUBLE_EQ(PredictedBalancedness({6, 3, 1}, {0, 1, 2, 0, 0, 1}, {0, 0, 0, 1, 1, 1}, 2),
                   5.0 / 5.5);
  // Idle layer.
  EXPECT_DOUBLE_EQ(PredictedBalancedness({0, 0}, {0, 1}, {0, 1}, 2), 1.0);
  // Expert 1 has load but its only slot is on no GPU: that load cannot be served.
  EXPECT_DOUBLE_EQ(PredictedBalancedness({1, 1}, {0, 1}, {0, -1}, 1), 0.0);
  // Vacant slots carry nothing: GPU 0 = 1, GPU 1 = 1.
  EXPECT_DOUBLE_EQ(PredictedBalancedness({1, 1}, {0, -1, 1, -1}, {0, 0, 1, 1}, 2), 1.0);
}

// E = 4, P = 6, 2 GPUs, load 10 1 1 4. Replicas: expert 0 gets two more (10 -> 5 -> 3.33), so the
// per-replica weights are 3.33 1 1 4 3.33 3.33 for replicas of experts 0 1 2 3 0 0. Packing:
// 4 (e3) -> A; 3.33 (e0) -> B; 3.33 (e0) -> B (3.33 < 4); 3.33 (e0) -> A (4 < 6.67);
// 1 (e1) -> B (6.67 < 7.33, full); 1 (e2) -> A. A = {3, 0, 2} = 8.33, B = {0, 0, 1} = 7.67:
// balancedness 8 / 8.33 = 0.96.
class SmallPlanTest : public ::testing::Test {
 protected:
  const std::vector<double> load_ = {10, 1, 1, 4};
  const std::vector<int32_t> gpu_ = {0, 0, 0, 1, 1, 1};
  EplbProblem Problem() const {
    EplbProblem p;
    p.num_layers = 1;
    p.num_logical = 4;
    p.load = load_;
    p.slot_to_gpu = gpu_;
    p.num_gpus = 2;
    p.expert_bytes = 1000;
    return p;
  }
};

TEST_F(SmallPlanTest, WithoutCurrentPlacement) {
  absl::StatusOr<EplbPlan> plan = PlanEplb(Problem());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu_, 0), UnorderedElementsAre(3, 0, 2));
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu_, 1), UnorderedElementsAre(0, 0, 1));
  EXPECT_NEAR(plan->layers[0].balancedness_after, 0.96, 1e-12);
  EXPECT_TRUE(plan->layers[0].changed);
  EXPECT_EQ(plan->moved_experts, 0);
  EXPECT_FALSE(plan->hierarchical);
}

TEST_F(SmallPlanTest, SlotPreservationKeepsExpertsInPlace) {
  // Current: GPU 0 = {0, 1, 2}, GPU 1 = {3, 0, 0}. Both packs overlap both GPUs by 2, so pack A
  // {2, 3, 0} goes to GPU 0 (lower index) and B {0, 1, 0} to GPU 1 (loads 8.33 and 7.67). The
  // swap pass then trades 3 (new on GPU 0) for a 0 on GPU 1, which holds 3: loads 7.67 and 8.33,
  // one new pair fewer. Expert 1 (new on GPU 1) finds no swap that helps. Slots: GPU 0 keeps 0
  // (slot 0) and 2 (slot 2), its second 0 takes slot 1; GPU 1 keeps 3 and 0 (slots 3, 4), 1 takes
  // slot 5.
  const std::vector<int32_t> current = {0, 1, 2, 3, 0, 0};
  EplbProblem p = Problem();
  p.current = current;
  absl::StatusOr<EplbPlan> plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->physical_to_logical, ElementsAre(0, 0, 2, 3, 0, 1));
  // Before: 0 has 3 replicas (3.33 each), 1 2 3 one each: GPU 0 = 5.33, GPU 1 = 10.67.
  EXPECT_NEAR(plan->layers[0].balancedness_before, 8.0 / (4 + 20.0 / 3), 1e-12);
  EXPECT_NEAR(plan->layers[0].balancedness_after, 0.96, 1e-12);
  EXPECT_EQ(plan->layers[0].moved_experts, 1);
  EXPECT_EQ(plan->moved_experts, 1);
  EXPECT_EQ(plan->bytes_to_move, 1000);
}

TEST_F(SmallPlanTest, MinimumGainSkipsTheLayer) {
  const std::vector<int32_t> current = {0, 1, 2, 3, 0, 0};
  EplbProblem p = Problem();
  p.current = current;
  p.min_gain = 0.3;  // the gain is 0.96 - 0.75 = 0.21
  absl::StatusOr<EplbPlan> plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->physical_to_logical, ElementsAre(0, 1, 2, 3, 0, 0));
  EXPECT_FALSE(plan->layers[0].changed);
  EXPECT_NEAR(plan->layers[0].balancedness_after, 0.75, 1e-12);
  EXPECT_EQ(plan->moved_experts, 0);
  EXPECT_EQ(plan->bytes_to_move, 0);
}

TEST_F(SmallPlanTest, ReplanningTheOutputMovesNothing) {
  absl::StatusOr<EplbPlan> first = PlanEplb(Problem());
  ASSERT_TRUE(first.ok());
  EplbProblem p = Problem();
  p.current = first->physical_to_logical;
  absl::StatusOr<EplbPlan> again = PlanEplb(p);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->physical_to_logical, first->physical_to_logical);
  EXPECT_FALSE(again->layers[0].changed);
}

TEST_F(SmallPlanTest, VacantSlotsStayVacantAndLayoutChangeReplans) {
  // Slot 5's shard is gone: GPU 0 keeps 3 slots, GPU 1 has 2. Replicas: expert 0 gets one more,
  // weights 5 1 1 4 5 (experts 0 1 2 3 0). DeepSeek's packing into capacities 3 and 2: 5 -> A;
  // 5 -> B; 4 -> A (tie); 1 -> B (5 < 9, now full); 1 -> A: A = {0, 2, 3} = 10, B = {1, 0} = 6,
  // 8 / 10. The swap pass trades 3 (new on GPU 0) for 1 (new on GPU 1): GPU 0 = {0, 2, 1} = 7,
  // GPU 1 = {3, 0} = 9, both within 10: nothing moves and 8 / 9 is better than DeepSeek's plan.
  const std::vector<int32_t> gpu = {0, 0, 0, 1, 1, -1};
  const std::vector<int32_t> current = {0, 1, 2, 3, 0, 0};
  EplbProblem p = Problem();
  p.slot_to_gpu = gpu;
  p.current = current;
  p.current_slot_to_gpu = gpu_;
  p.min_gain = 10;  // ignored: the layout changed
  absl::StatusOr<EplbPlan> plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->physical_to_logical, ElementsAre(0, 1, 2, 3, 0, -1));
  EXPECT_TRUE(plan->layers[0].changed);
  EXPECT_NEAR(plan->layers[0].balancedness_after, 8.0 / 9.0, 1e-12);
  EXPECT_EQ(plan->moved_experts, 0);
}

TEST_F(SmallPlanTest, VacantSlotWithoutCurrentPlacement) {
  // The same layout planned from scratch: DeepSeek's packing as worked out above.
  const std::vector<int32_t> gpu = {0, 0, 0, 1, 1, -1};
  EplbProblem p = Problem();
  p.slot_to_gpu = gpu;
  absl::StatusOr<EplbPlan> plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->physical_to_logical[5], -1);
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu, 0), UnorderedElementsAre(0, 3, 2));
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu, 1), UnorderedElementsAre(0, 1));
  EXPECT_NEAR(plan->layers[0].balancedness_after, 0.8, 1e-12);
}

TEST(HierarchicalPlanTest, GroupsPackedOntoNodes) {
  // Groups {0, 1} (weight 11) and {2, 3} (weight 5) go to nodes 0 and 1. Node 0 (one GPU, 3 slots)
  // replicates expert 0: {0, 1, 0} = 11; node 1 replicates expert 3: {2, 3, 3} = 5.
  const std::vector<double> load = {10, 1, 1, 4};
  const std::vector<int32_t> gpu = {0, 0, 0, 1, 1, 1};
  EplbProblem p;
  p.num_layers = 1;
  p.num_logical = 4;
  p.load = load;
  p.slot_to_gpu = gpu;
  p.num_gpus = 2;
  p.num_nodes = 2;
  p.num_groups = 2;
  absl::StatusOr<EplbPlan> plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->hierarchical);
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu, 0), UnorderedElementsAre(0, 1, 0));
  EXPECT_THAT(ExpertsOn(plan->physical_to_logical, gpu, 1), UnorderedElementsAre(2, 3, 3));
  EXPECT_NEAR(plan->layers[0].balancedness_after, 8.0 / 11.0, 1e-12);
  // 3 groups do not divide over 2 nodes: the global policy runs.
  p.num_groups = 1;
  plan = PlanEplb(p);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->hierarchical);
}

TEST(PlanEplbTest, RejectsBadInput) {
  const std::vector<double> load = {1, 1};
  const std::vector<double> negative = {1, -1};
  const std::vector<int32_t> gpu = {0, 1};
  const std::vector<int32_t> gpu_out_of_range = {0, 2};
  const std::vector<int32_t> gpu_idle = {0, 0};
  const std::vector<int32_t> too_few = {0, -1};
  const std::vector<int32_t> bad_current = {0, 5};
  struct Case {
    absl::Span<const double> load;
    absl::Span<const int32_t> gpu;
    absl::Span<const int32_t> current;
  } cases[] = {{negative, gpu, {}}, {load, gpu_out_of_range, {}}, {load, gpu_idle, {}},
               {load, too_few, {}}, {load, gpu, bad_current},     {{}, gpu, {}}};
  for (const Case& c : cases) {
    EplbProblem p;
    p.num_layers = 1;
    p.num_logical = 2;
    p.load = c.load;
    p.slot_to_gpu = c.gpu;
    p.current = c.current;
    p.num_gpus = 2;
    EXPECT_EQ(PlanEplb(p).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// ---- Quality against a plain DeepSeek implementation ----

double Mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

class QualityTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 61, kExperts = 256, kGpus = 32, kSlots = 288;
  void SetUp() override {
    load_ = ZipfLoadTrace(kLayers, kExperts, 1.2, 100000, /*seed=*/2024);
    gpu_ = RankMajor(kSlots, kGpus);
    plain_ = PlainDeepSeekBalancedness(load_, kLayers, kExperts, kSlots, kGpus);
  }
  EplbProblem Problem() const {
    EplbProblem p;
    p.num_layers = kLayers;
    p.num_logical = kExperts;
    p.load = load_;
    p.slot_to_gpu = gpu_;
    p.num_gpus = kGpus;
    return p;
  }
  std::vector<double> load_;
  std::vector<int32_t> gpu_;
  std::vector<double> plain_;
};

TEST_F(QualityTest, ZipfTraceMeetsTargetAndNeverLosesToPlainDeepSeek) {
  // Starting from the coordinator's initial placement (experts in order, the 32 extra slots
  // spread over the ids), as a first rebalance does.
  std::vector<int32_t> initial;
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kSlots; ++s) {
      initial.push_back(s < kExperts ? s : (s - kExperts) * kExperts / (kSlots - kExperts));
    }
  }
  for (const bool with_current : {false, true}) {
    EplbProblem p = Problem();
    if (with_current) p.current = initial;
    absl::StatusOr<EplbPlan> plan = PlanEplb(p);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<double> ours;
    for (int l = 0; l < kLayers; ++l) {
      ours.push_back(plan->layers[l].balancedness_after);
      EXPECT_GE(ours[l], plain_[l] - 1e-12) << "layer " << l << " with_current " << with_current;
    }
    EXPECT_GE(Mean(ours), 0.90);
    EXPECT_GE(Mean(ours), Mean(plain_) - 1e-12);
    RecordProperty(with_current ? "mean_balancedness_from_initial" : "mean_balancedness",
                   std::to_string(Mean(ours)));
  }
  EXPECT_GE(Mean(plain_), 0.90);  // the trace is one the reference algorithm handles too
}

TEST_F(QualityTest, SlotPreservationOnTheNextWindow) {
  absl::StatusOr<EplbPlan> first = PlanEplb(Problem());
  ASSERT_TRUE(first.ok());
  // The next window: the same popularity, each count off by up to +-3% (a fixed pseudo-random
  // pattern).
  std::vector<double> next = load_;
  for (size_t i = 0; i < next.size(); ++i) {
    next[i] = std::round(next[i] * (1.0 + 0.03 * (static_cast<double>(i * 7919 % 101) / 50 - 1)));
  }
  EplbProblem p = Problem();
  p.load = next;
  absl::StatusOr<EplbPlan> fresh = PlanEplb(p);  // no current placement: no preservation
  p.current = first->physical_to_logical;
  absl::StatusOr<EplbPlan> preserved = PlanEplb(p);
  ASSERT_TRUE(fresh.ok() && preserved.ok());
  int64_t kept_fresh = 0, kept_preserved = 0;
  for (size_t s = 0; s < first->physical_to_logical.size(); ++s) {
    kept_fresh += fresh->physical_to_logical[s] == first->physical_to_logical[s] ? 1 : 0;
    kept_preserved += preserved->physical_to_logical[s] == first->physical_to_logical[s] ? 1 : 0;
  }
  RecordProperty("slots_kept_fresh", std::to_string(kept_fresh));
  RecordProperty("slots_kept_preserved", std::to_string(kept_preserved));
  RecordProperty("experts_moved_preserved", std::to_string(preserved->moved_experts));
  // Preservation relabels packs and swaps replicas only where no GPU gets heavier, so a re-placed
  // layer balances at least as well as the fresh plan; a layer whose gain is too small keeps its
  // slots (and was already at least as good).
  for (int l = 0; l < kLayers; ++l) {
    if (preserved->layers[l].changed) {
      EXPECT_GE(preserved->layers[l].balancedness_after,
                fresh->layers[l].balancedness_after - 1e-12)
          << "layer " << l;
    } else {
      EXPECT_GE(preserved->layers[l].balancedness_before, fresh->layers[l].balancedness_after)
          << "layer " << l;
    }
  }
  EXPECT_GT(kept_preserved, 4 * kept_fresh);
  EXPECT_GT(kept_preserved, static_cast<int64_t>(first->physical_to_logical.size()) * 8 / 10);
  // With a 1% threshold the layers that gain little keep their placement: fewer copies.
  p.min_gain = 0.01;
  absl::StatusOr<EplbPlan> thresholded = PlanEplb(p);
  ASSERT_TRUE(thresholded.ok());
  int changed_layers = 0;
  for (const EplbLayerPlan& lp : thresholded->layers) changed_layers += lp.changed ? 1 : 0;
  std::cout << "slots kept: fresh " << kept_fresh << ", preserved " << kept_preserved << " of "
            << first->physical_to_logical.size() << "; experts moved " << preserved->moved_experts
            << "; with min_gain 0.01: " << changed_layers << " layers re-placed, "
            << thresholded->moved_experts << " experts moved\n";
  EXPECT_LT(changed_layers, kLayers);
  EXPECT_LT(thresholded->moved_experts, preserved->moved_experts);
}

}  // namespace
}  // namespace moe
