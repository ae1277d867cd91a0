// config.json / hf_quant_config.json parsing for the two checkpoint layouts.
//
// Values are read through KeyReader, which remembers the first error (naming the key path) and
// hands back a harmless default, so each layout's reader is a flat list of keys rather than a
// ladder of early returns; the caller checks the reader's status once.
#include "server/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "server/model/checkpoint.h"

namespace moe::model {
namespace {

using Json = nlohmann::json;

// Config files are small; this bound only stops a wrong path from being read whole.
constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;

std::optional<int64_t> AsInt64(const Json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

class KeyReader {
 public:
  // `object` must outlive the reader; `prefix` names it in errors ("config.json", ...).
  KeyReader(const Json& object, std::string prefix) : object_(object), prefix_(std::move(prefix)) {}

  bool Has(const char* key) const { return object_.is_object() && object_.contains(key); }

  // The first of `keys` that is present; nullptr (and an error) when none is.
  const char* FirstPresent(std::initializer_list<const char*> keys) {
    for (const char* key : keys) {
      if (Has(key)) return key;
    }
    Fail(absl::StrJoin(keys, " or "), "is missing");
    return nullptr;
  }

  // An integer in [min, max]; required unless `fallback` is given.
  int64_t Int(const char* key, int64_t min, int64_t max, std::optional<int64_t> fallback = {}) {
    const Json* v = Find(key, fallback.has_value());
    if (v == nullptr) return fallback.value_or(min);
    std::optional<int64_t> value = AsInt64(*v);
    if (!value || *value < min || *value > max) {
      Fail(key, absl::StrCat("must be an integer in [", min, ", ", max, "], got ", v->dump()));
      return min;
    }
    return *value;
  }

  // A finite number; required unless `fallback` is given.
  double Number(const char* key, std::optional<double> fallback = {}) {
    const Json* v = Find(key, fallback.has_value());
    if (v == nullptr) return fallback.value_or(0.0);
    if (!v->is_number() || !std::isfinite(v->get<double>())) {
      Fail(key, "must be a finite number");
      return fallback.value_or(0.0);
    }
    return v->get<double>();
  }

  std::string String(const char* key, std::optional<std::string> fallback = {}) {
    const Json* v = Find(key, fallback.has_value());
    if (v == nullptr) return fallback.value_or("");
    if (!v->is_string()) {
      Fail(key, "must be a string");
      return "";
    }
    return v->get<std::string>();
  }

  bool Bool(const char* key, bool fallback) {
    const Json* v = Find(key, /*optional=*/true);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) {
      Fail(key, "must be true or false");
      return fallback;
    }
    return v->get<bool>();
  }

  // The key's value when present and not null.
  const Json* Optional(const char* key) { return Find(key, /*optional=*/true); }

  void Fail(absl::string_view key, absl::string_view problem) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(prefix_, ": ", key, " ", problem));
    }
  }

  const absl::Status& status() const { return status_; }

 private:
  // The key's value, or nullptr when absent (an error unless `optional`). JSON null counts as
  // absent, as Hugging Face configs write unused keys as null.
  const Json* Find(const char* key, bool optional) {
    auto it = object_.is_object() ? object_.find(key) : object_.end();
    if (it == object_.end() || it->is_null()) {
      if (!optional) Fail(key, "is missing");
      return nullptr;
    }
    return &*it;
  }

  const Json& object_;
  std::string prefix_;
  absl::Status status_;
};

absl::StatusOr<Json> ParseObject(absl::string_view text, const char* file) {
  Json json = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  return json;
}

// Hugging Face hidden_act names.
absl::StatusOr<ActivationKind> HiddenActKind(const std::string& name) {
  if (name == "silu" || name == "swish") return ActivationKind::kSilu;
  if (name == "gelu") return ActivationKind::kGelu;
  if (name == "gelu_pytorch_tanh" || name == "gelu_new" || name == "gelu_tanh") {
    return ActivationKind::kGeluTanh;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", name, "' is not supported (silu, gelu, gelu_pytorch_tanh)"));
}

void ReadGptOss(KeyReader& keys, ModelConfig& config) {
  config.layout = CheckpointLayout::kGptOssMxfp4;
  config.format = WeightFormat::kMxfp4;
  config.gate_up = GateUpLayout::kInterleaved;
  config.num_experts = keys.Int("num_local_experts", 1, kMaxExperts);
  const char* top_k_key = keys.FirstPresent({"num_experts_per_tok", "experts_per_token"});
  if (top_k_key != nullptr)
    config.top_k = static_cast<int32_t>(keys.Int(top_k_key, 1, kMaxExperts));
  config.hidden = keys.Int("hidden_size", 1, kMaxModelDim);
  config.intermediate = keys.Int("intermediate_size", 1, kMaxModelDim);
  config.num_hidden_layers = keys.Int("num_hidden_layers", 1, kMaxLayers);
  config.activation.kind = ActivationKind::kSwigluOai;
  config.activation.limit = static_cast<float>(keys.Number("swiglu_limit", 7.0));
  if (config.activation.limit <= 0.f) keys.Fail("swiglu_limit", "must be > 0");
  config.routing.method = RoutingMethod::kRenormalize;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) config.moe_layer_ids.push_back(l);
}

// DeepSeek (first_k_dense_replace, moe_layer_freq) and Qwen (mlp_only_layers,
// decoder_sparse_step) ways of saying which decoder layers have an MoE block.
void ReadMoeLayers(KeyReader& keys, ModelConfig& config) {
  const int64_t layers = config.num_hidden_layers;
  const int64_t first_dense = keys.Int("first_k_dense_replace", 0, layers, 0);
  const int64_t freq = keys.Int("moe_layer_freq", 1, kMaxLayers, 1);
  const int64_t sparse_step = keys.Int("decoder_sparse_step", 1, kMaxLayers, 1);
  std::vector<int64_t> dense;
  if (const Json* list = keys.Optional("mlp_only_layers"); list != nullptr) {
    if (!list->is_array()) return keys.Fail("mlp_only_layers", "must be a list of layer indices");
    for (const Json& v : *list) {
      std::optional<int64_t> layer = AsInt64(v);
      if (!layer) return keys.Fail("mlp_only_layers", "must hold integers");
      dense.push_back(*layer);
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    if (l < first_dense || l % freq != 0 || (l + 1) % sparse_step != 0) continue;
    if (std::find(dense.begin(), dense.end(), l) != dense.end()) continue;
    config.moe_layer_ids.push_back(l);
  }
}

void ReadModelOptRouting(KeyReader& keys, ModelConfig& config) {
  RoutingParams& routing = config.routing;
  const std::string scoring = keys.String("scoring_func", "softmax");
  routing.renormalize = keys.Bool("norm_topk_prob", true);
  if (scoring == "sigmoid") {
    routing.method = RoutingMethod::kDeepSeekV3;
    routing.n_group = static_cast<int32_t>(keys.Int("n_group", 1, kMaxExperts, 1));
    routing.topk_group = static_cast<int32_t>(keys.Int("topk_group", 1, kMaxExperts, 1));
    routing.routed_scaling_factor = static_cast<float>(keys.Number("routed_scaling_factor", 1.0));
  } else if (scoring == "softmax") {
    routing.method = routing.renormalize ? RoutingMethod::kRenormalize : RoutingMethod::kDefault;
  } else {
    keys.Fail("scoring_func", absl::StrCat("'", scoring, "' is not supported (softmax, sigmoid)"));
  }
}

void ReadModelOpt(KeyReader& keys, ModelConfig& config) {
  config.layout = CheckpointLayout::kModelOptNvfp4;
  config.format = WeightFormat::kNvfp4;
  config.gate_up = GateUpLayout::kConcatenated;
  const char* experts_key = keys.FirstPresent({"n_routed_experts", "num_experts"});
  if (experts_key != nullptr) config.num_experts = keys.Int(experts_key, 1, kMaxExperts);
  config.top_k = static_cast<int32_t>(keys.Int("num_experts_per_tok", 1, kMaxExperts));
  config.hidden = keys.Int("hidden_size", 1, kMaxModelDim);
  config.intermediate = keys.Int("moe_intermediate_size", 1, kMaxModelDim);
  config.num_hidden_layers = keys.Int("num_hidden_layers", 1, kMaxLayers);
  config.n_shared_experts = keys.Int("n_shared_experts", 0, kMaxExperts, 0);
  absl::StatusOr<ActivationKind> act = HiddenActKind(keys.String("hidden_act", "silu"));
  if (!act.ok()) keys.Fail("hidden_act", act.status().message());
  config.activation.kind = act.value_or(ActivationKind::kSilu);
  ReadModelOptRouting(keys, config);
  if (keys.status().ok()) ReadMoeLayers(keys, config);
}

// Which layout the quantization metadata describes; also checks NVFP4's group size.
absl::StatusOr<CheckpointLayout> DetectLayout(const Json& config_json,
                                              std::optional<absl::string_view> hf_quant_json) {
  const Json empty = Json::object();
  auto qc_it = config_json.find("quantization_config");
  const Json& qc = qc_it != config_json.end() && qc_it->is_object() ? *qc_it : empty;
  KeyReader qc_keys(qc, "config.json quantization_config");
  const std::string method = qc_keys.String("quant_method", "");
  if (!qc_keys.status().ok()) return qc_keys.status();
  if (method == "mxfp4") return CheckpointLayout::kGptOssMxfp4;

  Json hf_quant;
  const Json* quant = nullptr;
  std::string where;
  if (hf_quant_json.has_value()) {
    absl::StatusOr<Json> parsed = ParseObject(*hf_quant_json, kHfQuantConfigFileName);
    if (!parsed.ok()) return parsed.status();
    hf_quant = *std::move(parsed);
    auto it = hf_quant.find("quantization");
    quant = it != hf_quant.end() && it->is_object() ? &*it : &hf_quant;
    where = "hf_quant_config.json quantization";
  } else if (method == "modelopt") {
    quant = &qc;
    where = "config.json quantization_config";
  } else {
    return absl::InvalidArgumentError(
        "config.json: quantization_config.quant_method is not \"mxfp4\" and there is no "
        "hf_quant_config.json; only gpt-oss MXFP4 and ModelOpt NVFP4 checkpoints are supported");
  }
  KeyReader keys(*quant, where);
  const std::string algo = keys.String("quant_algo");
  const int64_t group = keys.Int("group_size", 1, kMaxModelDim, kNvfp4Block);
  if (!keys.status().ok()) return keys.status();
  if (algo != "NVFP4") {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": quant_algo '", algo, "' is not supported (NVFP4 only)"));
  }
  if (group != kNvfp4Block) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": group_size ", group, " is not supported (NVFP4 uses 16)"));
  }
  return CheckpointLayout::kModelOptNvfp4;
}

// The "moe_serve" object our generator writes for choices the Hugging Face config cannot hold.
absl::Status ReadOverrides(const Json& config_json, ModelConfig& config) {
  auto it = config_json.find("moe_serve");
  if (it == config_json.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object())
    return absl::InvalidArgumentError("config.json: moe_serve must be an object");
  KeyReader keys(*it, "config.json moe_serve");
  static constexpr const char* kKnown[] = {"activation", "routing", "situ_beta",
                                           "situ_linear_beta"};
  for (const auto& item : it->items()) {
    if (std::none_of(std::begin(kKnown), std::end(kKnown),
                     [&](const char* k) { return item.key() == k; })) {
      keys.Fail(item.key(), "is not one of activation, routing, situ_beta, situ_linear_beta");
    }
  }
  if (keys.Has("activation")) {
    absl::StatusOr<ActivationKind> kind = ParseActivationKind(keys.String("activation"));
    if (!kind.ok()) keys.Fail("activation", kind.status().message());
    config.activation.kind = kind.value_or(config.activation.kind);
  }
  if (keys.Has("routing")) {
    absl::StatusOr<RoutingMethod> method = ParseRoutingMethod(keys.String("routing"));
    if (!method.ok()) keys.Fail("routing", method.status().message());
    config.routing.method = method.value_or(config.routing.method);
  }
  config.activation.beta = static_cast<float>(keys.Number("situ_beta", config.activation.beta));
  config.activation.linear_beta =
      static_cast<float>(keys.Number("situ_linear_beta", config.activation.linear_beta));
  return keys.status();
}

// Cross-field checks once every key has been read.
absl::Status CheckConsistency(const ModelConfig& c) {
  const int64_t block = c.format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  const char* inter_key =
      c.layout == CheckpointLayout::kGptOssMxfp4 ? "intermediate_size" : "moe_intermediate_size";
  auto bad = [](absl::string_view key, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " ", why));
  };
  if (c.hidden % block != 0) {
    return bad("hidden_size", absl::StrCat(c.hidden, " is not a multiple of ", block));
  }
  if (c.intermediate % block != 0) {
    return bad(inter_key, absl::StrCat(c.intermediate, " is not a multiple of ", block));
  }
  if (c.top_k > c.num_experts) {
    return bad("num_experts_per_tok",
               absl::StrCat(c.top_k, " exceeds the ", c.num_experts, " experts"));
  }
  if (c.moe_layer_ids.empty()) return bad("num_hidden_layers", "leaves no MoE layer");
  if (c.n_shared_experts * c.intermediate > kMaxModelDim) {
    return bad("n_shared_experts", "times the intermediate size is too large");
  }
  const RoutingParams& r = c.routing;
  if (r.method == RoutingMethod::kDeepSeekV3) {
    if (c.num_experts % r.n_group != 0) {
      return bad("n_group",
                 absl::StrCat(r.n_group, " does not divide ", c.num_experts, " experts"));
    }
    if (r.topk_group > r.n_group) return bad("topk_group", "exceeds n_group");
    if (r.topk_group * (c.num_experts / r.n_group) < c.top_k) {
      return bad("topk_group", "selects fewer experts than num_experts_per_tok");
    }
  }
  if (absl::Status s = ValidateActivation(c.activation); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: activation: ", s.message()));
  }
  return absl::OkStatus();
}

std::string FloatBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return absl::StrCat(absl::Hex(bits, absl::kZeroPad8));
}

uint64_t Fnv1a64(absl::string_view text) {
  uint64_t hash = 14695981039346656037ull;
  for (char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace

absl::string_view CheckpointLayoutName(CheckpointLayout layout) {
  return layout == CheckpointLayout::kGptOssMxfp4 ? "gpt-oss-mxfp4" : "modelopt-nvfp4";
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view config_text,
                                             std::optional<absl::string_view> hf_quant_text) {
  absl::StatusOr<Json> json = ParseObject(config_text, kConfigFileName);
  if (!json.ok()) return json.status();
  absl::StatusOr<CheckpointLayout> layout = DetectLayout(*json, hf_quant_text);
  if (!layout.ok()) return layout.status();
  ModelConfig config;
  KeyReader keys(*json, kConfigFileName);
  config.model_type = keys.String("model_type", "");
  if (*layout == CheckpointLayout::kGptOssMxfp4) {
    ReadGptOss(keys, config);
  } else {
    ReadModelOpt(keys, config);
  }
  if (!keys.status().ok()) return keys.status();
  if (absl::Status s = ReadOverrides(*json, config); !s.ok()) return s;
  config.routing.top_k = config.top_k;
  if (absl::Status s = CheckConsistency(config); !s.ok()) return s;
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  absl::StatusOr<std::string> config =
      ReadSmallFile(absl::StrCat(dir, "/", kConfigFileName), kMaxConfigBytes);
  if (!config.ok()) return config.status();
  const std::string quant_path = absl::StrCat(dir, "/", kHfQuantConfigFileName);
  std::optional<std::string> quant;
  if (RegularFileExists(quant_path)) {
    absl::StatusOr<std::string> text = ReadSmallFile(quant_path, kMaxConfigBytes);
    if (!text.ok()) return text.status();
    quant = *std::move(text);
  }
  absl::StatusOr<ModelConfig> parsed =
      ParseModelConfig(*config, quant ? std::optional<absl::string_view>(*quant) : std::nullopt);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(), absl::StrCat(dir, ": ", parsed.status().message()));
  }
  return parsed;
}

std::string ModelConfig::CanonicalString() const {
  const ActivationParams& a = activation;
  return absl::StrCat(
      "layout=", CheckpointLayoutName(layout), ";format=", WeightFormatName(format),
      ";gate_up=", gate_up == GateUpLayout::kInterleaved ? "interleaved" : "concatenated",
      ";layers=", num_hidden_layers, ";moe_layers=", absl::StrJoin(moe_layer_ids, ","),
      ";experts=", num_experts, ";hidden=", hidden, ";intermediate=", intermediate,
      ";top_k=", top_k, ";shared=", n_shared_experts, ";act=", ActivationKindName(a.kind), ",",
      FloatBits(a.alpha), ",", FloatBits(a.limit), ",", FloatBits(a.beta), ",",
      FloatBits(a.linear_beta), ";routing=", RoutingMethodName(routing.method), ",",
      routing.n_group, ",", routing.topk_group, ",", FloatBits(routing.routed_scaling_factor), ",",
      routing.renormalize ? 1 : 0);
}

std::string ModelConfig::Fingerprint() const {
  return absl::StrCat(CheckpointLayoutName(layout), "-",
                      absl::Hex(Fnv1a64(CanonicalString()), absl::kZeroPad16));
}

}  // namespace moe::model
