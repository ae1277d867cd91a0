// What one shard hosts under one map version: per-layer EPLB placement, the hosted physical slots
// and the physical -> local slot map, built from a ClusterMap (or the identity placement of a
// standalone shard). Immutable once built: share it read-only between threads.
#ifndef MOE_SERVER_SHARD_PLACEMENT_H_
#define MOE_SERVER_SHARD_PLACEMENT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/eplb.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

class ShardPlacement {
 public:
  // The placement of shard `rank` in `map`: the slots slot_to_rank gives it, except slots vacant
  // in every layer. INVALID_ARGUMENT when the map is inconsistent (layer count, slot counts,
  // ranks), naming what is wrong.
  static absl::StatusOr<std::shared_ptr<const ShardPlacement>> FromClusterMap(
      const v1::ClusterMap& map, uint32_t rank);
  // A standalone shard: identity placement, every slot hosted, version `version`.
  static std::shared_ptr<const ShardPlacement> Standalone(int32_t num_layers, int32_t num_experts,
                                                          uint64_t version);

  uint64_t version() const { return version_; }
  int32_t num_layers() const { return static_cast<int32_t>(layers_.size()); }
  int32_t num_physical() const { return num_physical_; }
  const LayerPlacement& layer(int32_t l) const { return layers_[l]; }
  // Ascending physical slots this shard hosts; local slot j is hosted_slots()[j].
  const std::vector<int32_t>& hosted_slots() const { return hosted_slots_; }
  // [P]: local slot index of each physical slot, or -1.
  absl::Span<const int32_t> expert_map() const { return expert_map_; }
  // [P]: whether this shard hosts the slot.
  absl::Span<const bool> hosted() const {
    return absl::Span<const bool>(hosted_.get(), static_cast<size_t>(num_physical_));
  }
  // The logical expert of local slot j in layer l.
  int32_t LogicalOfLocal(int32_t l, int32_t j) const {
    return layers_[l].physical_to_logical()[hosted_slots_[j]];
  }

 private:
  ShardPlacement() = default;
  void SetHosted(std::vector<int32_t> slots);

  uint64_t version_ = 0;
  int32_t num_physical_ = 0;
  std::vector<LayerPlacement> layers_;
  std::vector<int32_t> hosted_slots_;
  std::vector<int32_t> expert_map_;
  std::unique_ptr<bool[]> hosted_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_PLACEMENT_H_
