// Expert weights of a checkpoint, loaded for the slots a shard hosts.
//
// ExpertModel opens a checkpoint directory (config.json + safetensors, model_config.h) and builds,
// per MoE layer and for a given list of hosted physical slots (slot i holds logical expert
// slot_to_logical[i]), one moe::ExpertLayer ready for the expert kernels. Only the hosted experts'
// bytes are read. Weight views point straight into the mapped files where the layout allows
// (gpt-oss: each expert's slice of the fused [E, ...] tensors; ModelOpt: down_proj); owned copies
// are made where it must (ModelOpt gate_proj + up_proj concatenated into w13, BF16 biases widened
// to F32, shared experts split into experts of the routed intermediate size). Every loaded expert
// is validated (ValidateExpertLayer) and an error names the layer and the expert.
//
// Callers: the shard server's weight store (at start-up and on placement switches), the client
// and monolithic shard path (router weights), tests and benchmarks. Thread-safety: ExpertModel is
// immutable after Open; LoadLayer and LoadRouter may run concurrently. Ownership: a LoadedLayer
// owns its copies and shares ownership of the checkpoint's mappings, so its views stay valid for
// its whole life, even after the ExpertModel is gone.
#ifndef MOE_SERVER_MODEL_MODEL_H_
#define MOE_SERVER_MODEL_MODEL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/experts.h"
#include "kernels/routing.h"
#include "kernels/tensor.h"
#include "server/model/checkpoint.h"
#include "server/model/model_config.h"

namespace moe::model {

// One MoE layer's hosted experts and the memory their views point into.
class LoadedLayer {
 public:
  LoadedLayer(const LoadedLayer&) = delete;
  LoadedLayer& operator=(const LoadedLayer&) = delete;

  const ExpertLayer& layer() const { return layer_; }
  int64_t moe_layer() const { return moe_layer_; }
  const std::vector<int32_t>& slot_to_logical() const { return slot_to_logical_; }

 private:
  friend class ExpertModel;
  friend class LayerBuilder;
  LoadedLayer() = default;

  int64_t moe_layer_ = 0;
  std::vector<int32_t> slot_to_logical_;
  ExpertLayer layer_;
  std::shared_ptr<const Checkpoint> checkpoint_;  // keeps the mapped files alive
  std::deque<HostTensor> owned_;                  // a deque never moves its elements
};

// A layer's router (gate) in fp32: logits = x @ weight^T (+ bias).
struct RouterWeights {
  HostTensor weight;           // F32 [E, H]
  HostTensor bias;             // F32 [E] or empty: gpt-oss router.bias
  HostTensor correction_bias;  // F32 [E] or empty: DeepSeek e_score_correction_bias

  // The config's routing parameters with this router's bias tensors attached.
  // REQUIRES: *this outlives the returned parameters (they hold views into it).
  RoutingParams Params(const ModelConfig& config) const;
};

class ExpertModel {
 public:
  // Reads the configuration and opens the checkpoint of `dir`; tensors are not touched yet.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ExpertModel>> Open(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  int64_t num_moe_layers() const { return config_.num_moe_layers(); }

  // Builds MoE layer `moe_layer` (0 <= moe_layer < num_moe_layers(); checkpoint layer
  // config().moe_layer_ids[moe_layer]) with local slot i holding logical expert
  // slot_to_logical[i]. A logical expert may fill several slots; it is read once and the slots
  // share its weights. Shared experts (config().n_shared_experts > 0) are always loaded.
  // INVALID_ARGUMENT for a layer or expert id out of range or a tensor of the wrong dtype/shape,
  // NOT_FOUND for a missing tensor, the validator's error for bad weights; all name the layer
  // and expert.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<LoadedLayer>> LoadLayer(
      int64_t moe_layer, absl::Span<const int32_t> slot_to_logical) const;

  // The router of MoE layer `moe_layer`, converted to F32. The biases are loaded when the
  // checkpoint has them (gpt-oss router.bias; DeepSeek e_score_correction_bias).
  [[nodiscard]] absl::StatusOr<RouterWeights> LoadRouter(int64_t moe_layer) const;

 private:
  ExpertModel(ModelConfig config, std::shared_ptr<const Checkpoint> checkpoint)
      : config_(std::move(config)), checkpoint_(std::move(checkpoint)) {}

  ModelConfig config_;
  std::shared_ptr<const Checkpoint> checkpoint_;
};

}  // namespace moe::model

#endif  // MOE_SERVER_MODEL_MODEL_H_
