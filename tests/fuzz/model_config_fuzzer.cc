// Fuzz target model_config: ParseModelConfig on config.json text, with and without
// hf_quant_config.json text. The input is the config text, optionally followed by kSeparator and
// the hf_quant_config text (so seeds stay readable JSON files). An accepted config must satisfy
// the bounds the header promises, since the loader sizes allocations from them.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "server/model/model_config.h"

namespace {

constexpr absl::string_view kSeparator = "\n#hf_quant_config.json\n";

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

void CheckConfig(const moe::model::ModelConfig& c) {
  using moe::model::kMaxExperts;
  using moe::model::kMaxLayers;
  using moe::model::kMaxModelDim;
  Expect(c.num_hidden_layers >= 1 && c.num_hidden_layers <= kMaxLayers, "layer count");
  Expect(c.num_moe_layers() <= c.num_hidden_layers, "more MoE layers than layers");
  int64_t previous = -1;
  for (int64_t id : c.moe_layer_ids) {
    Expect(id > previous && id < c.num_hidden_layers, "MoE layer ids not ascending in range");
    previous = id;
  }
  Expect(c.num_experts >= 1 && c.num_experts <= kMaxExperts, "expert count");
  Expect(c.hidden >= 1 && c.hidden <= kMaxModelDim, "hidden size");
  Expect(c.intermediate >= 1 && c.intermediate <= kMaxModelDim, "intermediate size");
  Expect(c.top_k >= 1 && c.top_k <= c.num_experts, "top_k outside [1, E]");
  Expect(c.routing.top_k == c.top_k, "routing top_k differs");
  Expect(c.n_shared_experts >= 0, "negative shared experts");
  const int64_t block = c.format == moe::WeightFormat::kMxfp4 ? moe::kMxfp4Block : moe::kNvfp4Block;
  Expect(c.hidden % block == 0 && c.intermediate % block == 0, "dimension not a block multiple");
  if (c.routing.method == moe::RoutingMethod::kDeepSeekV3) {
    Expect(c.routing.n_group >= 1 && c.num_experts % c.routing.n_group == 0,
           "n_group does not divide E");
    Expect(c.routing.topk_group >= 1 && c.routing.topk_group <= c.routing.n_group, "topk_group");
  }
  const std::string fingerprint = c.Fingerprint();
  Expect(!fingerprint.empty() && fingerprint == c.Fingerprint(), "fingerprint not stable");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  std::optional<absl::string_view> quant;
  absl::string_view config = input;
  if (const size_t at = input.find(kSeparator); at != absl::string_view::npos) {
    config = input.substr(0, at);
    quant = input.substr(at + kSeparator.size());
  }
  absl::StatusOr<moe::model::ModelConfig> parsed = moe::model::ParseModelConfig(config, quant);
  if (!parsed.ok()) {
    Expect(parsed.status().code() == absl::StatusCode::kInvalidArgument,
           "rejection with an unexpected status code");
    return 0;
  }
  CheckConfig(*parsed);
  // The same text must parse to the same model (no hidden state between calls).
  absl::StatusOr<moe::model::ModelConfig> again = moe::model::ParseModelConfig(config, quant);
  Expect(again.ok() && again->Fingerprint() == parsed->Fingerprint(), "parse not deterministic");
  return 0;
}
