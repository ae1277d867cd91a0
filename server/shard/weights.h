// The seam between the shard service and the model on disk: a WeightSource loads, for one
// placement, the ExpertLayer of every MoE layer holding exactly the hosted slots' experts.
//
// Thread-safety: Load may be called from a control thread while LoadedWeights of an earlier
// placement are read by the executor; LoadedWeights are immutable and shared by shared_ptr, so a
// placement switch never frees weights under a running batch.
#ifndef MOE_SERVER_SHARD_WEIGHTS_H_
#define MOE_SERVER_SHARD_WEIGHTS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/experts.h"
#include "server/shard/placement.h"
#include "server/shard/request.h"

namespace moe {

class LoadedWeights {
 public:
  virtual ~LoadedWeights() = default;
  // REQUIRES: 0 <= l < num_layers of the placement it was loaded for.
  virtual const ExpertLayer& layer(int l) const = 0;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ServedModel& model() const = 0;
  // Loads the experts of `placement`'s hosted slots for every layer (validated).
  virtual absl::StatusOr<std::shared_ptr<const LoadedWeights>> Load(
      const ShardPlacement& placement) = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_WEIGHTS_H_
