// config.json parsing for gpt-oss MXFP4 and ModelOpt NVFP4 (DeepSeek and Qwen styles), the
// moe_serve overrides, rejected configs and the fingerprint.
#include "server/model/model_config.h"

#include <cstdio>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/model/test_util.h"

namespace moe::model {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// The MoE keys of gpt-oss-20b's published config.json.
const Json kGptOss = Json::parse(R"({
  "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
  "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
  "experts_per_token": 4, "num_experts_per_tok": 4, "num_hidden_layers": 24,
  "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
  "quantization_config": {"quant_method": "mxfp4",
                          "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
})");

// The MoE keys of DeepSeek-R1's config.json (as in nvidia/DeepSeek-R1-FP4).
const Json kDeepSeek = Json::parse(R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
  "hidden_size": 7168, "moe_intermediate_size": 2048, "intermediate_size": 18432,
  "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
  "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "topk_method": "noaux_tc", "norm_topk_prob": true, "first_k_dense_replace": 3,
  "moe_layer_freq": 1, "num_hidden_layers": 61
})");

const Json kHfQuant = Json::parse(R"({
  "producer": {"name": "modelopt", "version": "0.23.0"},
  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                   "exclude_modules": ["lm_head"]}
})");

// The MoE keys of Qwen3-30B-A3B, with ModelOpt metadata inside config.json.
const Json kQwen = Json::parse(R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
  "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "norm_topk_prob": true,
  "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
})");

absl::StatusOr<ModelConfig> Parse(const Json& config, const Json* quant = nullptr) {
  const std::string quant_text = quant != nullptr ? quant->dump() : "";
  return ParseModelConfig(config.dump(), quant != nullptr
                                             ? std::optional<absl::string_view>(quant_text)
                                             : std::nullopt);
}

std::vector<int64_t> Range(int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t i = begin; i < end; ++i) out.push_back(i);
  return out;
}

TEST(ModelConfigTest, GptOss) {
  absl::StatusOr<ModelConfig> c = Parse(kGptOss);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout, CheckpointLayout::kGptOssMxfp4);
  EXPECT_EQ(c->format, WeightFormat::kMxfp4);
  EXPECT_EQ(c->gate_up, GateUpLayout::kInterleaved);
  EXPECT_EQ(c->model_type, "gpt_oss");
  EXPECT_EQ(c->num_experts, 32);
  EXPECT_EQ(c->hidden, 2880);
  EXPECT_EQ(c->intermediate, 2880);
  EXPECT_EQ(c->top_k, 4);
  EXPECT_EQ(c->num_hidden_layers, 24);
  EXPECT_EQ(c->moe_layer_ids, Range(0, 24));
  EXPECT_EQ(c->n_shared_experts, 0);
  EXPECT_EQ(c->activation.kind, ActivationKind::kSwigluOai);
  EXPECT_EQ(c->activation.limit, 7.f);
  EXPECT_EQ(c->activation.alpha, 1.702f);
  EXPECT_EQ(c->routing.method, RoutingMethod::kRenormalize);
  EXPECT_EQ(c->routing.top_k, 4);
}

TEST(ModelConfigTest, GptOssAcceptsEitherTopKKeyAndDefaultsTheLimit) {
  Json config = kGptOss;
  config.erase("num_experts_per_tok");
  config.erase("swiglu_limit");
  config["experts_per_token"] = 2;
  absl::StatusOr<ModelConfig> c = Parse(config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->activation.limit, 7.f);
  config["swiglu_limit"] = 5.5;
  EXPECT_EQ(Parse(config)->activation.limit, 5.5f);
}

TEST(ModelConfigTest, DeepSeekNvfp4) {
  absl::StatusOr<ModelConfig> c = Parse(kDeepSeek, &kHfQuant);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout, CheckpointLayout::kModelOptNvfp4);
  EXPECT_EQ(c->format, WeightFormat::kNvfp4);
  EXPECT_EQ(c->gate_up, GateUpLayout::kConcatenated);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->hidden, 7168);
  EXPECT_EQ(c->intermediate, 2048);  // moe_intermediate_size, not the dense intermediate_size
  EXPECT_EQ(c->top_k, 8);
  EXPECT_EQ(c->n_shared_experts, 1);
  EXPECT_EQ(c->num_hidden_layers, 61);
  EXPECT_EQ(c->moe_layer_ids, Range(3, 61));  // the first three layers are dense
  EXPECT_EQ(c->num_moe_layers(), 58);
  EXPECT_EQ(c->activation.kind, ActivationKind::kSilu);
  EXPECT_EQ(c->routing.method, RoutingMethod::kDeepSeekV3);
  EXPECT_EQ(c->routing.top_k, 8);
  EXPECT_EQ(c->routing.n_group, 8);
  EXPECT_EQ(c->routing.topk_group, 4);
  EXPECT_EQ(c->routing.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(c->routing.renormalize);
}

TEST(ModelConfigTest, QwenNvfp4FromConfigQuantizationBlock) {
  absl::StatusOr<ModelConfig> c = Parse(kQwen);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout, CheckpointLayout::kModelOptNvfp4);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->intermediate, 768);
  EXPECT_EQ(c->moe_layer_ids, Range(0, 48));
  EXPECT_EQ(c->routing.method, RoutingMethod::kRenormalize);
  EXPECT_EQ(c->n_shared_experts, 0);

  Json config = kQwen;
  config["norm_topk_prob"] = false;
  EXPECT_EQ(Parse(config)->routing.method, RoutingMethod::kDefault);
  config["hidden_act"] = "gelu_pytorch_tanh";
  EXPECT_EQ(Parse(config)->activation.kind, ActivationKind::kGeluTanh);
}

TEST(ModelConfigTest, DenseLayersAreSkipped) {
  Json config = kQwen;
  config["num_hidden_layers"] = 6;
  config["mlp_only_layers"] = {0, 4};
  EXPECT_EQ(Parse(config)->moe_layer_ids, (std::vector<int64_t>{1, 2, 3, 5}));
  config["mlp_only_layers"] = Json::array();
  config["decoder_sparse_step"] = 2;  // layer l is sparse when (l + 1) % 2 == 0
  EXPECT_EQ(Parse(config)->moe_layer_ids, (std::vector<int64_t>{1, 3, 5}));
  Json deepseek = kDeepSeek;
  deepseek["num_hidden_layers"] = 6;
  deepseek["first_k_dense_replace"] = 1;
  deepseek["moe_layer_freq"] = 2;  // and l % 2 == 0
  EXPECT_EQ(Parse(deepseek, &kHfQuant)->moe_layer_ids, (std::vector<int64_t>{2, 4}));
}

TEST(ModelConfigTest, MoeServeOverrides) {
  Json config = kGptOss;
  config["moe_serve"] = {{"activation", "gelu"}, {"routing", "sigmoid"}};
  absl::StatusOr<ModelConfig> c = Parse(config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->activation.kind, ActivationKind::kGelu);
  EXPECT_EQ(c->routing.method, RoutingMethod::kSigmoid);
  config["moe_serve"] = {{"activation", "situ"}, {"situ_beta", 2.0}, {"situ_linear_beta", 0.5}};
  c = Parse(config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->activation.kind, ActivationKind::kSitu);
  EXPECT_EQ(c->activation.beta, 2.f);
  EXPECT_EQ(c->activation.linear_beta, 0.5f);
}

struct BadCase {
  const char* label;
  std::function<void(Json&)> edit;
  bool nvfp4;       // start from DeepSeek + hf_quant_config instead of gpt-oss
  const char* key;  // the error must name this
};

std::vector<BadCase> BadCases() {
  return {
      {"no quantization", [](Json& j) { j.erase("quantization_config"); }, false, "quant_method"},
      {"quant method", [](Json& j) { j["quantization_config"]["quant_method"] = "awq"; }, false,
       "quant_method"},
      {"missing experts", [](Json& j) { j.erase("num_local_experts"); }, false,
       "num_local_experts is missing"},
      {"missing top-k",
       [](Json& j) {
         j.erase("num_experts_per_tok");
         j.erase("experts_per_token");
       },
       false, "num_experts_per_tok or experts_per_token is missing"},
      {"hidden string", [](Json& j) { j["hidden_size"] = "2880"; }, false, "hidden_size"},
      {"hidden float", [](Json& j) { j["hidden_size"] = 2880.5; }, false, "hidden_size"},
      {"hidden not /32", [](Json& j) { j["hidden_size"] = 2896; }, false,
       "hidden_size 2896 is not a multiple of 32"},
      {"intermediate not /32", [](Json& j) { j["intermediate_size"] = 100; }, false,
       "intermediate_size"},
      {"hidden huge", [](Json& j) { j["hidden_size"] = int64_t{1} << 40; }, false, "hidden_size"},
      {"top-k zero", [](Json& j) { j["num_experts_per_tok"] = 0; }, false, "num_experts_per_tok"},
      {"top-k above E", [](Json& j) { j["num_experts_per_tok"] = 33; }, false,
       "num_experts_per_tok"},
      {"negative layers", [](Json& j) { j["num_hidden_layers"] = -1; }, false, "num_hidden_layers"},
      {"limit negative", [](Json& j) { j["swiglu_limit"] = -1.0; }, false, "swiglu_limit"},
      {"limit string", [](Json& j) { j["swiglu_limit"] = "7"; }, false, "swiglu_limit"},
      {"override unknown activation",
       [](Json& j) {
         j["moe_serve"] = {{"activation", "relu"}};
       },
       false, "activation"},
      {"override unknown key",
       [](Json& j) {
         j["moe_serve"] = {{"colour", "red"}};
       },
       false, "colour"},
      {"override not object", [](Json& j) { j["moe_serve"] = 3; }, false, "moe_serve"},
      {"override bad situ",
       [](Json& j) {
         j["moe_serve"] = {{"activation", "situ"}, {"situ_beta", 0}};
       },
       false, "activation"},
      {"override bad routing",
       [](Json& j) {
         j["moe_serve"] = {{"routing", "random"}};
       },
       false, "routing"},
      {"nvfp4 missing intermediate", [](Json& j) { j.erase("moe_intermediate_size"); }, true,
       "moe_intermediate_size is missing"},
      {"nvfp4 missing experts", [](Json& j) { j.erase("n_routed_experts"); }, true,
       "n_routed_experts or num_experts"},
      {"nvfp4 hidden not /16", [](Json& j) { j["hidden_size"] = 7176; }, true, "hidden_size"},
      {"nvfp4 groups do not divide", [](Json& j) { j["n_group"] = 7; }, true, "n_group"},
      {"nvfp4 topk_group above n_group", [](Json& j) { j["topk_group"] = 9; }, true, "topk_group"},
      {"nvfp4 groups too narrow",
       [](Json& j) {
         j["n_group"] = 64;
         j["topk_group"] = 1;
       },
       true, "topk_group"},
      {"nvfp4 scoring", [](Json& j) { j["scoring_func"] = "tanh"; }, true, "scoring_func"},
      {"nvfp4 hidden_act", [](Json& j) { j["hidden_act"] = "relu"; }, true, "hidden_act"},
      {"nvfp4 all dense", [](Json& j) { j["first_k_dense_replace"] = 61; }, true, "no MoE layer"},
      {"nvfp4 mlp_only_layers", [](Json& j) { j["mlp_only_layers"] = "x"; }, true,
       "mlp_only_layers"},
      {"nvfp4 norm_topk_prob", [](Json& j) { j["norm_topk_prob"] = 1; }, true, "norm_topk_prob"},
  };
}

TEST(ModelConfigTest, BadConfigsNameTheKey) {
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.label);
    Json config = c.nvfp4 ? kDeepSeek : kGptOss;
    c.edit(config);
    absl::StatusOr<ModelConfig> parsed = Parse(config, c.nvfp4 ? &kHfQuant : nullptr);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.key));
  }
}

TEST(ModelConfigTest, BadQuantConfigs) {
  const struct {
    const char* label;
    std::string quant;
    const char* key;
  } cases[] = {
      {"fp8", R"({"quantization": {"quant_algo": "FP8"}})", "quant_algo 'FP8'"},
      {"group 32", R"({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})",
       "group_size 32"},
      {"no algo", R"({"quantization": {"group_size": 16}})", "quant_algo is missing"},
      {"not json", "{", "hf_quant_config.json"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(kDeepSeek.dump(), c.quant);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.key));
  }
  EXPECT_THAT(ParseModelConfig("{not json", std::nullopt).status().message(),
              HasSubstr("config.json"));
}

// FNV-1a 64 written out from its definition (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
std::string ReferenceFnv(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

TEST(ModelConfigTest, FingerprintIsStableAndSensitive) {
  const ModelConfig base = *Parse(kGptOss);
  const std::string fingerprint = base.Fingerprint();
  EXPECT_EQ(fingerprint, "gpt-oss-mxfp4-" + ReferenceFnv(base.CanonicalString()));

  // Key order, whitespace and fields that do not change the experts leave it alone.
  Json same = kGptOss;
  same["torch_dtype"] = "float32";
  same["model_type"] = "renamed";
  same["rope_theta"] = 150000;
  const std::string pretty = same.dump(4);
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(pretty, std::nullopt);
  ASSERT_TRUE(reparsed.ok());
  EXPECT_EQ(reparsed->Fingerprint(), fingerprint);

  const std::vector<std::function<void(Json&)>> changes = {
      [](Json& j) { j["num_local_experts"] = 64; },
      [](Json& j) { j["hidden_size"] = 2848; },
      [](Json& j) { j["intermediate_size"] = 2848; },
      [](Json& j) { j["num_experts_per_tok"] = 2; },
      [](Json& j) { j["num_hidden_layers"] = 23; },
      [](Json& j) { j["swiglu_limit"] = 6.0; },
      [](Json& j) {
        j["moe_serve"] = {{"activation", "silu"}};
      },
      [](Json& j) {
        j["moe_serve"] = {{"routing", "default"}};
      },
  };
  std::set<std::string> seen = {fingerprint};
  for (size_t k = 0; k < changes.size(); ++k) {
    Json changed = kGptOss;
    changes[k](changed);
    absl::StatusOr<ModelConfig> c = Parse(changed);
    ASSERT_TRUE(c.ok()) << k << ": " << c.status();
    EXPECT_TRUE(seen.insert(c->Fingerprint()).second) << "change " << k << " kept the fingerprint";
  }
  const ModelConfig deepseek = *Parse(kDeepSeek, &kHfQuant);
  EXPECT_EQ(deepseek.Fingerprint().rfind("modelopt-nvfp4-", 0), 0u);
  Json deepseek_changed = kDeepSeek;
  deepseek_changed["routed_scaling_factor"] = 2.0;
  EXPECT_NE(Parse(deepseek_changed, &kHfQuant)->Fingerprint(), deepseek.Fingerprint());
}

TEST(ModelConfigTest, LoadFromDirectory) {
  const std::string dir = testing::FreshDir("config_dir");
  testing::WriteFile(dir + "/config.json", kDeepSeek.dump());
  EXPECT_EQ(LoadModelConfig(dir).status().code(), absl::StatusCode::kInvalidArgument);
  testing::WriteFile(dir + "/hf_quant_config.json", kHfQuant.dump());
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(LoadModelConfig(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::model
