// Expert-weight loading for the gpt-oss MXFP4 and ModelOpt NVFP4 checkpoint layouts.
//
// Every tensor is checked against the dtype and exact shape the config implies before any slice
// of it is taken, so slicing expert e out of a fused [E, ...] tensor cannot read past the mapping.
#include "server/model/model.h"

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/formats.h"

namespace moe::model {
namespace {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

// `name` from the checkpoint, required to have one of `dtypes` and exactly `shape`.
absl::StatusOr<SafetensorsTensor> GetExpected(const Checkpoint& checkpoint, const std::string& name,
                                              std::initializer_list<SafetensorsDType> dtypes,
                                              const Shape& shape) {
  absl::StatusOr<SafetensorsTensor> t = checkpoint.Get(name);
  if (!t.ok()) return t.status();
  if (absl::c_find(dtypes, t->dtype) == dtypes.end() || t->shape != shape) {
    std::vector<std::string> names;
    for (SafetensorsDType d : dtypes) names.emplace_back(SafetensorsDTypeName(d));
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "' is ", SafetensorsDTypeName(t->dtype), " ", ShapeString(t->shape),
        " but config.json implies ", absl::StrJoin(names, "|"), " ", ShapeString(shape)));
  }
  return t;
}

// Element i of a BF16 or F32 tensor (the mapping need not be aligned, hence memcpy).
float ReadFloat(const SafetensorsTensor& t, int64_t i) {
  if (t.dtype == SafetensorsDType::kBF16) {
    uint16_t bits;
    std::memcpy(&bits, t.data + 2 * i, sizeof(bits));
    return Bf16ToFloat(bits);
  }
  float value;
  std::memcpy(&value, t.data + 4 * i, sizeof(value));
  return value;
}

// Elements [begin, begin + count) of a BF16/F32 tensor, widened to F32, all finite.
absl::Status WidenToF32(const SafetensorsTensor& t, int64_t begin, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = ReadFloat(t, begin + i);
    if (!std::isfinite(out[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' has a non-finite value at element ", begin + i));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<HostTensor> LoadF32(const Checkpoint& checkpoint, const std::string& name,
                                   const Shape& shape) {
  absl::StatusOr<SafetensorsTensor> t =
      GetExpected(checkpoint, name, {SafetensorsDType::kBF16, SafetensorsDType::kF32}, shape);
  if (!t.ok()) return t.status();
  HostTensor out(DType::kF32, shape);
  if (absl::Status s = WidenToF32(*t, 0, t->NumElements(), out.data<float>()); !s.ok()) return s;
  return out;
}

// A view of `shape` starting `offset` bytes into a checked tensor.
TensorView Slice(const SafetensorsTensor& t, DType dtype, Shape shape, int64_t offset) {
  return TensorView{dtype, std::move(shape), const_cast<uint8_t*>(t.data + offset)};
}

// Copies the block rows [row0, row0 + rows) x bytes [col0, col0 + cols) of a row-major tensor
// whose rows are `row_bytes` long into dense memory at `dst`.
void CopyBlock(const SafetensorsTensor& src, int64_t row_bytes, int64_t row0, int64_t rows,
               int64_t col0, int64_t cols, uint8_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * cols, src.data + (row0 + r) * row_bytes + col0, cols);
  }
}

// One NVFP4 projection of a ModelOpt checkpoint.
struct Nvfp4Projection {
  SafetensorsTensor weight;  // U8 [rows, cols / 2]
  SafetensorsTensor scale;   // F8_E4M3 [rows, cols / 16]
  float global_scale = 1.f;  // weight_scale_2
};

absl::StatusOr<Nvfp4Projection> GetProjection(const Checkpoint& checkpoint,
                                              const std::string& prefix, int64_t rows,
                                              int64_t cols) {
  Nvfp4Projection p;
  absl::StatusOr<SafetensorsTensor> weight =
      GetExpected(checkpoint, prefix + ".weight", {SafetensorsDType::kU8}, {rows, cols / 2});
  if (!weight.ok()) return weight.status();
  absl::StatusOr<SafetensorsTensor> scale =
      GetExpected(checkpoint, prefix + ".weight_scale", {SafetensorsDType::kF8E4M3},
                  {rows, cols / kNvfp4Block});
  if (!scale.ok()) return scale.status();
  absl::StatusOr<SafetensorsTensor> global = checkpoint.Get(prefix + ".weight_scale_2");
  if (!global.ok()) return global.status();
  // ModelOpt writes the global scale as a 0-d tensor; [1] is accepted too.
  if (global->dtype != SafetensorsDType::kF32 || global->NumElements() != 1 ||
      global->shape.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", global->name, "' is not an F32 scalar"));
  }
  p.weight = *std::move(weight);
  p.scale = *std::move(scale);
  p.global_scale = ReadFloat(*global, 0);
  return p;
}

// Builds the ExpertLayer of one LoadedLayer; one builder per LoadLayer call.
class LayerBuilderImpl {
 public:
  LayerBuilderImpl(const ModelConfig& config, const Checkpoint& checkpoint, int64_t ckpt_layer,
                   std::deque<HostTensor>& owned)
      : config_(config), checkpoint_(checkpoint), ckpt_layer_(ckpt_layer), owned_(owned) {}

  absl::StatusOr<ExpertWeights> GptOssExpert(int64_t e);
  absl::StatusOr<ExpertWeights> ModelOptExpert(int64_t e);
  absl::StatusOr<std::vector<ExpertWeights>> SharedExperts();

 private:
  HostTensor& Own(DType dtype, Shape shape) { return owned_.emplace_back(dtype, std::move(shape)); }
  std::string Prefix() const { return absl::StrCat("model.layers.", ckpt_layer_, ".mlp."); }
  absl::Status LoadGptOssTensors();
  // Part `part` of `parts` of an NVFP4 MLP whose intermediate size is parts * I.
  ExpertWeights SplitNvfp4(const Nvfp4Projection& gate, const Nvfp4Projection& up,
                           const Nvfp4Projection& down, int64_t part, int64_t parts);

  const ModelConfig& config_;
  const Checkpoint& checkpoint_;
  const int64_t ckpt_layer_;
  std::deque<HostTensor>& owned_;
  // gpt-oss fused tensors, fetched on the first expert.
  bool gpt_oss_loaded_ = false;
  SafetensorsTensor blocks13_, scales13_, blocks2_, scales2_;
  std::optional<SafetensorsTensor> bias13_, bias2_;
};

absl::Status LayerBuilderImpl::LoadGptOssTensors() {
  if (gpt_oss_loaded_) return absl::OkStatus();
  const int64_t e = config_.num_experts, h = config_.hidden, i = config_.intermediate;
  const std::string p = Prefix() + "experts.";
  const auto u8 = {SafetensorsDType::kU8};
  const auto floats = {SafetensorsDType::kBF16, SafetensorsDType::kF32};
  struct Want {
    SafetensorsTensor* out;
    const char* name;
    std::initializer_list<SafetensorsDType> dtypes;
    Shape shape;
  };
  const Want wants[] = {
      {&blocks13_, "gate_up_proj_blocks", u8, {e, 2 * i, h / kMxfp4Block, 16}},
      {&scales13_, "gate_up_proj_scales", u8, {e, 2 * i, h / kMxfp4Block}},
      {&blocks2_, "down_proj_blocks", u8, {e, h, i / kMxfp4Block, 16}},
      {&scales2_, "down_proj_scales", u8, {e, h, i / kMxfp4Block}},
  };
  for (const Want& want : wants) {
    absl::StatusOr<SafetensorsTensor> t =
        GetExpected(checkpoint_, p + want.name, want.dtypes, want.shape);
    if (!t.ok()) return t.status();
    *want.out = *std::move(t);
  }
  // Biases are optional: a checkpoint without them computes without them.
  for (auto [out, name, shape] : {std::tuple(&bias13_, "gate_up_proj_bias", Shape{e, 2 * i}),
                                  std::tuple(&bias2_, "down_proj_bias", Shape{e, h})}) {
    if (!checkpoint_.Contains(p + name)) continue;
    absl::StatusOr<SafetensorsTensor> t = GetExpected(checkpoint_, p + name, floats, shape);
    if (!t.ok()) return t.status();
    *out = *std::move(t);
  }
  gpt_oss_loaded_ = true;
  return absl::OkStatus();
}

absl::StatusOr<ExpertWeights> LayerBuilderImpl::GptOssExpert(int64_t e) {
  if (absl::Status s = LoadGptOssTensors(); !s.ok()) return s;
  const int64_t h = config_.hidden, i = config_.intermediate;
  ExpertWeights w;
  w.w13 = WeightMatrix{
      WeightFormat::kMxfp4, 2 * i, h,
      Slice(blocks13_, DType::kU8, {2 * i, h / 2}, e * 2 * i * h / 2),
      Slice(scales13_, DType::kU8, {2 * i, h / kMxfp4Block}, e * 2 * i * h / kMxfp4Block)};
  w.w2 = WeightMatrix{WeightFormat::kMxfp4, h, i,
                      Slice(blocks2_, DType::kU8, {h, i / 2}, e * h * i / 2),
                      Slice(scales2_, DType::kU8, {h, i / kMxfp4Block}, e * h * i / kMxfp4Block)};
  if (bias13_) {
    HostTensor& b13 = Own(DType::kF32, {2 * i});
    if (absl::Status s = WidenToF32(*bias13_, e * 2 * i, 2 * i, b13.data<float>()); !s.ok())
      return s;
    w.b13 = b13.view();
  }
  if (bias2_) {
    HostTensor& b2 = Own(DType::kF32, {h});
    if (absl::Status s = WidenToF32(*bias2_, e * h, h, b2.data<float>()); !s.ok()) return s;
    w.b2 = b2.view();
  }
  return w;
}

ExpertWeights LayerBuilderImpl::SplitNvfp4(const Nvfp4Projection& gate, const Nvfp4Projection& up,
                                           const Nvfp4Projection& down, int64_t part,
                                           int64_t parts) {
  const int64_t h = config_.hidden, i = config_.intermediate;
  const int64_t sb = kNvfp4Block;
  ExpertWeights w;
  HostTensor& v13 = Own(DType::kU8, {2 * i, h / 2});
  HostTensor& s13 = Own(DType::kE4M3, {2 * i, h / sb});
  CopyBlock(gate.weight, h / 2, part * i, i, 0, h / 2, v13.data<uint8_t>());
  CopyBlock(up.weight, h / 2, part * i, i, 0, h / 2, v13.data<uint8_t>() + i * h / 2);
  CopyBlock(gate.scale, h / sb, part * i, i, 0, h / sb, s13.data<uint8_t>());
  CopyBlock(up.scale, h / sb, part * i, i, 0, h / sb, s13.data<uint8_t>() + i * h / sb);
  w.w13 = WeightMatrix{WeightFormat::kNvfp4, 2 * i, h, v13.view(), s13.view()};
  if (parts == 1) {
    w.w2 = WeightMatrix{WeightFormat::kNvfp4, h, i, Slice(down.weight, DType::kU8, {h, i / 2}, 0),
                        Slice(down.scale, DType::kE4M3, {h, i / sb}, 0)};
  } else {
    HostTensor& v2 = Own(DType::kU8, {h, i / 2});
    HostTensor& s2 = Own(DType::kE4M3, {h, i / sb});
    CopyBlock(down.weight, parts * i / 2, 0, h, part * i / 2, i / 2, v2.data<uint8_t>());
    CopyBlock(down.scale, parts * i / sb, 0, h, part * i / sb, i / sb, s2.data<uint8_t>());
    w.w2 = WeightMatrix{WeightFormat::kNvfp4, h, i, v2.view(), s2.view()};
  }
  w.w13_gate_global_scale = gate.global_scale;
  w.w13_up_global_scale = up.global_scale;
  w.w2_global_scale = down.global_scale;
  return w;
}

absl::StatusOr<ExpertWeights> LayerBuilderImpl::ModelOptExpert(int64_t e) {
  const int64_t h = config_.hidden, i = config_.intermediate;
  const std::string p = absl::StrCat(Prefix(), "experts.", e, ".");
  absl::StatusOr<Nvfp4Projection> gate = GetProjection(checkpoint_, p + "gate_proj", i, h);
  if (!gate.ok()) return gate.status();
  absl::StatusOr<Nvfp4Projection> up = GetProjection(checkpoint_, p + "up_proj", i, h);
  if (!up.ok()) return up.status();
  absl::StatusOr<Nvfp4Projection> down = GetProjection(checkpoint_, p + "down_proj", h, i);
  if (!down.ok()) return down.status();
  return SplitNvfp4(*gate, *up, *down, 0, 1);
}

absl::StatusOr<std::vector<ExpertWeights>> LayerBuilderImpl::SharedExperts() {
  const int64_t h = config_.hidden, n = config_.n_shared_experts;
  const int64_t wide = n * config_.intermediate;
  const std::string p = Prefix() + "shared_experts.";
  absl::StatusOr<Nvfp4Projection> gate = GetProjection(checkpoint_, p + "gate_proj", wide, h);
  if (!gate.ok()) return gate.status();
  absl::StatusOr<Nvfp4Projection> up = GetProjection(checkpoint_, p + "up_proj", wide, h);
  if (!up.ok()) return up.status();
  absl::StatusOr<Nvfp4Projection> down = GetProjection(checkpoint_, p + "down_proj", h, wide);
  if (!down.ok()) return down.status();
  std::vector<ExpertWeights> experts;
  for (int64_t part = 0; part < n; ++part)
    experts.push_back(SplitNvfp4(*gate, *up, *down, part, n));
  return experts;
}

// Validates one expert as a one-expert layer, so the error can name it.
absl::Status ValidateOne(const ExpertLayer& layer, const ExpertWeights& w) {
  ExpertLayer one;
  one.hidden = layer.hidden;
  one.intermediate = layer.intermediate;
  one.format = layer.format;
  one.layout = layer.layout;
  one.activation = layer.activation;
  one.experts.push_back(w);
  return ValidateExpertLayer(one);
}

}  // namespace

// LoadedLayer's friend: fills a LoadedLayer through LayerBuilderImpl.
class LayerBuilder {
 public:
  static absl::Status Fill(const ModelConfig& config, const Checkpoint& checkpoint,
                           absl::Span<const int32_t> slots, LoadedLayer& out);
};

absl::Status LayerBuilder::Fill(const ModelConfig& config, const Checkpoint& checkpoint,
                                absl::Span<const int32_t> slots, LoadedLayer& out) {
  const int64_t ckpt_layer = config.moe_layer_ids[out.moe_layer_];
  const std::string where =
      absl::StrCat("MoE layer ", out.moe_layer_, " (checkpoint layer ", ckpt_layer, ")");
  ExpertLayer& layer = out.layer_;
  layer.hidden = config.hidden;
  layer.intermediate = config.intermediate;
  layer.format = config.format;
  layer.layout = config.gate_up;
  layer.activation = config.activation;
  LayerBuilderImpl builder(config, checkpoint, ckpt_layer, out.owned_);
  std::map<int32_t, ExpertWeights> loaded;  // logical expert -> weights, read once
  for (size_t slot = 0; slot < slots.size(); ++slot) {
    const int32_t e = slots[slot];
    const std::string name = absl::StrCat(where, " slot ", slot, " expert ", e);
    if (e < 0 || e >= config.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expert id outside [0, ", config.num_experts, ")"));
    }
    auto it = loaded.find(e);
    if (it == loaded.end()) {
      absl::StatusOr<ExpertWeights> w = config.layout == CheckpointLayout::kGptOssMxfp4
                                            ? builder.GptOssExpert(e)
                                            : builder.ModelOptExpert(e);
      if (!w.ok()) return Annotate(w.status(), name);
      if (absl::Status s = ValidateOne(layer, *w); !s.ok()) return Annotate(s, name);
      it = loaded.emplace(e, *std::move(w)).first;
    }
    layer.experts.push_back(it->second);
  }
  if (config.n_shared_experts > 0) {
    absl::StatusOr<std::vector<ExpertWeights>> shared = builder.SharedExperts();
    if (!shared.ok()) return Annotate(shared.status(), absl::StrCat(where, " shared experts"));
    for (size_t s = 0; s < shared->size(); ++s) {
      if (absl::Status st = ValidateOne(layer, (*shared)[s]); !st.ok()) {
        return Annotate(st, absl::StrCat(where, " shared expert part ", s));
      }
    }
    layer.shared_experts = *std::move(shared);
  }
  return absl::OkStatus();
}

RoutingParams RouterWeights::Params(const ModelConfig& config) const {
  RoutingParams params = config.routing;
  if (bias.NumElements() > 0) params.router_bias = bias.view();
  if (correction_bias.NumElements() > 0) params.correction_bias = correction_bias.view();
  return params;
}

absl::StatusOr<std::unique_ptr<ExpertModel>> ExpertModel::Open(const std::string& dir) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return std::unique_ptr<ExpertModel>(new ExpertModel(*std::move(config), *std::move(checkpoint)));
}

absl::StatusOr<std::unique_ptr<LoadedLayer>> ExpertModel::LoadLayer(
    int64_t moe_layer, absl::Span<const int32_t> slot_to_logical) const {
  if (moe_layer < 0 || moe_layer >= num_moe_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE layer ", moe_layer, " outside [0, ", num_moe_layers(), ")"));
  }
  std::unique_ptr<LoadedLayer> out(new LoadedLayer());
  out->moe_layer_ = moe_layer;
  out->slot_to_logical_.assign(slot_to_logical.begin(), slot_to_logical.end());
  out->checkpoint_ = checkpoint_;
  if (absl::Status s = LayerBuilder::Fill(config_, *checkpoint_, slot_to_logical, *out); !s.ok()) {
    return s;
  }
  return out;
}

absl::StatusOr<RouterWeights> ExpertModel::LoadRouter(int64_t moe_layer) const {
  if (moe_layer < 0 || moe_layer >= num_moe_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE layer ", moe_layer, " outside [0, ", num_moe_layers(), ")"));
  }
  const bool gpt_oss = config_.layout == CheckpointLayout::kGptOssMxfp4;
  const std::string p = absl::StrCat("model.layers.", config_.moe_layer_ids[moe_layer], ".mlp.",
                                     gpt_oss ? "router." : "gate.");
  const std::string bias_name = p + (gpt_oss ? "bias" : "e_score_correction_bias");
  const int64_t e = config_.num_experts;
  RouterWeights router;
  absl::StatusOr<HostTensor> weight = LoadF32(*checkpoint_, p + "weight", {e, config_.hidden});
  if (!weight.ok()) return weight.status();
  router.weight = *std::move(weight);
  if (checkpoint_->Contains(bias_name)) {
    absl::StatusOr<HostTensor> bias = LoadF32(*checkpoint_, bias_name, {e});
    if (!bias.ok()) return bias.status();
    (gpt_oss ? router.bias : router.correction_bias) = *std::move(bias);
  }
  return router;
}

}  // namespace moe::model
