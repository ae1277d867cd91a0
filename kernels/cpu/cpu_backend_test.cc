// The optimized CPU backend against the CPU reference (RunExpertsReference) over the reference's
// own sweep of shapes, formats, layouts, activations, biases, shared experts and unrouted slots,
// for every instruction set this processor has (the AVX2 path always, forced) and 1 and 2
// threads; outputs are poisoned with NaN before every run. Also: results are bit-identical across
// thread counts and instruction sets, and the error paths.
#include "kernels/cpu/cpu_backend.h"

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/random_layer.h"
#include "kernels/experts.h"
#include "kernels/sweep_cases.h"

namespace moe {
namespace {

using sweep::SweepCase;

using cpu::MakeRandomLayer;
using cpu::MakeRandomRequest;
using cpu::OwnedRequest;
using cpu::RandomLayerSpec;
using cpu::RandomRequestSpec;

constexpr WeightFormat kMx = WeightFormat::kMxfp4;
constexpr WeightFormat kNv = WeightFormat::kNvfp4;
constexpr WeightFormat kBf = WeightFormat::kBf16;
constexpr GateUpLayout kInter = GateUpLayout::kInterleaved;
constexpr GateUpLayout kConcat = GateUpLayout::kConcatenated;
constexpr DType kF = DType::kF32;
constexpr DType kB = DType::kBF16;


// The instruction sets to test here: AVX2 always, the wider ones when present.
std::vector<std::string> IsasHere() {
  std::vector<std::string> isas = {"avx2"};
  const cpu::CpuFeatures f = cpu::DetectCpuFeatures();
  for (const char* name : {"avx512", "avx512vnni"}) {
    if (cpu::ChooseIsa(name, f).ok()) isas.push_back(name);
  }
  return isas;
}

ActivationParams ParamsFor(ActivationKind kind, bool bias) {
  ActivationParams p;
  p.kind = kind;
  p.limit = 2.5f;  // low enough that SWIGLUOAI's clamps act on unit-variance inputs
  p.beta = 2.f;
  p.linear_beta = bias ? 3.f : 0.f;
  return p;
}

// Relative error of `got` against the reference output `want` (both F32 or both BF16).
double RelativeError(const OwnedRequest& got, const OwnedRequest& want) {
  double diff2 = 0, ref2 = 0;
  for (int64_t i = 0; i < want.tokens * want.hidden; ++i) {
    const double d = static_cast<double>(got.Out(i)) - want.Out(i);
    diff2 += d * d;
    ref2 += static_cast<double>(want.Out(i)) * want.Out(i);
  }
  if (!std::isfinite(diff2)) return INFINITY;
  return ref2 == 0 ? std::sqrt(diff2) : std::sqrt(diff2 / ref2);
}

// FP4 activations are rounded to int16 per block (relative 2^-15 of the block maximum; measured
// 6e-5 to 1.1e-4 over this sweep) or, with int8-w13, to int8 into w13 on the panel path (measured
// 5e-3 to 7e-3); BF16 weights run in fp32 like the reference; BF16 outputs may round either way.
double Tolerance(const SweepCase& c, const std::string& activations) {
  if (c.out_dtype == kB || activations != "int16") return 1e-2;
  return c.format == kBf ? 1e-5 : 4e-4;
}

class CpuBackendSweepTest : public testing::TestWithParam<SweepCase> {};

TEST_P(CpuBackendSweepTest, MatchesReference) {
  const SweepCase& c = GetParam();
  const uint64_t seed = std::hash<std::string>{}(c.name);
  auto owned =
      MakeRandomLayer(RandomLayerSpec{c.format, c.layout, ParamsFor(c.act, c.bias), c.hidden,
                                      c.inter, c.experts, c.shared, c.bias, seed});
  const ExpertLayer& layer = owned->layer;
  ASSERT_TRUE(ValidateExpertLayer(layer).ok());
  OwnedRequest want = MakeRandomRequest(
      layer, RandomRequestSpec{c.tokens, c.k, c.in_dtype, c.out_dtype, 0.25, c.shared > 0, seed});
  // Every eighth token has no local route at all.
  for (int64_t t = 5; t < c.tokens; t += 8) {
    for (int64_t k = 0; k < c.k; ++k) want.ids[t * c.k + k] = -1;
  }
  ASSERT_TRUE(RunExpertsReference(layer, want.Request()).ok());

  for (const std::string activations : {"int16", "int8-w13"}) {
    std::vector<OwnedRequest> results;
    for (const std::string& isa : IsasHere()) {
      for (int threads : {1, 2}) {
        SCOPED_TRACE(activations + " " + isa + " x" + std::to_string(threads));
        absl::StatusOr<std::unique_ptr<ExpertBackend>> backend =
            MakeCpuBackend(CpuBackendOptions{threads, isa, activations});
        ASSERT_TRUE(backend.ok()) << backend.status();
        ASSERT_TRUE((*backend)->PrepareLayer(3, layer).ok());
        OwnedRequest got = want;
        for (int run = 0; run < 2; ++run) {  // the second run reuses the workspace
          got.Poison();
          ASSERT_TRUE((*backend)->Run(3, layer, got.Request()).ok());
          const double error = RelativeError(got, want);
          EXPECT_LE(error, Tolerance(c, activations)) << "run " << run;
          if (run == 0 && isa == "avx2" && threads == 1) {
            RecordProperty(activations + "_relative_error", std::to_string(error));
          }
        }
        for (int64_t t = 0; t < c.tokens; ++t) {
          bool touched = !want.mask.empty() && want.mask[t] != 0 && c.shared > 0;
          for (int64_t k = 0; k < c.k; ++k) touched |= want.ids[t * c.k + k] >= 0;
          if (touched) continue;
          for (int64_t n = 0; n < c.hidden; ++n) ASSERT_EQ(got.Out(t * c.hidden + n), 0.f) << t;
        }
        results.push_back(std::move(got));
      }
    }
    // Fixed reduction orders and exact integer sums: every thread count and instruction set
    // gives the same bits.
    for (size_t i = 1; i < results.size(); ++i) {
      EXPECT_EQ(results[i].out_f32, results[0].out_f32) << activations << " " << i;
      EXPECT_EQ(results[i].out_bf16, results[0].out_bf16) << activations << " " << i;
    }
  }
}

std::vector<SweepCase> ShapeCases() {
  using A = ActivationKind;
  return {
      {"GptOssFull", kMx, kInter, A::kSwigluOai, 1, 1, 1, 2880, 2880, true, 0, kB, kB},
      {"GptOssFullF32", kMx, kInter, A::kSwigluOai, 3, 4, 2, 2880, 2880, true, 0, kF, kF},
      {"Nvfp4Full", kNv, kConcat, A::kSilu, 3, 1, 1, 2880, 2880, false, 0, kF, kF},
      {"WideHidden", kNv, kConcat, A::kSilu, 17, 4, 2, 2880, 160, true, 1, kF, kF},
      {"WideHiddenMx", kMx, kInter, A::kGelu, 64, 7, 4, 2880, 96, false, 0, kB, kF},
      {"WideHiddenBf16", kBf, kConcat, A::kSitu, 3, 4, 4, 2880, 64, true, 2, kF, kB},
      {"WideInter", kMx, kConcat, A::kGeluTanh, 3, 4, 2, 96, 2880, true, 1, kF, kF},
      {"NoTokens", kMx, kInter, A::kSilu, 0, 4, 2, 96, 160, true, 1, kF, kF},
      {"NoTokensBf16", kNv, kConcat, A::kSilu, 0, 1, 1, 96, 160, false, 0, kB, kB},
      {"OneToken", kNv, kInter, A::kSwigluOai, 1, 7, 4, 96, 160, true, 0, kF, kF},
      {"ManyTokensTopOne", kBf, kInter, A::kSilu, 64, 7, 1, 160, 96, false, 1, kB, kF},
      {"ManyTokensTopFour", kNv, kConcat, A::kGelu, 64, 4, 4, 96, 160, true, 2, kF, kF},
      {"SeventeenTokens", kMx, kConcat, A::kSitu, 17, 7, 2, 224, 96, false, 1, kF, kB},
      {"SingleExpert", kMx, kInter, A::kGeluTanh, 17, 1, 1, 96, 160, true, 0, kB, kB},
      {"TwoHundredTokensMx", kMx, kInter, A::kSwigluOai, 200, 8, 4, 96, 160, true, 1, kF, kF},
      {"TwoHundredTokensNv", kNv, kConcat, A::kSilu, 200, 6, 3, 160, 96, false, 0, kB, kF},
      {"TwoHundredTokensBf16", kBf, kConcat, A::kGelu, 200, 5, 2, 100, 72, true, 0, kF, kF},
      {"OddBf16Shapes", kBf, kInter, A::kSwigluOai, 17, 3, 2, 37, 13, true, 1, kB, kF},
      {"NarrowNvfp4", kNv, kInter, A::kGelu, 17, 4, 2, 48, 16, true, 1, kF, kF},
      {"PanelAcrossBlocks", kMx, kConcat, A::kSilu, 64, 2, 2, 1056, 608, true, 0, kF, kF},
  };
}

// Every format x layout x activation, the other axes cycling through these shapes (those of
// kernels/experts_test.cc plus a 200-token one).
std::vector<SweepCase> ComboCases() {
  return sweep::ComboCases({{3, 4, 2, 96, 160}, {17, 7, 4, 160, 96}, {1, 1, 1, 32, 32},
                            {64, 4, 1, 64, 224}, {17, 4, 4, 96, 96}, {3, 7, 2, 224, 32},
                            {200, 5, 3, 64, 96}});
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuBackendSweepTest, testing::ValuesIn(ShapeCases()),
                         sweep::SweepCaseName);
INSTANTIATE_TEST_SUITE_P(Combos, CpuBackendSweepTest, testing::ValuesIn(ComboCases()),
                         sweep::SweepCaseName);

// ---- Errors and options -------------------------------------------------------------------------

RandomLayerSpec SmallSpec() {
  return RandomLayerSpec{kMx,  kInter, ParamsFor(ActivationKind::kSilu, true), 64, 32, 3, 0,
                         true, 7};
}

TEST(CpuBackendTest, RunWithoutPrepareIsFailedPrecondition) {
  auto owned = MakeRandomLayer(SmallSpec());
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend.ok());
  OwnedRequest in = MakeRandomRequest(owned->layer, RandomRequestSpec{2, 2});
  EXPECT_EQ((*backend)->Run(0, owned->layer, in.Request()).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*backend)->PrepareLayer(0, owned->layer).ok());
  EXPECT_TRUE((*backend)->Run(0, owned->layer, in.Request()).ok());
  EXPECT_EQ((*backend)->Run(1, owned->layer, in.Request()).code(),
            absl::StatusCode::kFailedPrecondition);
  // Another layer (other weight buffers) under a prepared index is not mistaken for it.
  auto other = MakeRandomLayer(SmallSpec());
  EXPECT_EQ((*backend)->Run(0, other->layer, in.Request()).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CpuBackendTest, KeepsThePreviousVersionOfALayer) {
  auto first = MakeRandomLayer(SmallSpec());
  auto second = MakeRandomLayer(SmallSpec());
  auto third = MakeRandomLayer(SmallSpec());
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend.ok());
  OwnedRequest in = MakeRandomRequest(first->layer, RandomRequestSpec{2, 2});
  ASSERT_TRUE((*backend)->PrepareLayer(0, first->layer).ok());
  ASSERT_TRUE((*backend)->PrepareLayer(0, second->layer).ok());
  EXPECT_TRUE((*backend)->Run(0, first->layer, in.Request()).ok());
  EXPECT_TRUE((*backend)->Run(0, second->layer, in.Request()).ok());
  ASSERT_TRUE((*backend)->PrepareLayer(0, third->layer).ok());
  EXPECT_EQ((*backend)->Run(0, first->layer, in.Request()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*backend)->Run(0, third->layer, in.Request()).ok());
}

// The shard prepares a new placement's weights while requests of the old one still run.
TEST(CpuBackendTest, PrepareWhileRunningThePreviousVersion) {
  auto old_layer = MakeRandomLayer(SmallSpec());
  auto new_layer = MakeRandomLayer(SmallSpec());
  auto backend = MakeCpuBackend({2, "auto"});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->PrepareLayer(0, old_layer->layer).ok());
  OwnedRequest want = MakeRandomRequest(old_layer->layer, RandomRequestSpec{9, 2});
  ASSERT_TRUE(RunExpertsReference(old_layer->layer, want.Request()).ok());
  std::thread prepare([&] {
    for (int i = 0; i < 10; ++i) {
      EXPECT_TRUE((*backend)->PrepareLayer(0, new_layer->layer).ok());  // same weights: replaced
      EXPECT_TRUE((*backend)->PrepareLayer(1, new_layer->layer).ok());
    }
  });
  for (int i = 0; i < 50; ++i) {
    OwnedRequest got = want;
    got.Poison();
    ASSERT_TRUE((*backend)->Run(0, old_layer->layer, got.Request()).ok()) << i;
    EXPECT_LE(RelativeError(got, want), 4e-4);
  }
  prepare.join();
}

TEST(CpuBackendTest, InvalidRequestIsInvalidArgument) {
  auto owned = MakeRandomLayer(SmallSpec());
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->PrepareLayer(0, owned->layer).ok());
  OwnedRequest in = MakeRandomRequest(owned->layer, RandomRequestSpec{2, 2});
  in.ids[1] = 3;  // only 3 experts
  EXPECT_EQ((*backend)->Run(0, owned->layer, in.Request()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendTest, InvalidLayerIsRejectedAtPrepare) {
  auto owned = MakeRandomLayer(SmallSpec());
  owned->layer.experts[1].w2.cols = 16;
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ((*backend)->PrepareLayer(0, owned->layer).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendTest, Options) {
  EXPECT_EQ(MakeCpuBackend({0, "sse2"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCpuBackend({0, "auto", "int4"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCpuBackend({-1, "auto"}).status().code(), absl::StatusCode::kInvalidArgument);
  const cpu::CpuFeatures f = cpu::DetectCpuFeatures();
  auto avx512 = MakeCpuBackend({0, "avx512"});
  EXPECT_EQ(avx512.ok(), f.avx512f && f.avx512bw && f.avx512vl) << avx512.status();
  auto backend = MakeCpuBackend({3, "avx2"});
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_NE((*backend)->device().find("3 threads, avx2 kernels"), std::string::npos)
      << (*backend)->device();
}

// More tokens than one pass holds: the slices must line up.
TEST(CpuBackendTest, RequestsLargerThanOnePass) {
  RandomLayerSpec spec = SmallSpec();
  spec.format = kNv;
  auto owned = MakeRandomLayer(spec);
  OwnedRequest want = MakeRandomRequest(owned->layer, RandomRequestSpec{2500, 2, kB, kF});
  ASSERT_TRUE(RunExpertsReference(owned->layer, want.Request()).ok());
  auto backend = MakeCpuBackend({2, "auto"});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->PrepareLayer(0, owned->layer).ok());
  OwnedRequest got = want;
  got.Poison();
  ASSERT_TRUE((*backend)->Run(0, owned->layer, got.Request()).ok());
  EXPECT_LE(RelativeError(got, want), 4e-4);
}

}  // namespace
}  // namespace moe
