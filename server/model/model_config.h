// The MoE-relevant part of a model's configuration, read from a Hugging Face checkpoint
// directory (config.json, plus hf_quant_config.json for NVIDIA ModelOpt checkpoints), in the two
// layouts of shared/spec/numerics.md section 2:
//   - gpt-oss MXFP4 (config.json quantization_config.quant_method = "mxfp4"): SWIGLUOAI with
//     swiglu_limit, gate/up interleaved, softmax over the top-k logits (Renormalize) with a router
//     bias.
//   - ModelOpt NVFP4 (quant_algo "NVFP4", group_size 16; DeepSeek-V3/R1 or Qwen3-MoE keys): the
//     config's hidden_act, gate/up concatenated, DeepSeekV3 grouped sigmoid routing when
//     scoring_func is "sigmoid", else softmax top-k (renormalized unless norm_topk_prob is false).
// A "moe_serve" object in config.json (written by our generator) may override the activation
// and the routing method: {"activation": "gelu", "routing": "sigmoid", "situ_beta": 1.0,
// "situ_linear_beta": 0.0}.
//
// Callers: the model loader, the shard server (fingerprint for "wrong model" checks), the client
// (routing parameters). Thread-safety: plain values. Ownership: RoutingParams here carry no
// tensors; the router biases come from ExpertModel::LoadRouter.
#ifndef MOE_SERVER_MODEL_MODEL_CONFIG_H_
#define MOE_SERVER_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/activation.h"
#include "kernels/formats.h"
#include "kernels/routing.h"

namespace moe::model {

enum class CheckpointLayout : uint8_t {
  kGptOssMxfp4,    // fused per-layer expert tensors, MXFP4
  kModelOptNvfp4,  // per-expert gate/up/down tensors, NVFP4
};
absl::string_view CheckpointLayoutName(CheckpointLayout layout);  // "gpt-oss-mxfp4", ...

inline constexpr char kConfigFileName[] = "config.json";
inline constexpr char kHfQuantConfigFileName[] = "hf_quant_config.json";

// Sanity bounds on dimensions, far above any real model, so that products of them cannot
// overflow int64 and a typo cannot ask for petabytes.
inline constexpr int64_t kMaxModelDim = int64_t{1} << 20;  // hidden, intermediate
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;
inline constexpr int64_t kMaxLayers = int64_t{1} << 12;

struct ModelConfig {
  CheckpointLayout layout = CheckpointLayout::kGptOssMxfp4;
  WeightFormat format = WeightFormat::kMxfp4;
  GateUpLayout gate_up = GateUpLayout::kInterleaved;
  std::string model_type;  // informational ("gpt_oss", "deepseek_v3", ...)

  int64_t num_hidden_layers = 0;  // all decoder layers of the checkpoint
  // Checkpoint layer index of each MoE layer, ascending. MoE layer m (the index requests and
  // the EPLB map use) is checkpoint layer moe_layer_ids[m]; dense layers (DeepSeek's
  // first_k_dense_replace, Qwen's mlp_only_layers / decoder_sparse_step) are skipped.
  std::vector<int64_t> moe_layer_ids;
  int64_t num_experts = 0;   // E, routed experts per layer
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I, per routed expert
  int32_t top_k = 0;         // K
  // Always-on shared experts per layer (NVFP4 only). The checkpoint holds them as one MLP of
  // intermediate size n_shared_experts * I; the loader splits it into n_shared_experts experts of
  // size I, which sum to the same output.
  int64_t n_shared_experts = 0;

  ActivationParams activation;
  RoutingParams routing;  // method, top_k, groups, scaling; no tensors attached

  int64_t num_moe_layers() const { return static_cast<int64_t>(moe_layer_ids.size()); }

  // A stable hex hash (FNV-1a, independent of build and platform) of every field that changes
  // what the experts compute or how the checkpoint is read, prefixed with the layout name.
  // Two shards serving the same model agree on it; model_type does not take part.
  std::string Fingerprint() const;
  // The text that Fingerprint hashes; useful in "wrong model" error messages.
  std::string CanonicalString() const;
};

// Parses config.json text and, when present, hf_quant_config.json text. INVALID_ARGUMENT naming
// the offending key for a missing key, a value of the wrong type or out of range (H not a multiple
// of the format's block, top_k outside [1, E], groups that do not divide E, ...).
[[nodiscard]] absl::StatusOr<ModelConfig> ParseModelConfig(
    absl::string_view config_json, std::optional<absl::string_view> hf_quant_config_json);

// Reads config.json (and hf_quant_config.json when it exists) from `dir`.
[[nodiscard]] absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace moe::model

#endif  // MOE_SERVER_MODEL_MODEL_CONFIG_H_
