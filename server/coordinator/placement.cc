#include "server/coordinator/placement.h"

#include <algorithm>

#include "glog/logging.h"

namespace moe {

std::vector<uint32_t> RankMajorSlotToRank(int num_physical, int num_shards) {
  CHECK_GE(num_physical, 1);
  CHECK_GE(num_shards, 1);
  const int per_rank = (num_physical + num_shards - 1) / num_shards;
  std::vector<uint32_t> slot_to_rank(num_physical);
  for (int p = 0; p < num_physical; ++p) slot_to_rank[p] = static_cast<uint32_t>(p / per_rank);
  return slot_to_rank;
}

bool EveryRankHostsASlot(absl::Span<const uint32_t> slot_to_rank, int num_shards) {
  std::vector<bool> hosts(num_shards, false);
  for (uint32_t rank : slot_to_rank) {
    if (rank < hosts.size()) hosts[rank] = true;
  }
  return std::all_of(hosts.begin(), hosts.end(), [](bool b) { return b; });
}

std::vector<int32_t> InitialPhysicalToLogical(int num_logical, int num_redundant) {
  CHECK_GE(num_logical, 1);
  CHECK_GE(num_redundant, 0);
  std::vector<int32_t> physical_to_logical(num_logical + num_redundant);
  for (int p = 0; p < num_logical; ++p) physical_to_logical[p] = p;
  for (int r = 0; r < num_redundant; ++r) {
    // 64-bit product: r * E can exceed int range for large expert counts.
    const int64_t spread = static_cast<int64_t>(r) * num_logical / num_redundant;
    physical_to_logical[num_logical + r] = static_cast<int32_t>(spread % num_logical);
  }
  return physical_to_logical;
}

double Balancedness(absl::Span<const int64_t> shard_load) {
  if (shard_load.empty()) return 1.0;
  int64_t max_load = 0;
  double sum = 0.0;
  for (int64_t load : shard_load) {
    max_load = std::max(max_load, load);
    sum += static_cast<double>(load);
  }
  if (max_load == 0) return 1.0;
  const double mean = sum / static_cast<double>(shard_load.size());
  return mean / static_cast<double>(max_load);
}

v1::LayerLoad SummarizeLayerLoad(uint32_t layer, absl::Span<const int64_t> slot_load,
                                 absl::Span<const int32_t> physical_to_logical,
                                 absl::Span<const uint32_t> slot_to_rank, int num_logical,
                                 int num_shards) {
  CHECK_EQ(slot_load.size(), physical_to_logical.size());
  CHECK_EQ(slot_load.size(), slot_to_rank.size());
  std::vector<int64_t> expert_load(num_logical, 0);
  std::vector<int64_t> shard_load(num_shards, 0);
  for (size_t p = 0; p < slot_load.size(); ++p) {
    expert_load[physical_to_logical[p]] += slot_load[p];
    shard_load[slot_to_rank[p]] += slot_load[p];
  }
  v1::LayerLoad out;
  out.set_layer(layer);
  out.mutable_expert_load()->Add(expert_load.begin(), expert_load.end());
  out.mutable_slot_load()->Add(slot_load.begin(), slot_load.end());
  out.mutable_shard_load()->Add(shard_load.begin(), shard_load.end());
  out.set_balancedness(Balancedness(shard_load));
  return out;
}

}  // namespace moe
