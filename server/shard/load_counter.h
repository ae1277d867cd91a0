// Expert-load counters of one shard: per (layer, physical slot) routes recorded at staging, taken
// and reset by heartbeats and CollectLoad so every route is reported exactly once.
// Thread-safe (one mutex; the critical section is a short loop over one request's routes).
#ifndef MOE_SERVER_SHARD_LOAD_COUNTER_H_
#define MOE_SERVER_SHARD_LOAD_COUNTER_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/tensor.h"
#include "server/shard/placement.h"

namespace moe {

class LoadCounter {
 public:
  struct Delta {
    int32_t num_layers = 0;
    int32_t num_physical = 0;
    uint64_t map_version = 0;
    std::vector<int64_t> counts;  // [num_layers * num_physical]
  };

  // Starts counting for a (new) placement. Pending counts of the previous shape are kept in the
  // next Take() only when the shape is unchanged.
  void Reset(int32_t num_layers, int32_t num_physical, uint64_t map_version);

  // Records one staged request's routes (numerics.md section 4: t < num_unpadded, hosted slots).
  void Record(const ShardPlacement& placement, int32_t layer, const TensorView& physical_ids);

  Delta Take();

 private:
  absl::Mutex mu_;
  Delta pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_LOAD_COUNTER_H_
