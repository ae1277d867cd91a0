#include "server/shard/model_source.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {

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

absl::StatusOr<LayerWeights> ModelWeightSource::LoadLayer(
    int layer, absl::Span<const int32_t> local_to_logical) {
  absl::StatusOr<std::unique_ptr<model::LoadedLayer>> loaded =
      model_->LoadLayer(layer, local_to_logical);
  if (!loaded.ok()) return loaded.status();
  // Aliasing constructor: the ExpertLayer view shares ownership of the LoadedLayer holding its
  // memory.
  std::shared_ptr<const model::LoadedLayer> owner = *std::move(loaded);
  return LayerWeights(owner, &owner->layer());
}

absl::StatusOr<int64_t> ModelWeightSource::ExpertBytes() {
  const int32_t first = 0;
  absl::StatusOr<LayerWeights> layer = LoadLayer(0, absl::MakeConstSpan(&first, 1));
  if (!layer.ok()) return layer.status();
  return ExpertWeightBytes((*layer)->experts[0]);
}

}  // namespace moe
