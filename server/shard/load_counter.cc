#include "server/shard/load_counter.h"

#include "glog/logging.h"
#include "kernels/eplb.h"

namespace moe {

void LoadCounter::Reset(int32_t num_layers, int32_t num_physical, uint64_t map_version) {
  absl::MutexLock lock(&mu_);
  if (pending_.num_layers != num_layers || pending_.num_physical != num_physical) {
    pending_.counts.assign(static_cast<size_t>(num_layers) * num_physical, 0);
  }
  pending_.num_layers = num_layers;
  pending_.num_physical = num_physical;
  pending_.map_version = map_version;
}

void LoadCounter::Record(const ShardPlacement& placement, int32_t layer,
                         const TensorView& physical_ids) {
  absl::MutexLock lock(&mu_);
  if (pending_.num_physical != placement.num_physical() || layer >= pending_.num_layers) return;
  absl::Span<int64_t> row(
      pending_.counts.data() + static_cast<size_t>(layer) * pending_.num_physical,
      pending_.num_physical);
  // Staging already validated the tensor; a failure here is a programmer error.
  const absl::Status s = RecordLoad(physical_ids, physical_ids.dim(0), placement.hosted(), row);
  CHECK(s.ok()) << s;
}

LoadCounter::Delta LoadCounter::Take() {
  absl::MutexLock lock(&mu_);
  Delta out = pending_;
  std::fill(pending_.counts.begin(), pending_.counts.end(), 0);
  return out;
}

}  // namespace moe
