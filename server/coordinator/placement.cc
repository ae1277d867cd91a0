#include "server/coordinator/placement.h"

#include <algorithm>
#include <vector>

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

std::vector<int32_t> VacateRank(absl::Span<const int32_t> physical_to_logical,
                                absl::Span<const uint32_t> slot_to_rank, uint32_t rank,
                                const std::vector<bool>& serving) {
  const size_t num_physical = slot_to_rank.size();
  CHECK_GT(num_physical, 0u);
  CHECK_EQ(physical_to_logical.size() % num_physical, 0u);
  std::vector<int32_t> out(physical_to_logical.begin(), physical_to_logical.end());
  for (size_t begin = 0; begin < out.size(); begin += num_physical) {
    // Experts with a slot on a serving rank other than `rank`, in this layer.
    std::vector<int32_t> elsewhere;
    for (size_t p = 0; p < num_physical; ++p) {
      const int32_t e = out[begin + p];
      const uint32_t r = slot_to_rank[p];
      if (e >= 0 && r != rank && serving[r]) elsewhere.push_back(e);
    }
    std::sort(elsewhere.begin(), elsewhere.end());
    for (size_t p = 0; p < num_physical; ++p) {
      const int32_t e = out[begin + p];
      if (slot_to_rank[p] != rank || e < 0) continue;
      if (std::binary_search(elsewhere.begin(), elsewhere.end(), e)) out[begin + p] = -1;
    }
  }
  return out;
}

std::vector<uint32_t> BalanceSlotLayout(absl::Span<const uint32_t> slot_to_rank,
                                        const std::vector<bool>& eligible) {
  CHECK(std::find(eligible.begin(), eligible.end(), true) != eligible.end());
  std::vector<uint32_t> out(slot_to_rank.begin(), slot_to_rank.end());
  std::vector<int> count(eligible.size(), 0);
  for (uint32_t r : out) ++count[r];
  // The eligible rank with the fewest slots (ties: lower rank); with `most`, the most slots
  // (ties: higher rank).
  auto pick = [&](bool most) {
    int best = -1;
    for (int r = 0; r < static_cast<int>(eligible.size()); ++r) {
      if (!eligible[r]) continue;
      if (best < 0 || (most ? count[r] >= count[best] : count[r] < count[best])) best = r;
    }
    return best;
  };
  auto move_highest_slot = [&](uint32_t from, uint32_t to) {
    for (size_t p = out.size(); p-- > 0;) {
      if (out[p] != from) continue;
      out[p] = to;
      --count[from];
      ++count[to];
      return;
    }
  };
  for (size_t p = out.size(); p-- > 0;) {
    if (eligible[out[p]]) continue;
    const int to = pick(false);
    --count[out[p]];
    ++count[to];
    out[p] = static_cast<uint32_t>(to);
  }
  while (true) {
    const int most = pick(true), fewest = pick(false);
    if (count[most] - count[fewest] <= 1) break;
    move_highest_slot(most, fewest);
  }
  return out;
}

}  // namespace moe
