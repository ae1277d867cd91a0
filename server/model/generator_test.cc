// Synthetic checkpoints: determinism, tensor inventory, sharding, realistic scales, bad options.
#include "server/model/generator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/model/checkpoint.h"
#include "server/model/model_config.h"
#include "server/model/test_util.h"

namespace moe::model {
namespace {

using ::testing::ElementsAre;
using testing::FreshDir;
using ::testing::HasSubstr;
using testing::ReadFile;

GenerateOptions Mxfp4Options() {
  GenerateOptions o;
  o.format = WeightFormat::kMxfp4;
  o.layers = 2;
  o.experts = 4;
  o.top_k = 2;
  o.hidden = 64;
  o.intermediate = 32;
  o.seed = 7;
  return o;
}

GenerateOptions Nvfp4Options() {
  GenerateOptions o = Mxfp4Options();
  o.format = WeightFormat::kNvfp4;
  o.intermediate = 48;
  o.n_shared_experts = 1;
  o.n_group = 2;
  o.topk_group = 1;
  o.routed_scaling_factor = 2.5f;
  return o;
}

std::vector<std::string> FileNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string TensorSummary(const SafetensorsTensor& t) {
  return absl::StrCat(SafetensorsDTypeName(t.dtype), ShapeString(t.shape));
}

TEST(GeneratorTest, GptOssInventoryAndConfig) {
  const std::string dir = FreshDir("gen_gptoss");
  ASSERT_TRUE(GenerateModel(Mxfp4Options(), dir).ok());
  EXPECT_THAT(FileNames(dir), ElementsAre("config.json", "model.safetensors"));
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->layout, CheckpointLayout::kGptOssMxfp4);
  EXPECT_EQ(config->num_experts, 4);
  EXPECT_EQ(config->top_k, 2);
  EXPECT_EQ(config->hidden, 64);
  EXPECT_EQ(config->intermediate, 32);
  EXPECT_EQ(config->num_moe_layers(), 2);
  EXPECT_EQ(config->activation.kind, ActivationKind::kSwigluOai);

  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  std::map<std::string, std::string> inventory;
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    inventory[name] = TensorSummary(*(*checkpoint)->Get(name));
  }
  std::map<std::string, std::string> expected;
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".mlp.");
    expected[p + "experts.gate_up_proj_blocks"] = "U8[4, 64, 2, 16]";
    expected[p + "experts.gate_up_proj_scales"] = "U8[4, 64, 2]";
    expected[p + "experts.gate_up_proj_bias"] = "BF16[4, 64]";
    expected[p + "experts.down_proj_blocks"] = "U8[4, 64, 1, 16]";
    expected[p + "experts.down_proj_scales"] = "U8[4, 64, 1]";
    expected[p + "experts.down_proj_bias"] = "BF16[4, 64]";
    expected[p + "router.weight"] = "BF16[4, 64]";
    expected[p + "router.bias"] = "BF16[4]";
  }
  EXPECT_EQ(inventory, expected);
}

TEST(GeneratorTest, ModelOptInventoryAndConfig) {
  const std::string dir = FreshDir("gen_modelopt");
  GenerateOptions options = Nvfp4Options();
  options.activation = "gelu";
  ASSERT_TRUE(GenerateModel(options, dir).ok());
  EXPECT_THAT(FileNames(dir),
              ElementsAre("config.json", "hf_quant_config.json", "model.safetensors"));
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->layout, CheckpointLayout::kModelOptNvfp4);
  EXPECT_EQ(config->n_shared_experts, 1);
  EXPECT_EQ(config->activation.kind, ActivationKind::kGelu);
  EXPECT_EQ(config->routing.method, RoutingMethod::kDeepSeekV3);
  EXPECT_EQ(config->routing.routed_scaling_factor, 2.5f);
  const nlohmann::json raw = nlohmann::json::parse(ReadFile(dir + "/config.json"));
  EXPECT_EQ(raw["moe_serve"]["activation"], "gelu");

  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  // 2 layers x (4 experts x 3 projections + 1 shared x 3 projections) x 4 tensors, + 2 router
  // tensors per layer.
  EXPECT_EQ((*checkpoint)->TensorNames().size(), 2u * (12 + 3) * 4 + 2 * 2);
  const Checkpoint& c = **checkpoint;
  const std::string e1 = "model.layers.1.mlp.experts.3.";
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "gate_proj.weight")), "U8[48, 32]");
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "up_proj.weight_scale")), "F8_E4M3[48, 4]");
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "down_proj.weight")), "U8[64, 24]");
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "down_proj.weight_scale")), "F8_E4M3[64, 3]");
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "down_proj.weight_scale_2")), "F32[]");
  EXPECT_EQ(TensorSummary(*c.Get(e1 + "down_proj.input_scale")), "F32[]");
  const std::string shared = "model.layers.0.mlp.shared_experts.";
  EXPECT_EQ(TensorSummary(*c.Get(shared + "up_proj.weight")), "U8[48, 32]");
  EXPECT_EQ(TensorSummary(*c.Get(shared + "down_proj.weight")), "U8[64, 24]");
  EXPECT_EQ(TensorSummary(*c.Get("model.layers.0.mlp.gate.weight")), "BF16[4, 64]");
  EXPECT_EQ(TensorSummary(*c.Get("model.layers.0.mlp.gate.e_score_correction_bias")), "F32[4]");
}

// Same options -> the same bytes; another seed -> other weights under the same config.
TEST(GeneratorTest, DeterministicForASeed) {
  for (const GenerateOptions& base : {Mxfp4Options(), Nvfp4Options()}) {
    const std::string a = FreshDir("det_a"), b = FreshDir("det_b"), c = FreshDir("det_c");
    GenerateOptions other = base;
    other.seed = base.seed + 1;
    ASSERT_TRUE(GenerateModel(base, a).ok());
    ASSERT_TRUE(GenerateModel(base, b).ok());
    ASSERT_TRUE(GenerateModel(other, c).ok());
    for (const std::string& name : FileNames(a)) {
      EXPECT_EQ(ReadFile(a + "/" + name), ReadFile(b + "/" + name)) << name;
    }
    EXPECT_EQ(ReadFile(a + "/config.json"), ReadFile(c + "/config.json"));
    EXPECT_NE(ReadFile(a + "/model.safetensors"), ReadFile(c + "/model.safetensors"));
  }
}

TEST(GeneratorTest, ShardedMatchesSingleFile) {
  for (const GenerateOptions& base : {Mxfp4Options(), Nvfp4Options()}) {
    const std::string single = FreshDir("single"), sharded = FreshDir("sharded");
    GenerateOptions three = base;
    three.files = 3;
    ASSERT_TRUE(GenerateModel(base, single).ok());
    ASSERT_TRUE(GenerateModel(three, sharded).ok());
    std::vector<std::string> expected_files = {"config.json"};
    if (base.format == WeightFormat::kNvfp4) expected_files.push_back("hf_quant_config.json");
    for (int f = 1; f <= 3; ++f) {
      expected_files.push_back(absl::StrFormat("model-%05d-of-00003.safetensors", f));
    }
    expected_files.push_back("model.safetensors.index.json");
    EXPECT_EQ(FileNames(sharded), expected_files);

    absl::StatusOr<std::shared_ptr<Checkpoint>> one = Checkpoint::Open(single);
    absl::StatusOr<std::shared_ptr<Checkpoint>> many = Checkpoint::Open(sharded);
    ASSERT_TRUE(one.ok() && many.ok());
    EXPECT_EQ((*one)->TensorNames(), (*many)->TensorNames());
    EXPECT_EQ((*many)->file_names().size(), 3u);
    for (const std::string& name : (*one)->TensorNames()) {
      absl::StatusOr<SafetensorsTensor> x = (*one)->Get(name), y = (*many)->Get(name);
      ASSERT_TRUE(x.ok() && y.ok()) << name;
      EXPECT_EQ(TensorSummary(*x), TensorSummary(*y));
      EXPECT_TRUE(
          std::equal(x->bytes().begin(), x->bytes().end(), y->bytes().begin(), y->bytes().end()))
          << name;
    }
    // Regenerating as one file removes the shards and the index.
    ASSERT_TRUE(GenerateModel(base, sharded).ok());
    EXPECT_EQ(FileNames(sharded), FileNames(single));
  }
}

// Weights ~ N(0, 1/sqrt(fan_in)) survive quantization with about that spread, and the NVFP4
// global scale is amax / (6 * 448), so the largest decoded magnitude is 2688 * weight_scale_2.
TEST(GeneratorTest, RealisticMagnitudes) {
  const std::string dir = FreshDir("magnitudes");
  GenerateOptions options = Nvfp4Options();
  options.hidden = 256;
  options.intermediate = 128;
  ASSERT_TRUE(GenerateModel(options, dir).ok());
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  const std::string p = "model.layers.0.mlp.experts.2.gate_proj";
  SafetensorsTensor values = *(*checkpoint)->Get(p + ".weight");
  SafetensorsTensor scales = *(*checkpoint)->Get(p + ".weight_scale");
  float global;
  std::memcpy(&global, (*checkpoint)->Get(p + ".weight_scale_2")->data, 4);
  const std::vector<float> w = testing::RefDequantNvfp4(values.data, scales.data, 128, 256, global);
  double sum_sq = 0, amax = 0;
  for (float x : w) {
    sum_sq += double{x} * x;
    amax = std::max(amax, std::fabs(double{x}));
  }
  const double stddev = std::sqrt(sum_sq / w.size());
  EXPECT_NEAR(stddev, 1.0 / 16.0, 0.1 / 16.0);  // fan_in 256
  EXPECT_NEAR(amax, 2688.0 * global, 1e-6 * amax);
}

TEST(GeneratorTest, GptOssMagnitudes) {
  const std::string dir = FreshDir("gptoss_magnitudes");
  GenerateOptions options = Mxfp4Options();
  options.hidden = 256;
  ASSERT_TRUE(GenerateModel(options, dir).ok());
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  const std::string p = "model.layers.1.mlp.experts.";
  SafetensorsTensor blocks = *(*checkpoint)->Get(p + "gate_up_proj_blocks");
  SafetensorsTensor scales = *(*checkpoint)->Get(p + "gate_up_proj_scales");
  const std::vector<float> w = testing::RefDequantMxfp4(blocks.data, scales.data, 4 * 64, 256);
  double sum_sq = 0;
  for (float x : w) sum_sq += double{x} * x;
  EXPECT_NEAR(std::sqrt(sum_sq / w.size()), 1.0 / 16.0, 0.1 / 16.0);
}

TEST(GeneratorTest, RejectsBadOptions) {
  const struct {
    const char* label;
    void (*edit)(GenerateOptions&);
    const char* message;
  } cases[] = {
      {"hidden not /32", [](GenerateOptions& o) { o.hidden = 48; }, "hidden_size"},
      {"no experts", [](GenerateOptions& o) { o.experts = 0; }, "num_local_experts"},
      {"top-k above experts", [](GenerateOptions& o) { o.top_k = 5; }, "num_experts_per_tok"},
      {"zero files", [](GenerateOptions& o) { o.files = 0; }, "files"},
      {"too many files", [](GenerateOptions& o) { o.files = 17; }, "files"},
      {"bf16", [](GenerateOptions& o) { o.format = WeightFormat::kBf16; }, "MXFP4 or NVFP4"},
      {"shared with mxfp4", [](GenerateOptions& o) { o.n_shared_experts = 1; }, "NVFP4"},
      {"bad activation", [](GenerateOptions& o) { o.activation = "relu"; }, "activation"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    GenerateOptions options = Mxfp4Options();
    c.edit(options);
    const std::string dir = FreshDir("bad_options");
    absl::Status status = GenerateModel(options, dir);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.message));
    EXPECT_TRUE(FileNames(dir).empty());  // nothing written
  }
}

}  // namespace
}  // namespace moe::model
