// WeightSource over a checkpoint directory (server/model): loads, per layer, exactly the experts
// of the hosted slots. Thread-safety: LoadLayer may run concurrently with readers of earlier
// results.
#ifndef MOE_SERVER_SHARD_MODEL_SOURCE_H_
#define MOE_SERVER_SHARD_MODEL_SOURCE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/model/model.h"
#include "server/shard/weights.h"

namespace moe {

class ModelWeightSource final : public WeightSource {
 public:
  static absl::StatusOr<std::unique_ptr<ModelWeightSource>> Open(const std::string& dir);

  const ServedModel& model() const override { return served_; }
  const model::ExpertModel& expert_model() const { return *model_; }
  absl::StatusOr<LayerWeights> LoadLayer(int layer,
                                         absl::Span<const int32_t> local_to_logical) override;
  // ExpertWeightBytes of expert 0 of layer 0 (every routed expert has the same shape).
  absl::StatusOr<int64_t> ExpertBytes();

 private:
  explicit ModelWeightSource(std::unique_ptr<model::ExpertModel> model);

  std::unique_ptr<model::ExpertModel> model_;
  ServedModel served_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_MODEL_SOURCE_H_
