#include "server/shard/load_counter.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;

// One layer, 4 slots; rank 0 hosts slots 0 and 1.
std::shared_ptr<const ShardPlacement> Placement(uint64_t version, std::vector<int32_t> p2l) {
  v1::ClusterMap map;
  map.set_version(version);
  map.mutable_model()->set_num_layers(1);
  map.mutable_model()->set_num_experts(3);
  map.set_num_physical(4);
  for (uint32_t r : {0, 0, 1, 1}) map.add_slot_to_rank(r);
  map.add_layers()->mutable_physical_to_logical()->Add(p2l.begin(), p2l.end());
  return ShardPlacement::FromClusterMap(map, 0).value();
}

TEST(LoadCounterTest, CountsStayWithTheirMapVersion) {
  LoadCounter counter;
  const auto v1 = Placement(1, {0, 1, 2, 0});
  const auto v2 = Placement(2, {1, 1, 2, 0});
  // physical ids I32 [T = 2, K = 2]: slot 1 twice, slot 0 once, slot 2 (not hosted) once.
  std::vector<int32_t> ids = {1, 0, 1, 2};
  const TensorView view{DType::kI32, {2, 2}, ids.data()};
  counter.Record(*v1, 0, view);
  counter.Record(*v2, 0, view);
  counter.Record(*v2, 0, view);
  std::vector<LoadCounter::Delta> deltas = counter.Take();
  ASSERT_EQ(deltas.size(), 2u);
  EXPECT_EQ(deltas[0].map_version, 1u);
  EXPECT_EQ(deltas[0].num_layers, 1);
  EXPECT_EQ(deltas[0].num_physical, 4);
  EXPECT_THAT(deltas[0].counts, ElementsAre(1, 2, 0, 0));
  EXPECT_EQ(deltas[1].map_version, 2u);
  EXPECT_THAT(deltas[1].counts, ElementsAre(2, 4, 0, 0));
  // Taken once: nothing is left.
  EXPECT_TRUE(counter.Take().empty());
}

}  // namespace
}  // namespace moe
