#include "server/coordinator/eplb_trace.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace moe {

std::vector<double> ZipfLoadTrace(int num_layers, int num_experts, double exponent,
                                  int64_t routes_per_layer, uint64_t seed) {
  std::vector<double> rank_weight(num_experts);
  for (int r = 0; r < num_experts; ++r) rank_weight[r] = std::pow(r + 1.0, -exponent);
  std::mt19937_64 rng(seed);
  std::discrete_distribution<int> draw_rank(rank_weight.begin(), rank_weight.end());
  std::vector<double> load(static_cast<size_t>(num_layers) * num_experts, 0.0);
  std::vector<int> expert_of_rank(num_experts);
  for (int l = 0; l < num_layers; ++l) {
    std::iota(expert_of_rank.begin(), expert_of_rank.end(), 0);
    std::shuffle(expert_of_rank.begin(), expert_of_rank.end(), rng);
    double* row = load.data() + static_cast<size_t>(l) * num_experts;
    for (int64_t i = 0; i < routes_per_layer; ++i) row[expert_of_rank[draw_rank(rng)]] += 1.0;
  }
  return load;
}

}  // namespace moe
