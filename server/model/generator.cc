// Synthetic checkpoint generator. The config is built first and run through ParseModelConfig, so
// the generator accepts exactly what the loader accepts; then every tensor is drawn in a fixed
// order (independent of the file count) and the tensors, sorted by name, are dealt out to files.
#include "server/model/generator.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <numbers>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/tensor.h"
#include "nlohmann/json.hpp"
#include "server/model/checkpoint.h"
#include "server/model/model_config.h"
#include "server/model/safetensors.h"

namespace moe::model {
namespace {

using Json = nlohmann::json;

// Standard normal draws: Box-Muller over std::mt19937_64, whose output the standard fixes (the
// algorithm of std::normal_distribution is left to the library, which would tie checkpoints to
// one standard library).
class NormalSource {
 public:
  explicit NormalSource(uint64_t seed) : rng_(seed) {}

  float Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(rng_() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;          // [0, 1)
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = static_cast<float>(radius * std::sin(angle));
    has_spare_ = true;
    return static_cast<float>(radius * std::cos(angle));
  }

  std::vector<float> Draw(int64_t count, float stddev) {
    std::vector<float> out(static_cast<size_t>(count));
    for (float& x : out) x = stddev * Next();
    return out;
  }

 private:
  std::mt19937_64 rng_;
  bool has_spare_ = false;
  float spare_ = 0.f;
};

// NVFP4 global scale: the largest magnitude maps onto the largest block scale times the largest
// E2M1 value.
constexpr float kNvfp4GlobalDivisor = 6.f * 448.f;

struct Pending {
  SafetensorsDType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};
using TensorMap = std::map<std::string, Pending>;

std::vector<uint8_t> ToBf16Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = FloatToBf16(values[i]);
    bytes[2 * i] = static_cast<uint8_t>(bits);
    bytes[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
  }
  return bytes;
}

std::vector<uint8_t> ToF32Bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());  // little-endian host
  return bytes;
}

// Draws a [rows, cols] matrix ~ N(0, 1/sqrt(cols)) and quantizes it into `values` ([rows, cols/2])
// and `scales` ([rows, cols/block]); returns the NVFP4 global scale used (1 for MXFP4).
absl::StatusOr<float> DrawQuantized(NormalSource& rng, WeightFormat format, int64_t rows,
                                    int64_t cols, uint8_t* values, uint8_t* scales) {
  const std::vector<float> w = rng.Draw(rows * cols, 1.f / std::sqrt(static_cast<float>(cols)));
  float global = 1.f;
  if (format == WeightFormat::kNvfp4) {
    float amax = 0.f;
    for (float x : w) amax = std::max(amax, std::fabs(x));
    if (amax > 0.f) global = amax / kNvfp4GlobalDivisor;
  }
  const int64_t block = format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  const DType scale_dtype = format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3;
  WeightMatrix m{format, rows, cols, MakeView(DType::kU8, {rows, cols / 2}, values),
                 MakeView(scale_dtype, {rows, cols / block}, scales)};
  if (absl::Status s = QuantizeMatrix(w.data(), rows, cols, global, m); !s.ok()) return s;
  return global;
}

void AddBf16(TensorMap& out, const std::string& name, Shape shape, NormalSource& rng,
             float stddev) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  out[name] = Pending{SafetensorsDType::kBF16, std::move(shape), ToBf16Bytes(rng.Draw(n, stddev))};
}

void AddF32Scalar(TensorMap& out, const std::string& name, float value) {
  out[name] = Pending{SafetensorsDType::kF32, {}, ToF32Bytes({value})};
}

absl::Status AddGptOssLayer(const GenerateOptions& o, int64_t layer, NormalSource& rng,
                            TensorMap& out) {
  const int64_t e = o.experts, h = o.hidden, i = o.intermediate;
  const std::string p = absl::StrCat("model.layers.", layer, ".mlp.");
  std::vector<uint8_t> blocks13(e * 2 * i * h / 2), scales13(e * 2 * i * h / kMxfp4Block);
  std::vector<uint8_t> blocks2(e * h * i / 2), scales2(e * h * i / kMxfp4Block);
  for (int64_t x = 0; x < e; ++x) {
    absl::StatusOr<float> g =
        DrawQuantized(rng, WeightFormat::kMxfp4, 2 * i, h, &blocks13[x * 2 * i * h / 2],
                      &scales13[x * 2 * i * h / kMxfp4Block]);
    if (!g.ok()) return g.status();
    g = DrawQuantized(rng, WeightFormat::kMxfp4, h, i, &blocks2[x * h * i / 2],
                      &scales2[x * h * i / kMxfp4Block]);
    if (!g.ok()) return g.status();
  }
  const std::string x = p + "experts.";
  out[x + "gate_up_proj_blocks"] = {
      SafetensorsDType::kU8, {e, 2 * i, h / kMxfp4Block, 16}, std::move(blocks13)};
  out[x + "gate_up_proj_scales"] = {
      SafetensorsDType::kU8, {e, 2 * i, h / kMxfp4Block}, std::move(scales13)};
  out[x + "down_proj_blocks"] = {
      SafetensorsDType::kU8, {e, h, i / kMxfp4Block, 16}, std::move(blocks2)};
  out[x + "down_proj_scales"] = {
      SafetensorsDType::kU8, {e, h, i / kMxfp4Block}, std::move(scales2)};
  AddBf16(out, x + "gate_up_proj_bias", {e, 2 * i}, rng, 0.1f);
  AddBf16(out, x + "down_proj_bias", {e, h}, rng, 0.1f);
  AddBf16(out, p + "router.weight", {e, h}, rng, 1.f / std::sqrt(static_cast<float>(h)));
  AddBf16(out, p + "router.bias", {e}, rng, 0.1f);
  return absl::OkStatus();
}

// One ModelOpt projection (weight, weight_scale, weight_scale_2, input_scale).
absl::Status AddNvfp4Projection(const std::string& prefix, int64_t rows, int64_t cols,
                                NormalSource& rng, TensorMap& out) {
  std::vector<uint8_t> values(rows * cols / 2), scales(rows * cols / kNvfp4Block);
  absl::StatusOr<float> global =
      DrawQuantized(rng, WeightFormat::kNvfp4, rows, cols, values.data(), scales.data());
  if (!global.ok()) return global.status();
  out[prefix + ".weight"] = {SafetensorsDType::kU8, {rows, cols / 2}, std::move(values)};
  out[prefix + ".weight_scale"] = {
      SafetensorsDType::kF8E4M3, {rows, cols / kNvfp4Block}, std::move(scales)};
  AddF32Scalar(out, prefix + ".weight_scale_2", *global);
  // Activation scale of a calibrated checkpoint (amax ~ 10 over 6 * 448); the loader ignores it.
  AddF32Scalar(out, prefix + ".input_scale", 10.f / kNvfp4GlobalDivisor);
  return absl::OkStatus();
}

absl::Status AddModelOptLayer(const GenerateOptions& o, int64_t layer, NormalSource& rng,
                              TensorMap& out) {
  const int64_t h = o.hidden, i = o.intermediate;
  const std::string p = absl::StrCat("model.layers.", layer, ".mlp.");
  struct Projection {
    const char* name;
    int64_t rows, cols;
  };
  for (int64_t e = 0; e < o.experts; ++e) {
    for (const Projection& proj : {Projection{"gate_proj", i, h}, Projection{"up_proj", i, h},
                                   Projection{"down_proj", h, i}}) {
      const std::string prefix = absl::StrCat(p, "experts.", e, ".", proj.name);
      if (absl::Status s = AddNvfp4Projection(prefix, proj.rows, proj.cols, rng, out); !s.ok()) {
        return s;
      }
    }
  }
  if (o.n_shared_experts > 0) {
    const int64_t wide = o.n_shared_experts * i;
    for (const Projection& proj : {Projection{"gate_proj", wide, h}, Projection{"up_proj", wide, h},
                                   Projection{"down_proj", h, wide}}) {
      const std::string prefix = absl::StrCat(p, "shared_experts.", proj.name);
      if (absl::Status s = AddNvfp4Projection(prefix, proj.rows, proj.cols, rng, out); !s.ok()) {
        return s;
      }
    }
  }
  AddBf16(out, p + "gate.weight", {o.experts, h}, rng, 1.f / std::sqrt(static_cast<float>(h)));
  if (o.n_group > 0) {
    out[p + "gate.e_score_correction_bias"] = {
        SafetensorsDType::kF32, {o.experts}, ToF32Bytes(rng.Draw(o.experts, 0.05f))};
  }
  return absl::OkStatus();
}

Json ConfigJson(const GenerateOptions& o) {
  Json c;
  if (o.format == WeightFormat::kMxfp4) {
    c = {{"architectures", {"GptOssForCausalLM"}},
         {"model_type", "gpt_oss"},
         {"num_hidden_layers", o.layers},
         {"num_local_experts", o.experts},
         {"num_experts_per_tok", o.top_k},
         {"experts_per_token", o.top_k},
         {"hidden_size", o.hidden},
         {"intermediate_size", o.intermediate},
         {"swiglu_limit", o.swiglu_limit},
         {"hidden_act", "silu"},
         {"quantization_config", {{"quant_method", "mxfp4"}}}};
  } else {
    c = {{"hidden_size", o.hidden},
         {"moe_intermediate_size", o.intermediate},
         {"num_hidden_layers", o.layers},
         {"num_experts_per_tok", o.top_k},
         {"hidden_act", "silu"},
         {"norm_topk_prob", true},
         {"n_shared_experts", o.n_shared_experts}};
    if (o.n_group > 0) {
      c.update({{"architectures", {"DeepseekV3ForCausalLM"}},
                {"model_type", "deepseek_v3"},
                {"n_routed_experts", o.experts},
                {"n_group", o.n_group},
                {"topk_group", o.topk_group},
                {"routed_scaling_factor", o.routed_scaling_factor},
                {"scoring_func", "sigmoid"},
                {"topk_method", "noaux_tc"},
                {"first_k_dense_replace", 0}});
    } else {
      c.update({{"architectures", {"Qwen3MoeForCausalLM"}},
                {"model_type", "qwen3_moe"},
                {"num_experts", o.experts}});
    }
  }
  if (!o.activation.empty()) c["moe_serve"] = {{"activation", o.activation}};
  return c;
}

Json HfQuantConfigJson() {
  return {
      {"producer", {{"name", "modelopt"}, {"version", "moe-serve synthetic"}}},
      {"quantization",
       {{"quant_algo", "NVFP4"}, {"group_size", kNvfp4Block}, {"exclude_modules", {"lm_head"}}}}};
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", path));
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed) return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Creates `dir` and removes what an earlier generation may have left there, so that a
// single-file model does not sit beside a stale index (which the loader would prefer).
absl::Status PrepareDirectory(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool shard = absl::StartsWith(name, "model-") && absl::EndsWith(name, ".safetensors");
    if (shard || name == kSingleFileName || name == kIndexFileName ||
        name == kHfQuantConfigFileName) {
      fs::remove(it->path(), ec);
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot clean ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

// Deals the tensors, in name order, out to `files` files and writes them (and the index).
// REQUIRES: 1 <= files <= tensors.size().
absl::Status WriteShards(const std::string& dir, int64_t files, TensorMap tensors) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<SafetensorsWriter> writers(files);
  std::vector<std::string> names(files);
  for (int64_t f = 0; f < files; ++f) {
    names[f] = files == 1 ? std::string(kSingleFileName)
                          : absl::StrFormat("model-%05d-of-%05d.safetensors", f + 1, files);
  }
  Json weight_map = Json::object();
  int64_t k = 0, total = 0;
  for (auto& [name, t] : tensors) {
    const int64_t f = k++ * files / n;
    total += static_cast<int64_t>(t.bytes.size());
    weight_map[name] = names[f];
    if (absl::Status s = writers[f].Add(name, t.dtype, t.shape, std::move(t.bytes)); !s.ok()) {
      return s;
    }
  }
  for (int64_t f = 0; f < files; ++f) {
    if (absl::Status s = writers[f].Write(absl::StrCat(dir, "/", names[f])); !s.ok()) return s;
  }
  if (files == 1) return absl::OkStatus();
  const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteText(absl::StrCat(dir, "/", kIndexFileName), index.dump(2) + "\n");
}

}  // namespace

absl::Status GenerateModel(const GenerateOptions& options, const std::string& dir) {
  const bool nvfp4 = options.format == WeightFormat::kNvfp4;
  if (options.format == WeightFormat::kBf16) {
    return absl::InvalidArgumentError("the generator writes MXFP4 or NVFP4 checkpoints only");
  }
  if (!nvfp4 && (options.n_shared_experts > 0 || options.n_group > 0)) {
    return absl::InvalidArgumentError("shared experts and grouped routing need the NVFP4 layout");
  }
  const Json config = ConfigJson(options);
  const std::string config_text = config.dump(2) + "\n";
  const std::string quant_text = HfQuantConfigJson().dump(2) + "\n";
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(
      config_text, nvfp4 ? std::optional<absl::string_view>(quant_text) : std::nullopt);
  if (!parsed.ok()) return parsed.status();

  NormalSource rng(options.seed);
  TensorMap tensors;
  for (int64_t l = 0; l < options.layers; ++l) {
    absl::Status s = nvfp4 ? AddModelOptLayer(options, l, rng, tensors)
                           : AddGptOssLayer(options, l, rng, tensors);
    if (!s.ok()) return s;
  }
  // File names carry five-digit counters, as Hugging Face's do.
  const int64_t max_files = std::min<int64_t>(static_cast<int64_t>(tensors.size()), 99999);
  if (options.files < 1 || options.files > max_files) {
    return absl::InvalidArgumentError(
        absl::StrCat("files = ", options.files, " must be in [1, ", max_files, "]"));
  }
  if (absl::Status s = PrepareDirectory(dir); !s.ok()) return s;
  if (absl::Status s = WriteText(absl::StrCat(dir, "/", kConfigFileName), config_text); !s.ok()) {
    return s;
  }
  if (nvfp4) {
    const std::string path = absl::StrCat(dir, "/", kHfQuantConfigFileName);
    if (absl::Status s = WriteText(path, quant_text); !s.ok()) return s;
  }
  return WriteShards(dir, options.files, std::move(tensors));
}

}  // namespace moe::model
