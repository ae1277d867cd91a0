#include "server/shard/load_counter.h"

#include "glog/logging.h"
#include "kernels/eplb.h"

namespace moe {

void LoadCounter::Record(const ShardPlacement& placement, int32_t layer,
                         const TensorView& physical_ids) {
  absl::MutexLock lock(&mu_);
  Delta& delta = pending_[placement.version()];
  if (delta.counts.empty()) {
    delta.num_layers = placement.num_layers();
    delta.num_physical = placement.num_physical();
    delta.map_version = placement.version();
    delta.counts.assign(static_cast<size_t>(delta.num_layers) * delta.num_physical, 0);
  }
  absl::Span<int64_t> row(delta.counts.data() + static_cast<size_t>(layer) * delta.num_physical,
                          delta.num_physical);
  // Staging already validated the tensor and the layer; a failure here is a programmer error.
  const absl::Status s = RecordLoad(physical_ids, physical_ids.dim(0), placement.hosted(), row);
  CHECK(s.ok()) << s;
}

std::vector<LoadCounter::Delta> LoadCounter::Take() {
  absl::MutexLock lock(&mu_);
  std::vector<Delta> out;
  for (auto& [version, delta] : pending_) out.push_back(std::move(delta));
  pending_.clear();
  return out;
}

}  // namespace moe
