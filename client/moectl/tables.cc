#include "client/moectl/tables.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace moe {

std::string FormatClusterMap(const v1::ClusterMap& map) {
  std::string out =
      absl::StrFormat("cluster map version %d: model %s, %d layers, %d experts, %d slots, top-%d\n",
                      map.version(), map.model().fingerprint(), map.model().num_layers(),
                      map.model().num_experts(), map.num_physical(), map.model().top_k());
  for (const v1::ShardEntry& s : map.shards()) {
    std::vector<int> slots;
    for (int p = 0; p < map.slot_to_rank_size(); ++p) {
      if (map.slot_to_rank(p) == s.rank()) slots.push_back(p);
    }
    absl::StrAppendFormat(&out, "  rank %d  %-22s %-6s slots [%s]\n", s.rank(), s.address(),
                          s.ready() ? "ready" : "LOADING", absl::StrJoin(slots, ","));
  }
  for (int l = 0; l < map.layers_size(); ++l) {
    absl::StrAppendFormat(&out, "  layer %d slot->expert: %s\n", l,
                          absl::StrJoin(map.layers(l).physical_to_logical(), " "));
  }
  return out;
}

std::string FormatLoadTable(const v1::LoadStats& stats) {
  std::string out = absl::StrFormat("expert load (map version %d, %d routes in total)\n",
                                    stats.map_version(), stats.total_routes());
  absl::StrAppendFormat(&out, "  %-5s %9s %8s  %-24s %s\n", "layer", "routes", "balance",
                        "shard loads", "hottest experts (load)");
  for (const v1::LayerLoad& l : stats.layers()) {
    const int64_t routes =
        std::accumulate(l.expert_load().begin(), l.expert_load().end(), int64_t{0});
    std::vector<int> order(l.expert_load_size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return l.expert_load(a) > l.expert_load(b); });
    std::vector<std::string> hot;
    for (size_t i = 0; i < std::min<size_t>(3, order.size()); ++i) {
      hot.push_back(absl::StrCat("e", order[i], " (", l.expert_load(order[i]), ")"));
    }
    absl::StrAppendFormat(&out, "  %-5d %9d %8.3f  %-24s %s\n", l.layer(), routes, l.balancedness(),
                          absl::StrJoin(l.shard_load(), " / "), absl::StrJoin(hot, ", "));
  }
  for (const v1::ShardLoad& s : stats.shards()) {
    absl::StrAppendFormat(&out,
                          "  shard rank %d %s: %d requests, %d tokens, %d batches (%d merged)%s\n",
                          s.rank(), s.shard_id(), s.requests(), s.tokens(), s.batches(),
                          s.merged_batches(), s.alive() ? "" : "  [NOT ALIVE]");
  }
  return out;
}

std::string FormatShardInfo(const v1::ShardInfo& i) {
  return absl::StrFormat(
      "shard %s at %s\n  backend %s on %s\n  model %s: %d layers, E=%d, top-%d, H=%d, I=%d, %s\n"
      "  map version %d, %s, hosting slots [%s]\n",
      i.shard_id(), i.address(), i.backend(), i.device(), i.model_fingerprint(), i.num_layers(),
      i.num_experts(), i.top_k(), i.hidden_size(), i.intermediate_size(), i.weight_format(),
      i.map_version(), i.ready() ? "ready" : "loading", absl::StrJoin(i.hosted_slots(), ","));
}

}  // namespace moe
