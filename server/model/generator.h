// Synthetic MoE checkpoints in the two layouts the loader reads (gpt-oss MXFP4, ModelOpt NVFP4),
// for tests, benchmarks and the demo.
//
// Weights are drawn in fp32 from N(0, 1/sqrt(fan_in)) and quantized with moe::QuantizeMatrix, so
// block scales have realistic magnitudes; NVFP4 global scales are amax / (6 * 448). gpt-oss
// checkpoints get BF16 biases and a router with a bias; ModelOpt checkpoints get a BF16 router
// (gate), and, in the DeepSeek style (n_group > 0), an F32 e_score_correction_bias, plus optional
// shared experts. The output is a deterministic function of the options (the random stream is
// std::mt19937_64 with a fixed normal transform, both fully specified by the C++ standard).
//
// Callers: tests, benchmarks, the demo launcher. Thread-safety: GenerateModel may run
// concurrently for different directories. Ownership: nothing is retained.
#ifndef MOE_SERVER_MODEL_GENERATOR_H_
#define MOE_SERVER_MODEL_GENERATOR_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/formats.h"

namespace moe::model {

struct GenerateOptions {
  WeightFormat format = WeightFormat::kMxfp4;  // kMxfp4: gpt-oss layout; kNvfp4: ModelOpt layout
  int64_t layers = 2;
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t hidden = 128;
  int64_t intermediate = 64;
  uint64_t seed = 1;
  // Number of safetensors files; more than one also writes model.safetensors.index.json.
  int64_t files = 1;
  // Empty: the layout's own activation (SWIGLUOAI for gpt-oss, hidden_act "silu" for ModelOpt);
  // otherwise an activation name recorded as the config's moe_serve.activation override.
  std::string activation;
  float swiglu_limit = 7.f;  // gpt-oss
  // ModelOpt only: shared experts (one MLP of n_shared_experts * intermediate), and DeepSeek-style
  // grouped sigmoid routing when n_group > 0 (else Qwen-style softmax top-k, renormalized).
  int64_t n_shared_experts = 0;
  int64_t n_group = 0;
  int64_t topk_group = 0;
  float routed_scaling_factor = 1.f;
};

// Writes config.json (+ hf_quant_config.json for NVFP4) and the weights into `dir` (created when
// missing), replacing the files of an earlier generated model there. INVALID_ARGUMENT for options
// the config parser would reject (with the parser's message) or files outside [1, tensor count].
[[nodiscard]] absl::Status GenerateModel(const GenerateOptions& options, const std::string& dir);

}  // namespace moe::model

#endif  // MOE_SERVER_MODEL_GENERATOR_H_
