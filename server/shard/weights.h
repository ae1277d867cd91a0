// The seam between the shard service and the model on disk: a WeightSource loads one MoE layer's
// experts for a list of local slots (every expert as one unit: packed values, block scales,
// global scales, biases).
//
// Thread-safety: LoadLayer may be called from a control thread while layers loaded earlier are
// read by the executor; a loaded layer is immutable and shared by shared_ptr, so snapshots of
// several map versions can share an unchanged layer and a placement switch never frees weights
// under a running batch.
#ifndef MOE_SERVER_SHARD_WEIGHTS_H_
#define MOE_SERVER_SHARD_WEIGHTS_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/experts.h"
#include "server/shard/request.h"

namespace moe {

// One loaded MoE layer; the pointer also keeps the memory its views point into alive.
using LayerWeights = std::shared_ptr<const ExpertLayer>;

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ServedModel& model() const = 0;
  // MoE layer `layer` with local slot j holding logical expert local_to_logical[j] (validated).
  virtual absl::StatusOr<LayerWeights> LoadLayer(int layer,
                                                 absl::Span<const int32_t> local_to_logical) = 0;
};

// Bytes of one expert's weights as they move between shards: packed values and block scales of
// both matrices, their global scales, and the biases.
int64_t ExpertWeightBytes(const ExpertWeights& expert);

}  // namespace moe

#endif  // MOE_SERVER_SHARD_WEIGHTS_H_
