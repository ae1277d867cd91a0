#include "server/shard/placement.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {

void ShardPlacement::SetHosted(std::vector<int32_t> slots) {
  hosted_slots_ = std::move(slots);
  expert_map_.assign(num_physical_, -1);
  hosted_ = std::make_unique<bool[]>(num_physical_);
  for (int32_t p = 0; p < num_physical_; ++p) hosted_[p] = false;
  for (size_t j = 0; j < hosted_slots_.size(); ++j) {
    expert_map_[hosted_slots_[j]] = static_cast<int32_t>(j);
    hosted_[hosted_slots_[j]] = true;
  }
}

absl::StatusOr<std::shared_ptr<const ShardPlacement>> ShardPlacement::FromClusterMap(
    const v1::ClusterMap& map, uint32_t rank) {
  const int32_t num_physical = static_cast<int32_t>(map.num_physical());
  const int32_t num_logical = static_cast<int32_t>(map.model().num_experts());
  if (map.slot_to_rank_size() != num_physical) {
    return absl::InvalidArgumentError(absl::StrCat("cluster map: slot_to_rank has ",
                                                   map.slot_to_rank_size(), " entries, expected ",
                                                   num_physical));
  }
  if (map.layers_size() != static_cast<int>(map.model().num_layers())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster map: ", map.layers_size(), " layers, model has ", map.model().num_layers()));
  }
  std::shared_ptr<ShardPlacement> p(new ShardPlacement());
  p->version_ = map.version();
  p->num_physical_ = num_physical;
  for (int l = 0; l < map.layers_size(); ++l) {
    const auto& p2l = map.layers(l).physical_to_logical();
    if (p2l.size() != num_physical) {
      return absl::InvalidArgumentError(absl::StrCat("cluster map: layer ", l, " has ", p2l.size(),
                                                     " slots, expected ", num_physical));
    }
    absl::StatusOr<LayerPlacement> lp =
        LayerPlacement::Create(absl::MakeConstSpan(p2l.data(), p2l.size()), num_logical);
    if (!lp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cluster map layer ", l, ": ", lp.status().message()));
    }
    p->layers_.push_back(*std::move(lp));
  }
  std::vector<int32_t> slots;
  for (int32_t s = 0; s < num_physical; ++s) {
    if (map.slot_to_rank(s) != rank) continue;
    // A slot vacant in every layer (its shard was removed) holds nothing to load.
    bool vacant = true;
    for (const LayerPlacement& layer : p->layers_) {
      vacant = vacant && layer.physical_to_logical()[s] < 0;
    }
    if (!vacant) slots.push_back(s);
  }
  p->SetHosted(std::move(slots));
  return std::shared_ptr<const ShardPlacement>(std::move(p));
}

std::shared_ptr<const ShardPlacement> ShardPlacement::Standalone(int32_t num_layers,
                                                                 int32_t num_experts,
                                                                 uint64_t version) {
  std::shared_ptr<ShardPlacement> p(new ShardPlacement());
  p->version_ = version;
  p->num_physical_ = num_experts;
  for (int32_t l = 0; l < num_layers; ++l) {
    p->layers_.push_back(LayerPlacement::Identity(num_experts));
  }
  std::vector<int32_t> slots(num_experts);
  for (int32_t s = 0; s < num_experts; ++s) slots[s] = s;
  p->SetHosted(std::move(slots));
  return p;
}

}  // namespace moe
