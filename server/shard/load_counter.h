// Expert-load counters of one shard: per (map version, layer, physical slot) routes recorded at
// staging, taken and reset by heartbeats and CollectLoad so every route is reported exactly once.
// Counts are kept per map version because during a placement switch the shard serves two
// versions, and a slot count only means something under its own version's placement.
// Thread-safe (one mutex; the critical section is a short loop over one request's routes).
#ifndef MOE_SERVER_SHARD_LOAD_COUNTER_H_
#define MOE_SERVER_SHARD_LOAD_COUNTER_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/tensor.h"
#include "server/shard/placement.h"

namespace moe {

class LoadCounter {
 public:
  // One map version's counts.
  struct Delta {
    int32_t num_layers = 0;
    int32_t num_physical = 0;
    uint64_t map_version = 0;
    std::vector<int64_t> counts;  // [num_layers * num_physical]
  };

  // Records one staged request's routes under placement.version() (numerics.md section 4:
  // t < num_unpadded, hosted slots).
  void Record(const ShardPlacement& placement, int32_t layer, const TensorView& physical_ids);

  // The counts since the previous Take, one Delta per map version that recorded any, in
  // ascending version order.
  std::vector<Delta> Take();

 private:
  absl::Mutex mu_;
  std::map<uint64_t, Delta> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_LOAD_COUNTER_H_
