// GPU correctness of the CUDA expert backend against the CPU reference (RunExpertsReference) on
// fresh random data every run: relative error ||out - ref|| / ||ref|| <= 1e-2, no NaN (the output
// and every intermediate device buffer are poisoned with NaN first), bitwise repeatable results.
// Sweeps MXFP4 and NVFP4, all activations, both gate/up layouts, with and without biases, shared
// experts, F32 and BF16 in and out, shapes that need padding, and unrouted (-1) ids.
// Tagged `gpu`; skips where the binary has no CUDA or the machine no device.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/experts.h"
#include "kernels/formats.h"

namespace moe {
namespace {

// GemmLaunch::variant 0..13 (kernels/cuda/expert_kernels.h; that header needs CUDA, this test
// builds without it too; batches of items of 32 or 64 tokens run the tiled kernels, whose variants
// 4..8 are the bulk weight ring), each with direct routes allowed (used where no expert has two
// routes, e.g. T=1; variants 0, 1, 4, 6 and 8..13 then fold the combine into GEMM2, 2, 5 and 7 do
// not) and the wgmma kernel off; variants 0, 4 and 12 with the grouped path always, 12 also with
// the combine folded into GEMM2 for grouped routes ("f"); variant 10 with every L2 prefetch hint on
// (bits 7, "p"); the wgmma kernel for every batch (wgmma_min_tokens 1, items of up to 144 tokens)
// in its three configurations (0: 4 warpgroups x 1 m64 block, shared-memory weight ring; 1: 2 x 2,
// register ring; 2: 4 x 1, register ring: printed "w0".."w2"); and the defaults (per-batch choice,
// "v-1"), once more with the fused layer kernel for every direct batch that fits ("v-1dF"; by
// default only batches that stream at least 1 MB of weights per SM take it), and once with GEMM2
// waiting for the whole GEMM1 grid instead of per item ("v-1dW"). The defaults case picks per-item
// readiness per batch as the backend does; every other mma.sync case forces it on. The variant
// cases 6 and 12 put the MXFP4 block scale on the accumulators (CudaBackendOptions::acc_scale,
// "v6ds", "v12ds"); the defaults (variants 6 and 12 among them) on the decoded weights.
constexpr int kGemmVariants = 14;
struct BackendCase {
  int variant;
  bool direct;
  int wgmma_min_tokens;  // 0: off, 1: always, -1: the runner's default
  int l2_prefetch = -1;  // bulk-copy variants 8..13: ExpertRunner::set_l2_prefetch
  bool fold_grouped = false;  // ExpertRunner::set_fold_grouped
  bool byte_savers = true;    // CudaBackendOptions::wgmma_byte_savers
  bool l2_ahead = false;      // CudaBackendOptions::wgmma_l2_ahead
  int fused_layer = -1;       // CudaBackendOptions::fused_layer (the per-batch default only)
  int item_ready = 1;         // CudaBackendOptions::item_ready
  bool acc_scale = false;     // CudaBackendOptions::acc_scale
  int persistent = -1;        // CudaBackendOptions::wgmma_persistent
};
const BackendCase kBackendCases[] = {
    {0, true, 0},  {1, true, 0},  {2, true, 0},  {3, true, 0},        {4, true, 0},
    {5, true, 0},  {6, true, 0, -1, false, true, false, -1, 1, true},  {7, true, 0},
    {8, true, 0},  {9, true, 0},  {10, true, 0}, {11, true, 0},
    {12, true, 0, -1, false, true, false, -1, 1, true},  {13, true, 0},  {0, false, 0},
    {4, false, 0}, {12, false, 0}, {12, false, 0, -1, true},          {10, true, 0, 7},
    {0, true, 1},  {1, true, 1},  {2, true, 1},
    {-1, true, -1, -1, false, true, false, -1, -1},  // the backend's defaults
    // wgmma variant 0 with the hidden rows staged and y in F32, and with L2 ahead.
    {0, true, 1, -1, false, false}, {0, true, 1, -1, false, true, true},
    // The defaults with the fused layer kernel for every direct batch that fits.
    {-1, true, -1, -1, false, true, false, 1},
    // The defaults with GEMM2 waiting for the whole GEMM1 grid instead of per item.
    {-1, true, -1, -1, false, true, false, -1, 0},
    // wgmma variant 0 with persistent CTAs for every format, and with one tile per CTA for every
    // format (the default: persistent for NVFP4 only).
    {0, true, 1, -1, false, true, false, -1, 1, false, 1},
    {0, true, 1, -1, false, true, false, -1, 1, false, 0}};

struct LayerCase {
  std::string name;
  WeightFormat format;
  ActivationParams act;
  GateUpLayout layout;
  int64_t hidden;
  int64_t inter;
  int experts;
  int top_k;
  bool biases;
  int shared;
  DType in;
  DType out;
  std::vector<int64_t> tokens;
};

// Storage of one random expert; views in `w` point into it.
struct HostExpert {
  std::vector<uint8_t> v13, s13, v2, s2;
  std::vector<float> b13, b2;
  ExpertWeights w;
};

// UE8M0 byte (or E4M3 target) that makes the dequantized weights have RMS about 1/sqrt(cols):
// random E2M1 codes have RMS 2.93.
double TargetScale(int64_t cols) { return 1.0 / (2.93 * std::sqrt(static_cast<double>(cols))); }

void FillMatrix(WeightFormat format, int64_t rows, int64_t cols, float global_scale,
                std::mt19937_64& rng, std::vector<uint8_t>& values, std::vector<uint8_t>& scales,
                WeightMatrix& m) {
  const int64_t block = format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  values.resize(rows * cols / 2);
  scales.resize(rows * cols / block);
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& v : values) v = static_cast<uint8_t>(byte(rng));
  const double target = TargetScale(cols);
  if (format == WeightFormat::kMxfp4) {
    const int center = 127 + static_cast<int>(std::lround(std::log2(target)));
    std::uniform_int_distribution<int> b(center - 1, center + 1);
    for (uint8_t& s : scales) s = static_cast<uint8_t>(b(rng));
  } else {
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    for (uint8_t& s : scales) {
      s = FloatToE4m3(static_cast<float>(target / global_scale * jitter(rng)));
    }
  }
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  m.values = MakeView(DType::kU8, {rows, cols / 2}, values.data());
  m.scales = MakeView(format == WeightFormat::kMxfp4 ? DType::kU8 : DType::kE4M3,
                      {rows, cols / block}, scales.data());
}

std::unique_ptr<HostExpert> RandomExpert(const LayerCase& c, std::mt19937_64& rng) {
  auto e = std::make_unique<HostExpert>();
  std::uniform_real_distribution<float> global(0.5f, 2.f);
  if (c.format == WeightFormat::kNvfp4) {
    e->w.w13_gate_global_scale = global(rng);
    e->w.w13_up_global_scale = global(rng);
    e->w.w2_global_scale = global(rng);
  }
  // One global scale for both halves of w13 when quantizing: the gate's (the reference applies
  // each half's own factor afterwards, which only rescales the data).
  FillMatrix(c.format, 2 * c.inter, c.hidden, e->w.w13_gate_global_scale, rng, e->v13, e->s13,
             e->w.w13);
  FillMatrix(c.format, c.hidden, c.inter, e->w.w2_global_scale, rng, e->v2, e->s2, e->w.w2);
  if (c.biases) {
    std::normal_distribution<float> n13(0.f, 0.5f), n2(0.f, 0.1f);
    e->b13.resize(2 * c.inter);
    e->b2.resize(c.hidden);
    for (float& b : e->b13) b = n13(rng);
    for (float& b : e->b2) b = n2(rng);
    e->w.b13 = MakeView(DType::kF32, {2 * c.inter}, e->b13.data());
    e->w.b2 = MakeView(DType::kF32, {c.hidden}, e->b2.data());
  }
  return e;
}

struct HostLayer {
  std::vector<std::unique_ptr<HostExpert>> storage;
  ExpertLayer layer;
};

HostLayer RandomLayer(const LayerCase& c, std::mt19937_64& rng) {
  HostLayer h;
  h.layer.hidden = c.hidden;
  h.layer.intermediate = c.inter;
  h.layer.format = c.format;
  h.layer.layout = c.layout;
  h.layer.activation = c.act;
  for (int e = 0; e < c.experts + c.shared; ++e) {
    h.storage.push_back(RandomExpert(c, rng));
    (e < c.experts ? h.layer.experts : h.layer.shared_experts).push_back(h.storage.back()->w);
  }
  return h;
}

// One request's host tensors.
struct HostRequest {
  std::vector<uint8_t> hidden;  // F32 or BF16 bytes
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint8_t> mask;
  std::vector<uint8_t> out;
  ExpertsRequest request;
};

std::unique_ptr<HostRequest> RandomRequest(const LayerCase& c, int64_t tokens,
                                           std::mt19937_64& rng) {
  auto r = std::make_unique<HostRequest>();
  const size_t in_size = c.in == DType::kF32 ? 4 : 2;
  r->hidden.resize(tokens * c.hidden * in_size);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < tokens * c.hidden; ++i) {
    const float x = normal(rng);
    if (c.in == DType::kF32) {
      std::memcpy(&r->hidden[i * 4], &x, 4);
    } else {
      const uint16_t b = FloatToBf16(x);
      std::memcpy(&r->hidden[i * 2], &b, 2);
    }
  }
  // Distinct experts per token; about one route in eight is not routed here (-1).
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pool(c.experts);
    for (int e = 0; e < c.experts; ++e) pool[e] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int k = 0; k < c.top_k; ++k) {
      r->ids.push_back(unit(rng) < 0.125f ? -1 : pool[k]);
      r->weights.push_back(unit(rng));
    }
  }
  for (int64_t t = 0; t < tokens; ++t) r->mask.push_back(unit(rng) < 0.5f ? 1 : 0);
  // From two tokens on, the last one has no route at all (its output row must be zero; with
  // direct routes nothing but the prologue writes it).
  if (tokens >= 2) {
    for (int k = 0; k < c.top_k; ++k) r->ids[(tokens - 1) * c.top_k + k] = -1;
    r->mask[tokens - 1] = 0;
  }
  const size_t out_size = c.out == DType::kF32 ? 4 : 2;
  r->out.resize(tokens * c.hidden * out_size);
  ExpertsRequest& q = r->request;
  q.hidden_states = MakeView(c.in, {tokens, c.hidden}, r->hidden.data());
  q.local_ids = MakeView(DType::kI32, {tokens, c.top_k}, r->ids.data());
  q.topk_weights = MakeView(DType::kF32, {tokens, c.top_k}, r->weights.data());
  if (c.shared > 0) q.shared_mask = MakeView(DType::kBool, {tokens}, r->mask.data());
  q.out = MakeView(c.out, {tokens, c.hidden}, r->out.data());
  return r;
}

std::vector<double> OutputAsDouble(const TensorView& out) {
  std::vector<double> v(out.NumElements());
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = out.dtype == DType::kF32 ? out.As<const float>()[i]
                                    : Bf16ToFloat(out.As<const uint16_t>()[i]);
  }
  return v;
}

void Poison(HostRequest& r) {
  if (r.request.out.dtype == DType::kF32) {
    const float nan = std::nanf("");
    for (size_t i = 0; i < r.out.size(); i += 4) std::memcpy(&r.out[i], &nan, 4);
  } else {
    std::fill(r.out.begin(), r.out.end(), 0xFF);  // bf16 0xFFFF is a NaN
  }
}

class ExpertsCudaTest : public ::testing::TestWithParam<LayerCase> {
 protected:
  void SetUp() override {
    std::string why;
    if (cuda::DeviceCount(&why) == 0) GTEST_SKIP() << why;
    static_assert(sizeof(kBackendCases) / sizeof(kBackendCases[0]) == kGemmVariants + 15);
    for (const BackendCase& bc : kBackendCases) {
      CudaBackendOptions options;
      options.poison_scratch = true;
      options.gemm_variant = bc.variant;
      options.direct_routes = bc.direct;
      options.wgmma_min_tokens = bc.wgmma_min_tokens;
      options.l2_prefetch = bc.l2_prefetch;
      options.fold_grouped = bc.fold_grouped;
      options.wgmma_byte_savers = bc.byte_savers;
      options.wgmma_l2_ahead = bc.l2_ahead;
      options.fused_layer = bc.fused_layer;
      options.item_ready = bc.item_ready;
      options.acc_scale = bc.acc_scale;
      options.wgmma_persistent = bc.persistent;
      absl::StatusOr<std::unique_ptr<ExpertBackend>> b = MakeCudaExpertBackend(options);
      ASSERT_TRUE(b.ok()) << b.status();
      backends_.push_back(*std::move(b));
    }
  }
  // Every GEMM variant (expert_kernels.h GemmLaunch::variant) must match.
  std::vector<std::unique_ptr<ExpertBackend>> backends_;
};

// Relative error of `got` against `ref`, and the number of NaNs in `got`.
std::pair<double, int64_t> Compare(const std::vector<double>& got, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  int64_t nans = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) ++nans;
    diff += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return {std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30), nans};
}

TEST_P(ExpertsCudaTest, MatchesReference) {
  const LayerCase& c = GetParam();
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  HostLayer layer = RandomLayer(c, rng);
  ASSERT_TRUE(ValidateExpertLayer(layer.layer).ok());
  for (auto& backend : backends_) {
    ASSERT_TRUE(backend->CheckSupported(layer.layer).ok());
    ASSERT_TRUE(backend->PrepareLayer(3, layer.layer).ok());
  }
  for (int64_t tokens : c.tokens) {
    std::unique_ptr<HostRequest> r = RandomRequest(c, tokens, rng);
    ASSERT_TRUE(RunExpertsReference(layer.layer, r->request).ok());
    // The tile the plan picks (PlanRoutes, as the backend does), printed: for the C-routing case
    // at 96 tokens nearly always 8-token items with a few slots split in two.
    const cuda::RoutePlan plan =
        cuda::PlanRoutes(r->ids.data(), tokens, c.top_k, nullptr, c.experts, 0);
    std::printf("[plan] %s T=%lld token_groups=%d items=%lld active=%d max=%d\n", c.name.c_str(),
                static_cast<long long>(tokens), plan.token_groups,
                static_cast<long long>(plan.num_items), plan.active_slots, plan.max_count);
    const std::vector<double> ref = OutputAsDouble(r->request.out);
    for (size_t variant = 0; variant < backends_.size(); ++variant) {
      ExpertBackend& backend = *backends_[variant];
      Poison(*r);
      absl::Status s = backend.Run(3, layer.layer, r->request);
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<double> got = OutputAsDouble(r->request.out);
      const std::vector<uint8_t> first = r->out;
      Poison(*r);
      ASSERT_TRUE(backend.Run(3, layer.layer, r->request).ok());
      EXPECT_EQ(r->out, first) << "second run differs (not bitwise repeatable)";
      const auto [rel, nans] = Compare(got, ref);
      std::printf("[cuda-vs-ref] %-30s %s%d%s%s T=%-5lld rel_err=%.3e nan=%lld seed=%llu\n",
                  c.name.c_str(), kBackendCases[variant].wgmma_min_tokens == 1 ? "w" : "v",
                  kBackendCases[variant].variant, kBackendCases[variant].direct ? "d" : "g",
                  kBackendCases[variant].l2_prefetch >= 0      ? "p"
                  : kBackendCases[variant].fold_grouped ? "f"
                  : !kBackendCases[variant].byte_savers ? "o"
                  : kBackendCases[variant].l2_ahead     ? "a"
                  : kBackendCases[variant].fused_layer == 1 ? "F"
                  : kBackendCases[variant].item_ready == 0 ? "W"
                  : kBackendCases[variant].acc_scale      ? "s"
                  : kBackendCases[variant].persistent == 1 ? "P"
                  : kBackendCases[variant].persistent == 0 ? "n"
                                                        : "",
                  static_cast<long long>(tokens), rel,
                  static_cast<long long>(nans), static_cast<unsigned long long>(seed));
      EXPECT_EQ(nans, 0) << c.name << " v" << variant << " T=" << tokens;
      EXPECT_LE(rel, 1e-2) << c.name << " v" << variant << " T=" << tokens << " seed=" << seed;
    }
  }
}

ActivationParams Act(ActivationKind kind, float beta = 1.f, float linear_beta = 0.f) {
  ActivationParams p;
  p.kind = kind;
  p.beta = beta;
  p.linear_beta = linear_beta;
  return p;
}

const std::vector<int64_t> kTokens = {1, 2, 7, 64, 333};
constexpr auto kMx = WeightFormat::kMxfp4;
constexpr auto kNv = WeightFormat::kNvfp4;
constexpr auto kIl = GateUpLayout::kInterleaved;
constexpr auto kCat = GateUpLayout::kConcatenated;

INSTANTIATE_TEST_SUITE_P(
    Sweep, ExpertsCudaTest,
    ::testing::Values(
        LayerCase{"mxfp4_swigluoai_gptoss_2880", kMx, Act(ActivationKind::kSwigluOai), kIl, 2880,
                  2880, 8, 4, true, 0, DType::kBF16, DType::kBF16, kTokens},
        LayerCase{"nvfp4_swigluoai_2880", kNv, Act(ActivationKind::kSwigluOai), kCat, 2880, 2880,
                  4, 2, true, 0, DType::kF32, DType::kF32, {1, 2, 7, 64, 333}},
        LayerCase{"nvfp4_silu_concat", kNv, Act(ActivationKind::kSilu), kCat, 512, 256, 16, 2,
                  false, 0, DType::kF32, DType::kF32, kTokens},
        LayerCase{"mxfp4_gelu_concat_padded", kMx, Act(ActivationKind::kGelu), kCat, 288, 160, 32,
                  8, true, 0, DType::kBF16, DType::kF32, kTokens},
        LayerCase{"nvfp4_situ_lb_interleaved_pad", kNv, Act(ActivationKind::kSitu, 1.5f, 2.f),
                  kIl, 336, 208, 6, 3, true, 0, DType::kF32, DType::kBF16, kTokens},
        LayerCase{"nvfp4_gelu_tanh_shared", kNv, Act(ActivationKind::kGeluTanh), kCat, 256, 128,
                  12, 4, true, 2, DType::kBF16, DType::kBF16, kTokens},
        LayerCase{"mxfp4_situ_interleaved", kMx, Act(ActivationKind::kSitu, 2.f, 0.f), kIl, 1024,
                  512, 64, 6, false, 1, DType::kF32, DType::kF32, kTokens},
        LayerCase{"mxfp4_silu_large_T", kMx, Act(ActivationKind::kSilu), kIl, 256, 128, 64, 4,
                  true, 0, DType::kBF16, DType::kBF16, {4096, 8192}},
        // Problem C's routing at 64 tokens (E=128, top-8): a few slots over 8 tokens, so the
        // plan takes 8-token items and splits those slots (PlanRoutes).
        LayerCase{"mxfp4_silu_c_routing", kMx, Act(ActivationKind::kSilu), kCat, 256, 128, 128,
                  8, false, 0, DType::kBF16, DType::kBF16, {64, 96}},
        // Large T on padded shapes (H, I not multiples of 64) for the wgmma kernel; H = I = 2880
        // with 144-token items and remainders: the two 2880 cases above at T = 333 (v4, v5).
        LayerCase{"nvfp4_situ_large_T_pad", kNv, Act(ActivationKind::kSitu, 1.5f, 2.f), kIl, 336,
                  208, 24, 3, true, 1, DType::kF32, DType::kBF16, {4096, 8192}},
        LayerCase{"mxfp4_gelu_large_T_pad", kMx, Act(ActivationKind::kGelu), kCat, 288, 160, 16,
                  2, true, 0, DType::kBF16, DType::kF32, {4096}}),
    [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

}  // namespace
}  // namespace moe
