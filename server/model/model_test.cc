// Generator -> loader round trips for both layouts (single file and sharded): the loaded
// matrices, scales and biases equal an independent decode of the raw checkpoint bytes; hosted
// subsets read only their experts; replicated slots share one copy; mismatches are errors.
#include "server/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "server/model/generator.h"
#include "server/model/test_util.h"

namespace moe::model {
namespace {

using testing::FreshDir;
using ::testing::HasSubstr;
using testing::RefBf16;
using testing::RefDequantMxfp4;
using testing::RefDequantNvfp4;

constexpr int64_t kExperts = 6, kHidden = 64, kInter = 32;

GenerateOptions Options(WeightFormat format, int64_t files) {
  GenerateOptions o;
  o.format = format;
  o.layers = 2;
  o.experts = kExperts;
  o.top_k = 2;
  o.hidden = kHidden;
  o.intermediate = kInter;
  o.files = files;
  o.seed = 11;
  if (format == WeightFormat::kNvfp4) {
    o.n_shared_experts = 2;
    o.n_group = 2;
    o.topk_group = 1;
  }
  return o;
}

// The raw checkpoint tensors, decoded independently of the loader. `shared` is true when the
// checkpoint object is the model's own, so that pointers into its mappings can be compared.
struct Raw {
  std::shared_ptr<const Checkpoint> owned;
  const Checkpoint* checkpoint = nullptr;
  bool shared = false;
  SafetensorsTensor Get(const std::string& name) const {
    absl::StatusOr<SafetensorsTensor> t = checkpoint->Get(name);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : SafetensorsTensor{};
  }
  float Scalar(const std::string& name) const {
    float x;
    std::memcpy(&x, Get(name).data, sizeof(x));
    return x;
  }
};

Raw OpenRaw(const std::string& dir) {
  std::shared_ptr<const Checkpoint> checkpoint = *Checkpoint::Open(dir);
  return Raw{checkpoint, checkpoint.get(), false};
}

Raw ModelRaw(const ExpertModel& model) { return Raw{nullptr, &model.checkpoint(), true}; }

std::vector<float> Dequantized(const WeightMatrix& w, int64_t row_begin, int64_t row_end,
                               float global) {
  std::vector<float> out((row_end - row_begin) * w.cols);
  DequantizeRows(w, row_begin, row_end, global, out.data());
  return out;
}

std::vector<float> Widen(const float* data, int64_t n) {
  return std::vector<float>(data, data + n);
}

std::vector<float> RefBf16Row(const SafetensorsTensor& t, int64_t begin, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, t.data + 2 * (begin + i), 2);
    out[i] = RefBf16(bits);
  }
  return out;
}

// Rows [row0, row0 + rows) x columns [col0, col0 + cols) of a row-major [*, width] matrix.
std::vector<float> Block(const std::vector<float>& m, int64_t width, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = row0; r < row0 + rows; ++r) {
    out.insert(out.end(), m.begin() + r * width + col0, m.begin() + r * width + col0 + cols);
  }
  return out;
}

// Expert `e` of a gpt-oss layer against the raw fused tensors.
void ExpectGptOssExpert(const Raw& raw, int64_t ckpt_layer, int64_t e, const ExpertWeights& w) {
  SCOPED_TRACE(absl::StrCat("gpt-oss layer ", ckpt_layer, " expert ", e));
  const std::string p = absl::StrCat("model.layers.", ckpt_layer, ".mlp.experts.");
  const SafetensorsTensor blocks13 = raw.Get(p + "gate_up_proj_blocks");
  const SafetensorsTensor scales13 = raw.Get(p + "gate_up_proj_scales");
  const SafetensorsTensor blocks2 = raw.Get(p + "down_proj_blocks");
  const SafetensorsTensor scales2 = raw.Get(p + "down_proj_scales");
  const int64_t h = kHidden, i = kInter;
  if (raw.shared) {  // views point straight into the mapped file
    EXPECT_EQ(w.w13.values.data, blocks13.data + e * 2 * i * h / 2);
    EXPECT_EQ(w.w2.scales.data, scales2.data + e * h * i / 32);
  }
  EXPECT_EQ(Dequantized(w.w13, 0, 2 * i, 1.f),
            RefDequantMxfp4(blocks13.data + e * 2 * i * h / 2, scales13.data + e * 2 * i * h / 32,
                            2 * i, h));
  EXPECT_EQ(Dequantized(w.w2, 0, h, 1.f),
            RefDequantMxfp4(blocks2.data + e * h * i / 2, scales2.data + e * h * i / 32, h, i));
  ASSERT_TRUE(w.b13.present() && w.b2.present());
  EXPECT_EQ(Widen(w.b13.As<float>(), 2 * i),
            RefBf16Row(raw.Get(p + "gate_up_proj_bias"), e * 2 * i, 2 * i));
  EXPECT_EQ(Widen(w.b2.As<float>(), h), RefBf16Row(raw.Get(p + "down_proj_bias"), e * h, h));
  EXPECT_EQ(w.w13_gate_global_scale, 1.f);
  EXPECT_EQ(w.w2_global_scale, 1.f);
}

// Part `part` of an NVFP4 MLP whose projections are `prefix`.{gate,up,down}_proj with
// intermediate size parts * I, against the raw per-projection tensors.
void ExpectNvfp4Part(const Raw& raw, const std::string& prefix, int64_t part, int64_t parts,
                     const ExpertWeights& w) {
  SCOPED_TRACE(absl::StrCat(prefix, " part ", part));
  const int64_t h = kHidden, i = kInter, wide = parts * kInter;
  auto full = [&](const char* proj, int64_t rows, int64_t cols) {
    const std::string p = prefix + proj;
    return RefDequantNvfp4(raw.Get(p + ".weight").data, raw.Get(p + ".weight_scale").data, rows,
                           cols, raw.Scalar(p + ".weight_scale_2"));
  };
  const float gate_global = raw.Scalar(prefix + "gate_proj.weight_scale_2");
  const float up_global = raw.Scalar(prefix + "up_proj.weight_scale_2");
  const float down_global = raw.Scalar(prefix + "down_proj.weight_scale_2");
  EXPECT_EQ(w.w13_gate_global_scale, gate_global);
  EXPECT_EQ(w.w13_up_global_scale, up_global);
  EXPECT_EQ(w.w2_global_scale, down_global);
  EXPECT_NE(gate_global, up_global);  // distinct scales, both kept
  // Concatenated layout: rows [0, I) gate, [I, 2I) up.
  EXPECT_EQ(Dequantized(w.w13, 0, i, gate_global),
            Block(full("gate_proj", wide, h), h, part * i, i, 0, h));
  EXPECT_EQ(Dequantized(w.w13, i, 2 * i, up_global),
            Block(full("up_proj", wide, h), h, part * i, i, 0, h));
  EXPECT_EQ(Dequantized(w.w2, 0, h, down_global),
            Block(full("down_proj", h, wide), wide, 0, h, part * i, i));
  EXPECT_FALSE(w.b13.present() || w.b2.present());
}

class RoundTripTest : public ::testing::TestWithParam<std::tuple<WeightFormat, int64_t>> {};

TEST_P(RoundTripTest, AllExpertsMatchTheRawBytes) {
  const auto [format, files] = GetParam();
  const std::string dir = FreshDir("roundtrip");
  ASSERT_TRUE(GenerateModel(Options(format, files), dir).ok());
  absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->checkpoint().file_names().size(), static_cast<size_t>(files));
  const Raw raw = ModelRaw(**model);
  const std::vector<int32_t> all = {0, 1, 2, 3, 4, 5};
  for (int64_t layer = 0; layer < 2; ++layer) {
    absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(layer, all);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const ExpertLayer& l = (*loaded)->layer();
    EXPECT_EQ((*loaded)->moe_layer(), layer);
    EXPECT_EQ((*loaded)->slot_to_logical(), all);
    EXPECT_EQ(l.hidden, kHidden);
    EXPECT_EQ(l.intermediate, kInter);
    EXPECT_EQ(l.format, format);
    ASSERT_EQ(l.experts.size(), all.size());
    EXPECT_TRUE(ValidateExpertLayer(l).ok());
    if (format == WeightFormat::kMxfp4) {
      EXPECT_EQ(l.layout, GateUpLayout::kInterleaved);
      EXPECT_EQ(l.activation.kind, ActivationKind::kSwigluOai);
      EXPECT_TRUE(l.shared_experts.empty());
      for (int e = 0; e < kExperts; ++e) ExpectGptOssExpert(raw, layer, e, l.experts[e]);
    } else {
      EXPECT_EQ(l.layout, GateUpLayout::kConcatenated);
      EXPECT_EQ(l.activation.kind, ActivationKind::kSilu);
      const std::string p = absl::StrCat("model.layers.", layer, ".mlp.");
      for (int e = 0; e < kExperts; ++e) {
        ExpectNvfp4Part(raw, absl::StrCat(p, "experts.", e, "."), 0, 1, l.experts[e]);
        // down_proj is used in place.
        EXPECT_EQ(l.experts[e].w2.values.data,
                  raw.Get(absl::StrCat(p, "experts.", e, ".down_proj.weight")).data);
      }
      ASSERT_EQ(l.shared_experts.size(), 2u);
      for (int s = 0; s < 2; ++s)
        ExpectNvfp4Part(raw, p + "shared_experts.", s, 2, l.shared_experts[s]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, RoundTripTest,
                         ::testing::Combine(::testing::Values(WeightFormat::kMxfp4,
                                                              WeightFormat::kNvfp4),
                                            ::testing::Values(int64_t{1}, int64_t{3})));

// Rewrites the checkpoint of `src` into `dst` as one file, passing every tensor through `edit`,
// which may change its bytes or return false to drop it.
void CopyCheckpoint(const std::string& src, const std::string& dst,
                    const std::function<bool(const std::string&, std::vector<uint8_t>&)>& edit) {
  for (const char* name : {"config.json", "hf_quant_config.json"}) {
    std::error_code ec;
    std::filesystem::copy_file(src + "/" + name, dst + "/" + name, ec);
  }
  const Raw raw = OpenRaw(src);
  SafetensorsWriter writer;
  for (const std::string& name : raw.checkpoint->TensorNames()) {
    const SafetensorsTensor t = raw.Get(name);
    std::vector<uint8_t> bytes(t.bytes().begin(), t.bytes().end());
    if (!edit(name, bytes)) continue;
    ASSERT_TRUE(writer.Add(name, t.dtype, t.shape, std::move(bytes)).ok());
  }
  ASSERT_TRUE(writer.Write(dst + "/model.safetensors").ok());
}

TEST(ExpertModelTest, GptOssSubsetTouchesOnlyHostedExperts) {
  const std::string gen = FreshDir("subset_gen"), dir = FreshDir("subset");
  ASSERT_TRUE(GenerateModel(Options(WeightFormat::kMxfp4, 1), gen).ok());
  // Every expert but 2 and 5 gets NaN block scales (UE8M0 255): loading one of them must fail.
  CopyCheckpoint(gen, dir, [](const std::string& name, std::vector<uint8_t>& bytes) {
    if (name == "model.layers.0.mlp.experts.gate_up_proj_scales") {
      const size_t per_expert = bytes.size() / kExperts;
      for (int e : {0, 1, 3, 4}) std::fill_n(bytes.begin() + e * per_expert, per_expert, 255);
    }
    return true;
  });
  absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok());
  const Raw raw = ModelRaw(**model);
  absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(0, {5, 2});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ((*loaded)->layer().experts.size(), 2u);
  ExpectGptOssExpert(raw, 0, 5, (*loaded)->layer().experts[0]);
  ExpectGptOssExpert(raw, 0, 2, (*loaded)->layer().experts[1]);

  absl::StatusOr<std::unique_ptr<LoadedLayer>> bad = (*model)->LoadLayer(0, {2, 3});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("MoE layer 0 (checkpoint layer 0) slot 1 expert 3"));
  EXPECT_TRUE((*model)->LoadLayer(1, {3}).ok());  // layer 1 is intact
}

TEST(ExpertModelTest, ModelOptSubsetReadsOnlyHostedExperts) {
  const std::string gen = FreshDir("mo_subset_gen"), dir = FreshDir("mo_subset");
  ASSERT_TRUE(GenerateModel(Options(WeightFormat::kNvfp4, 1), gen).ok());
  // Drop every tensor of experts 0, 2, 4 and 5 of layer 0.
  CopyCheckpoint(gen, dir, [](const std::string& name, std::vector<uint8_t>&) {
    for (int e : {0, 2, 4, 5}) {
      if (name.rfind(absl::StrCat("model.layers.0.mlp.experts.", e, "."), 0) == 0) return false;
    }
    return true;
  });
  absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok());
  const Raw raw = OpenRaw(dir);
  absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(0, {3, 1});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectNvfp4Part(raw, "model.layers.0.mlp.experts.3.", 0, 1, (*loaded)->layer().experts[0]);
  ExpectNvfp4Part(raw, "model.layers.0.mlp.experts.1.", 0, 1, (*loaded)->layer().experts[1]);
  absl::StatusOr<std::unique_ptr<LoadedLayer>> missing = (*model)->LoadLayer(0, {1, 4});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("slot 1 expert 4"));
  EXPECT_THAT(missing.status().message(),
              HasSubstr("model.layers.0.mlp.experts.4.gate_proj.weight"));
}

TEST(ExpertModelTest, ReplicatedSlotsShareOneCopy) {
  for (WeightFormat format : {WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    const std::string dir = FreshDir("replicas");
    ASSERT_TRUE(GenerateModel(Options(format, 1), dir).ok());
    absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
    ASSERT_TRUE(model.ok());
    absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(1, {3, 1, 3});
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const std::vector<ExpertWeights>& experts = (*loaded)->layer().experts;
    ASSERT_EQ(experts.size(), 3u);
    EXPECT_EQ(experts[0].w13.values.data, experts[2].w13.values.data);
    EXPECT_EQ(experts[0].w13.scales.data, experts[2].w13.scales.data);
    EXPECT_EQ(experts[0].w2.values.data, experts[2].w2.values.data);
    EXPECT_EQ(experts[0].b13.data, experts[2].b13.data);
    EXPECT_NE(experts[0].w13.values.data, experts[1].w13.values.data);
    const Raw raw = ModelRaw(**model);
    if (format == WeightFormat::kMxfp4) {
      ExpectGptOssExpert(raw, 1, 3, experts[2]);
    } else {
      ExpectNvfp4Part(raw, "model.layers.1.mlp.experts.3.", 0, 1, experts[2]);
    }
  }
}

TEST(ExpertModelTest, LoadedLayerOutlivesTheModel) {
  const std::string dir = FreshDir("outlive");
  ASSERT_TRUE(GenerateModel(Options(WeightFormat::kMxfp4, 3), dir).ok());
  absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok());
  absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(0, {4});
  ASSERT_TRUE(loaded.ok());
  model->reset();
  ExpectGptOssExpert(OpenRaw(dir), 0, 4, (*loaded)->layer().experts[0]);
}

TEST(ExpertModelTest, BadRequestsAndMismatchedCheckpoints) {
  const std::string dir = FreshDir("mismatch");
  ASSERT_TRUE(GenerateModel(Options(WeightFormat::kMxfp4, 1), dir).ok());
  absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->LoadLayer(2, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->LoadLayer(-1, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*model)->LoadLayer(0, {0, 6}).status().message(), HasSubstr("slot 1 expert 6"));
  EXPECT_EQ((*model)->LoadLayer(0, {-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->LoadRouter(2).status().code(), absl::StatusCode::kInvalidArgument);

  // A config that claims more experts than the tensors hold is a wrong-model error, not a read
  // past the end of the mapping.
  const std::string other = FreshDir("mismatch_config");
  GenerateOptions more = Options(WeightFormat::kMxfp4, 1);
  more.experts = 8;
  ASSERT_TRUE(GenerateModel(more, other).ok());
  std::filesystem::copy_file(other + "/config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  model = ExpertModel::Open(dir);
  ASSERT_TRUE(model.ok());
  absl::StatusOr<std::unique_ptr<LoadedLayer>> wrong = (*model)->LoadLayer(0, {7});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("config.json implies U8 [8, 64, 2, 16]"));
  EXPECT_EQ(ExpertModel::Open(FreshDir("nothing")).status().code(), absl::StatusCode::kNotFound);
}

TEST(ExpertModelTest, Routers) {
  for (WeightFormat format : {WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    const std::string dir = FreshDir("router");
    ASSERT_TRUE(GenerateModel(Options(format, 3), dir).ok());
    absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
    ASSERT_TRUE(model.ok());
    absl::StatusOr<RouterWeights> router = (*model)->LoadRouter(1);
    ASSERT_TRUE(router.ok()) << router.status();
    const Raw raw = OpenRaw(dir);
    const bool gpt_oss = format == WeightFormat::kMxfp4;
    const std::string p = gpt_oss ? "model.layers.1.mlp.router." : "model.layers.1.mlp.gate.";
    EXPECT_EQ(router->weight.shape(), Shape({kExperts, kHidden}));
    EXPECT_EQ(Widen(router->weight.data<float>(), kExperts * kHidden),
              RefBf16Row(raw.Get(p + "weight"), 0, kExperts * kHidden));
    const RoutingParams params = router->Params((*model)->config());
    EXPECT_EQ(params.top_k, 2);
    if (gpt_oss) {
      EXPECT_EQ(Widen(router->bias.data<float>(), kExperts),
                RefBf16Row(raw.Get(p + "bias"), 0, kExperts));
      EXPECT_EQ(params.method, RoutingMethod::kRenormalize);
      EXPECT_EQ(params.router_bias.data, router->bias.view().data);
      EXPECT_FALSE(params.correction_bias.present());
    } else {
      const SafetensorsTensor bias = raw.Get(p + "e_score_correction_bias");
      EXPECT_EQ(std::memcmp(router->correction_bias.data<float>(), bias.data, kExperts * 4), 0);
      EXPECT_EQ(params.method, RoutingMethod::kDeepSeekV3);
      EXPECT_EQ(params.n_group, 2);
      EXPECT_EQ(params.correction_bias.data, router->correction_bias.view().data);
      EXPECT_FALSE(params.router_bias.present());
    }
  }
}

// One expert in fp64 from independently decoded weights: w13 [2I, H] and w2 [H, I] with global
// scales applied, optional biases.
struct DenseExpert {
  std::vector<float> w13, w2, b13, b2;
};

DenseExpert DenseFromRaw(const Raw& raw, WeightFormat format, int64_t layer, int64_t e) {
  const int64_t h = kHidden, i = kInter;
  DenseExpert d;
  if (format == WeightFormat::kMxfp4) {
    const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.");
    d.w13 = RefDequantMxfp4(raw.Get(p + "gate_up_proj_blocks").data + e * 2 * i * h / 2,
                            raw.Get(p + "gate_up_proj_scales").data + e * 2 * i * h / 32, 2 * i, h);
    d.w2 = RefDequantMxfp4(raw.Get(p + "down_proj_blocks").data + e * h * i / 2,
                           raw.Get(p + "down_proj_scales").data + e * h * i / 32, h, i);
    d.b13 = RefBf16Row(raw.Get(p + "gate_up_proj_bias"), e * 2 * i, 2 * i);
    d.b2 = RefBf16Row(raw.Get(p + "down_proj_bias"), e * h, h);
    return d;
  }
  const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.", e, ".");
  auto decode = [&](const char* proj, int64_t rows, int64_t cols) {
    const std::string q = p + proj;
    return RefDequantNvfp4(raw.Get(q + ".weight").data, raw.Get(q + ".weight_scale").data, rows,
                           cols, raw.Scalar(q + ".weight_scale_2"));
  };
  d.w13 = decode("gate_proj", i, h);
  const std::vector<float> up = decode("up_proj", i, h);
  d.w13.insert(d.w13.end(), up.begin(), up.end());
  d.w2 = decode("down_proj", h, i);
  return d;
}

// numerics.md section 6 for one token, written out directly.
std::vector<double> NaiveForward(const DenseExpert& d, const ActivationParams& act,
                                 GateUpLayout layout, const float* x) {
  const int64_t h = kHidden, i = kInter;
  std::vector<double> hid(2 * i), a(i), y(h);
  for (int64_t r = 0; r < 2 * i; ++r) {
    double sum = d.b13.empty() ? 0.0 : d.b13[r];
    for (int64_t k = 0; k < h; ++k) sum += double{d.w13[r * h + k]} * x[k];
    hid[r] = sum;
  }
  for (int64_t j = 0; j < i; ++j) {
    const bool interleaved = layout == GateUpLayout::kInterleaved;
    double g = hid[interleaved ? 2 * j : j], u = hid[interleaved ? 2 * j + 1 : i + j];
    if (act.kind == ActivationKind::kSwigluOai) {
      g = std::min<double>(g, act.limit);
      u = std::clamp<double>(u, -act.limit, act.limit);
      a[j] = (u + 1) * g / (1 + std::exp(-act.alpha * g));
    } else {
      a[j] = g / (1 + std::exp(-g)) * u;
    }
  }
  for (int64_t n = 0; n < h; ++n) {
    double sum = d.b2.empty() ? 0.0 : d.b2[n];
    for (int64_t j = 0; j < i; ++j) sum += double{d.w2[n * i + j]} * a[j];
    y[n] = sum;
  }
  return y;
}

// The loaded layer runs through the CPU reference and matches the naive forward pass over the
// raw decode: checks gate/up placement, global scales and biases end to end.
TEST(ExpertModelTest, LoadedLayerComputesTheModel) {
  for (WeightFormat format : {WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(WeightFormatName(format));
    const std::string dir = FreshDir("compute");
    GenerateOptions options = Options(format, 1);
    options.n_shared_experts = 0;
    ASSERT_TRUE(GenerateModel(options, dir).ok());
    absl::StatusOr<std::unique_ptr<ExpertModel>> model = ExpertModel::Open(dir);
    ASSERT_TRUE(model.ok());
    const std::vector<int32_t> slots = {4, 0};
    absl::StatusOr<std::unique_ptr<LoadedLayer>> loaded = (*model)->LoadLayer(1, slots);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const ExpertLayer& layer = (*loaded)->layer();

    constexpr int64_t kTokens = 3, kTopK = 2;
    HostTensor x(DType::kF32, {kTokens, kHidden}), out(DType::kF32, {kTokens, kHidden});
    for (int64_t k = 0; k < kTokens * kHidden; ++k) {
      x.data<float>()[k] = static_cast<float>(std::sin(0.37 * k + 1.0));
    }
    const int32_t ids[kTokens][kTopK] = {{0, 1}, {1, -1}, {-1, 0}};
    const float weights[kTokens][kTopK] = {{0.7f, 0.3f}, {1.f, 0.f}, {0.f, 0.5f}};
    ExpertsRequest request;
    request.hidden_states = x.view();
    request.local_ids = MakeView(DType::kI32, {kTokens, kTopK}, &ids[0][0]);
    request.topk_weights = MakeView(DType::kF32, {kTokens, kTopK}, &weights[0][0]);
    request.out = out.view();
    ASSERT_TRUE(RunExpertsReference(layer, request).ok());

    const Raw raw = OpenRaw(dir);
    const DenseExpert dense[2] = {DenseFromRaw(raw, format, 1, 4), DenseFromRaw(raw, format, 1, 0)};
    for (int64_t t = 0; t < kTokens; ++t) {
      std::vector<double> expected(kHidden, 0.0);
      for (int k = 0; k < kTopK; ++k) {
        if (ids[t][k] < 0) continue;
        const std::vector<double> y = NaiveForward(dense[ids[t][k]], layer.activation, layer.layout,
                                                   x.data<float>() + t * kHidden);
        for (int64_t n = 0; n < kHidden; ++n) expected[n] += weights[t][k] * y[n];
      }
      for (int64_t n = 0; n < kHidden; ++n) {
        EXPECT_NEAR(out.data<float>()[t * kHidden + n], expected[n],
                    1e-4 * (1 + std::fabs(expected[n])))
            << "token " << t << " column " << n;
      }
    }
  }
}

}  // namespace
}  // namespace moe::model
