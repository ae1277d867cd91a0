#include "server/coordinator/eplb_reference.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace moe {

std::vector<double> PlainDeepSeekBalancedness(const std::vector<double>& load, int layers,
                                              int experts, int slots, int gpus) {
  std::vector<double> out;
  const int per_gpu = slots / gpus;
  for (int l = 0; l < layers; ++l) {
    const double* w = &load[static_cast<size_t>(l) * experts];
    std::vector<int> count(experts, 1);
    std::vector<int> replica_expert(experts);
    std::iota(replica_expert.begin(), replica_expert.end(), 0);
    while (static_cast<int>(replica_expert.size()) < slots) {
      int pick = 0;
      for (int e = 1; e < experts; ++e) {
        if (w[e] / count[e] > w[pick] / count[pick]) pick = e;
      }
      ++count[pick];
      replica_expert.push_back(pick);
    }
    // (-load, replica index): ascending order is descending load, equal loads in replica order.
    std::vector<std::pair<double, int>> replicas;
    for (int r = 0; r < slots; ++r) {
      replicas.push_back({-w[replica_expert[r]] / count[replica_expert[r]], r});
    }
    std::sort(replicas.begin(), replicas.end());
    std::vector<double> gpu_load(gpus, 0.0);
    std::vector<int> gpu_items(gpus, 0);
    for (const auto& [neg_weight, r] : replicas) {
      int best = -1;
      for (int g = 0; g < gpus; ++g) {
        if (gpu_items[g] == per_gpu) continue;
        if (best < 0 || gpu_load[g] < gpu_load[best]) best = g;
      }
      gpu_load[best] -= neg_weight;
      ++gpu_items[best];
    }
    const double max_load = *std::max_element(gpu_load.begin(), gpu_load.end());
    const double mean = std::accumulate(gpu_load.begin(), gpu_load.end(), 0.0) / gpus;
    out.push_back(max_load > 0 ? mean / max_load : 1.0);
  }
  return out;
}

}  // namespace moe
