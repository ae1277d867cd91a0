#include "server/shard/model_source.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

class ModelLayers final : public LoadedWeights {
 public:
  explicit ModelLayers(std::vector<std::unique_ptr<model::LoadedLayer>> layers)
      : layers_(std::move(layers)) {}
  const ExpertLayer& layer(int l) const override { return layers_[l]->layer(); }

 private:
  std::vector<std::unique_ptr<model::LoadedLayer>> layers_;
};

}  // namespace

ModelWeightSource::ModelWeightSource(std::unique_ptr<model::ExpertModel> m) : model_(std::move(m)) {
  const model::ModelConfig& c = model_->config();
  served_.fingerprint = c.Fingerprint();
  served_.num_layers = static_cast<int32_t>(c.num_moe_layers());
  served_.num_experts = static_cast<int32_t>(c.num_experts);
  served_.top_k = c.top_k;
  served_.hidden = c.hidden;
  served_.intermediate = c.intermediate;
}

absl::StatusOr<std::unique_ptr<ModelWeightSource>> ModelWeightSource::Open(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<model::ExpertModel>> m = model::ExpertModel::Open(dir);
  if (!m.ok()) return m.status();
  return std::unique_ptr<ModelWeightSource>(new ModelWeightSource(*std::move(m)));
}

absl::StatusOr<std::shared_ptr<const LoadedWeights>> ModelWeightSource::Load(
    const ShardPlacement& placement) {
  std::vector<std::unique_ptr<model::LoadedLayer>> layers;
  for (int32_t l = 0; l < placement.num_layers(); ++l) {
    std::vector<int32_t> slot_to_logical;
    for (size_t j = 0; j < placement.hosted_slots().size(); ++j) {
      slot_to_logical.push_back(placement.LogicalOfLocal(l, static_cast<int32_t>(j)));
    }
    absl::StatusOr<std::unique_ptr<model::LoadedLayer>> layer =
        model_->LoadLayer(l, slot_to_logical);
    if (!layer.ok()) return layer.status();
    layers.push_back(*std::move(layer));
  }
  return std::shared_ptr<const LoadedWeights>(std::make_shared<ModelLayers>(std::move(layers)));
}

}  // namespace moe
