#include "kernels/routing.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

// Owns the buffers of one Route call.
struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

TensorView F32(std::vector<float>& v, Shape shape) {
  return MakeView(DType::kF32, std::move(shape), v.data());
}

absl::StatusOr<Routed> RunRoute(const RoutingParams& params, std::vector<float> logits,
                                int64_t num_experts) {
  const int64_t tokens = static_cast<int64_t>(logits.size()) / num_experts;
  Routed out;
  out.ids.assign(tokens * params.top_k, -7);
  out.weights.assign(tokens * params.top_k, -7.f);
  absl::Status s = Route(params, F32(logits, {tokens, num_experts}),
                         MakeView(DType::kI32, {tokens, params.top_k}, out.ids.data()),
                         MakeView(DType::kF32, {tokens, params.top_k}, out.weights.data()));
  if (!s.ok()) return s;
  return out;
}

RoutingParams Params(RoutingMethod method, int32_t top_k) {
  RoutingParams p;
  p.method = method;
  p.top_k = top_k;
  return p;
}

constexpr float kTol = 2e-6f;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(RoutingMethodNameTest, RoundTrips) {
  const std::pair<RoutingMethod, const char*> cases[] = {
      {RoutingMethod::kDefault, "default"},
      {RoutingMethod::kRenormalize, "renormalize"},
      {RoutingMethod::kRenormalizeNaive, "renormalize_naive"},
      {RoutingMethod::kDeepSeekV3, "deepseek_v3"},
      {RoutingMethod::kSigmoid, "sigmoid"},
      {RoutingMethod::kSigmoidRenorm, "sigmoid_renorm"}};
  for (const auto& [method, name] : cases) {
    EXPECT_EQ(RoutingMethodName(method), name);
    auto parsed = ParseRoutingMethod(name);
    ASSERT_TRUE(parsed.ok()) << name;
    EXPECT_EQ(*parsed, method);
  }
  EXPECT_EQ(ParseRoutingMethod("DeepSeekV3").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRoutingMethod("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RouteTest, DefaultIsSoftmaxTopKNotRenormalized) {
  // z = [1, 2, 3, 0]; sum of exp = e + e^2 + e^3 + 1 = 31.193...;
  // p[2] = e^3 / 31.193 = 0.6439142598879724, p[1] = e^2 / 31.193 = 0.23688281808991016.
  auto r = RunRoute(Params(RoutingMethod::kDefault, 2), {1, 2, 3, 0}, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(2, 1));
  EXPECT_NEAR(r->weights[0], 0.6439142598879724, kTol);
  EXPECT_NEAR(r->weights[1], 0.23688281808991016, kTol);
}

TEST(RouteTest, RenormalizeAndNaiveDivideBySelectedSum) {
  // Same logits: p[2] / (p[2] + p[1]) = e^3 / (e^3 + e^2) = 1 / (1 + e^-1) = 0.7310585786300049,
  // the other 1 / (1 + e) = 0.2689414213699951.
  for (RoutingMethod m : {RoutingMethod::kRenormalize, RoutingMethod::kRenormalizeNaive}) {
    auto r = RunRoute(Params(m, 2), {1, 2, 3, 0}, 4);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->ids, ElementsAre(2, 1));
    EXPECT_NEAR(r->weights[0], 0.7310585786300049, kTol);
    EXPECT_NEAR(r->weights[1], 0.2689414213699951, kTol);
  }
}

TEST(RouteTest, OutputOrderIsDescendingScore) {
  auto r = RunRoute(Params(RoutingMethod::kRenormalize, 4), {0, 3, 1, 2}, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(1, 3, 2, 0));
}

TEST(RouteTest, TiesGoToLowerIdForEveryMethod) {
  // Experts 1, 2 and 4 tie at the top; K = 2 must pick 1 then 2, K = 3 adds 4.
  const std::vector<float> z = {1, 5, 5, 2, 5};
  for (RoutingMethod m :
       {RoutingMethod::kDefault, RoutingMethod::kRenormalize, RoutingMethod::kRenormalizeNaive,
        RoutingMethod::kSigmoid, RoutingMethod::kSigmoidRenorm, RoutingMethod::kDeepSeekV3}) {
    auto r2 = RunRoute(Params(m, 2), z, 5);
    ASSERT_TRUE(r2.ok()) << r2.status();
    EXPECT_THAT(r2->ids, ElementsAre(1, 2)) << RoutingMethodName(m);
    EXPECT_EQ(r2->weights[0], r2->weights[1]) << RoutingMethodName(m);
    auto r3 = RunRoute(Params(m, 3), z, 5);
    ASSERT_TRUE(r3.ok()) << r3.status();
    EXPECT_THAT(r3->ids, ElementsAre(1, 2, 4)) << RoutingMethodName(m);
  }
}

TEST(RouteTest, RouterBiasIsAddedToLogitsFirst) {
  // z + bias = [1 + 2, 2, 3] = [3, 2, 3]: tie between 0 and 2 goes to 0;
  // weight e^3 / (2 e^3 + e^2) = 1 / (2 + e^-1) = 0.4223187982515182.
  std::vector<float> bias = {2, 0, 0};
  RoutingParams p = Params(RoutingMethod::kDefault, 1);
  p.router_bias = F32(bias, {3});
  auto r = RunRoute(p, {1, 2, 3}, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(0));
  EXPECT_NEAR(r->weights[0], 0.4223187982515182, kTol);
}

TEST(RouteTest, SigmoidAndSigmoidRenorm) {
  // s = sigmoid([0, 2, -1, 1]) = [0.5, 0.8807970779778823, 0.2689414213699951, 0.7310585786300049].
  auto plain = RunRoute(Params(RoutingMethod::kSigmoid, 2), {0, 2, -1, 1}, 4);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_THAT(plain->ids, ElementsAre(1, 3));
  EXPECT_NEAR(plain->weights[0], 0.8807970779778823, kTol);
  EXPECT_NEAR(plain->weights[1], 0.7310585786300049, kTol);
  // Renormalized: 0.88080 / (0.88080 + 0.73106) = 0.5464491031607007, the other 0.4535508968392993.
  auto renorm = RunRoute(Params(RoutingMethod::kSigmoidRenorm, 2), {0, 2, -1, 1}, 4);
  ASSERT_TRUE(renorm.ok()) << renorm.status();
  EXPECT_THAT(renorm->ids, ElementsAre(1, 3));
  EXPECT_NEAR(renorm->weights[0], 0.5464491031607007, kTol);
  EXPECT_NEAR(renorm->weights[1], 0.4535508968392993, kTol);
}

TEST(RouteTest, SigmoidRenormOfUnderflowedScoresIsUniform) {
  // exp(150) overflows fp32, so every sigmoid is exactly 0: documented fallback 1/K each.
  auto r = RunRoute(Params(RoutingMethod::kSigmoidRenorm, 2), {-200, -300, -150}, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(0, 1));
  EXPECT_THAT(r->weights, ElementsAre(0.5f, 0.5f));
}

RoutingParams DeepSeek(int32_t top_k, int32_t n_group, int32_t topk_group, float scale,
                       bool renormalize) {
  RoutingParams p = Params(RoutingMethod::kDeepSeekV3, top_k);
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.routed_scaling_factor = scale;
  p.renormalize = renormalize;
  return p;
}

// E = 8 in 4 groups of 2, z = [4, -4 | 1.5, 1 | 0.5, 0.5 | -1, 2]. Group scores (sum of both):
// g0 = sig(4) + sig(-4) = 1.0, g1 = 0.81757 + 0.73106 = 1.54863, g2 = 2 * 0.62246 = 1.24492,
// g3 = 0.26894 + 0.88080 = 1.14974. Kept (topk_group 2): g1, g2. The best single expert (0,
// s = 0.98201) and the second best (7, 0.88080) both sit in losing groups; top-2 inside g1 and g2
// is experts 2 (0.8175744761936437) and 3 (0.7310585786300049).
const std::vector<float> kGroupLogits = {4, -4, 1.5, 1, 0.5, 0.5, -1, 2};

TEST(RouteDeepSeekV3Test, BestExpertInLosingGroupIsNotChosen) {
  auto r = RunRoute(DeepSeek(2, 4, 2, 2.5f, /*renormalize=*/true), kGroupLogits, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(2, 3));
  // 0.81757 / 1.54863 * 2.5 = 1.319832470395554; 0.73106 / 1.54863 * 2.5 = 1.1801675296044463.
  EXPECT_NEAR(r->weights[0], 1.319832470395554, kTol);
  EXPECT_NEAR(r->weights[1], 1.1801675296044463, kTol);
  EXPECT_NEAR(r->weights[0] + r->weights[1], 2.5, kTol);
}

TEST(RouteDeepSeekV3Test, WithoutRenormalizationWeightsAreScaledScores) {
  auto r = RunRoute(DeepSeek(2, 4, 2, 2.5f, /*renormalize=*/false), kGroupLogits, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(2, 3));
  // 0.8175744761936437 * 2.5 = 2.043936190484109; 0.7310585786300049 * 2.5 = 1.8276464465750122.
  EXPECT_NEAR(r->weights[0], 2.043936190484109, kTol);
  EXPECT_NEAR(r->weights[1], 1.8276464465750122, kTol);
}

TEST(RouteDeepSeekV3Test, AllGroupsKeptIsPlainTopK) {
  // topk_group = n_group: experts 0 (0.98201) and 7 (0.88080) win.
  auto r = RunRoute(DeepSeek(2, 4, 4, 1.f, /*renormalize=*/false), kGroupLogits, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(0, 7));
}

TEST(RouteDeepSeekV3Test, GroupScoreIsSumOfTopTwo) {
  // E = 6 in 2 groups of 3: g0 = [3, 3, -5], g1 = [2, 2, 2].
  // Top-2 sums: g0 = 2 sig(3) = 1.90515, g1 = 2 sig(2) = 1.76159 -> g0 (a sum over all three
  // would give g0 = 1.91184 < g1 = 2.64239, and the max alone would tie-break differently too).
  auto r = RunRoute(DeepSeek(1, 2, 1, 1.f, /*renormalize=*/false), {3, 3, -5, 2, 2, 2}, 6);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(0));
  // E = 6: g0 = [3, -5, -5] (max 0.95257, top-2 0.95927), g1 = [2, 1.5, -5] (max 0.88080,
  // top-2 1.69837): the group of the best single expert loses.
  auto r2 = RunRoute(DeepSeek(1, 2, 1, 1.f, /*renormalize=*/false), {3, -5, -5, 2, 1.5, -5}, 6);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_THAT(r2->ids, ElementsAre(3));
  EXPECT_NEAR(r2->weights[0], 0.8807970779778823, kTol);  // sig(2)
}

TEST(RouteDeepSeekV3Test, GroupTiesGoToLowerGroup) {
  // g0 = sig(1) + sig(0) = g1 = sig(0) + sig(1): group 0 is kept, so expert 0 (not 3) wins.
  auto r = RunRoute(DeepSeek(1, 2, 1, 1.f, /*renormalize=*/false), {1, 0, 0, 1}, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(0));
}

TEST(RouteDeepSeekV3Test, CorrectionBiasSelectsButDoesNotWeigh) {
  // s = sig([2, 0, 0, 1]) = [0.88080, 0.5, 0.5, 0.73106]; b = s + [0, 0, 0.5, 0.1]
  //   = [0.88080, 0.5, 1.0, 0.83106]. Groups: g0 = 1.38080, g1 = 1.83106 -> g1; top-1 of b in
  // g1 is expert 2 although s[3] > s[2]; its weight is s[2] = 0.5, times 3 = 1.5.
  std::vector<float> bias = {0, 0, 0.5f, 0.1f};
  RoutingParams p = DeepSeek(1, 2, 1, 3.f, /*renormalize=*/false);
  p.correction_bias = F32(bias, {4});
  auto r = RunRoute(p, {2, 0, 0, 1}, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->ids, ElementsAre(2));
  EXPECT_NEAR(r->weights[0], 1.5, kTol);
}

std::vector<float> RandomLogits(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Independent naive form: select by logit (softmax is monotonic; random logits have no ties),
// weights from a double softmax over all E (Default) or over the K chosen logits (Renormalize).
void NaiveSoftmaxRoute(const float* z, int64_t num_experts, int32_t k, bool renormalize,
                       std::vector<int32_t>& ids, std::vector<double>& weights) {
  std::vector<int32_t> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [z](int32_t a, int32_t b) { return z[a] > z[b]; });
  ids.assign(order.begin(), order.begin() + k);
  double all = 0, chosen = 0;
  for (int64_t e = 0; e < num_experts; ++e) all += std::exp(static_cast<double>(z[e]));
  for (int32_t i = 0; i < k; ++i) chosen += std::exp(static_cast<double>(z[ids[i]]));
  weights.clear();
  for (int32_t i = 0; i < k; ++i) {
    weights.push_back(std::exp(static_cast<double>(z[ids[i]])) / (renormalize ? chosen : all));
  }
}

TEST(RouteTest, RenormalizeEqualsNaiveOnRandomData) {
  const int64_t tokens = 64, experts = 32;
  const int32_t k = 4;
  const std::vector<float> z = RandomLogits(tokens * experts, 1234);
  auto a = RunRoute(Params(RoutingMethod::kRenormalize, k), z, experts);
  auto b = RunRoute(Params(RoutingMethod::kRenormalizeNaive, k), z, experts);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ids, b->ids);
  EXPECT_EQ(a->weights, b->weights);
  std::vector<int32_t> ids;
  std::vector<double> w;
  for (int64_t t = 0; t < tokens; ++t) {
    NaiveSoftmaxRoute(z.data() + t * experts, experts, k, /*renormalize=*/true, ids, w);
    double sum = 0;
    for (int32_t i = 0; i < k; ++i) {
      EXPECT_EQ(a->ids[t * k + i], ids[i]) << "t=" << t << " i=" << i;
      EXPECT_NEAR(a->weights[t * k + i], w[i], kTol) << "t=" << t << " i=" << i;
      sum += a->weights[t * k + i];
    }
    EXPECT_NEAR(sum, 1.0, kTol) << "t=" << t;
  }
}

TEST(RouteTest, DefaultMatchesNaiveOnRandomData) {
  const int64_t tokens = 32, experts = 64;
  const int32_t k = 8;
  const std::vector<float> z = RandomLogits(tokens * experts, 99);
  auto r = RunRoute(Params(RoutingMethod::kDefault, k), z, experts);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int32_t> ids;
  std::vector<double> w;
  for (int64_t t = 0; t < tokens; ++t) {
    NaiveSoftmaxRoute(z.data() + t * experts, experts, k, /*renormalize=*/false, ids, w);
    for (int32_t i = 0; i < k; ++i) {
      EXPECT_EQ(r->ids[t * k + i], ids[i]) << "t=" << t;
      EXPECT_NEAR(r->weights[t * k + i], w[i], kTol) << "t=" << t;
    }
  }
}

TEST(RouteTest, RenormalizedSumsOnRandomData) {
  const int64_t tokens = 16, experts = 16;
  const std::vector<float> z = RandomLogits(tokens * experts, 7);
  struct Case {
    RoutingParams params;
    double sum;
  };
  const Case cases[] = {{Params(RoutingMethod::kSigmoidRenorm, 3), 1.0},
                        {DeepSeek(4, 4, 2, 2.5f, /*renormalize=*/true), 2.5}};
  for (const Case& c : cases) {
    auto r = RunRoute(c.params, z, experts);
    ASSERT_TRUE(r.ok()) << r.status();
    for (int64_t t = 0; t < tokens; ++t) {
      double sum = 0;
      for (int32_t i = 0; i < c.params.top_k; ++i) sum += r->weights[t * c.params.top_k + i];
      EXPECT_NEAR(sum, c.sum, 4e-6) << RoutingMethodName(c.params.method) << " t=" << t;
    }
  }
}

TEST(RouteTest, ZeroTokensIsOk) {
  RoutingParams p = Params(RoutingMethod::kRenormalize, 2);
  EXPECT_TRUE(Route(p, MakeView<float>(DType::kF32, {0, 4}, nullptr),
                    MakeView<int32_t>(DType::kI32, {0, 2}, nullptr),
                    MakeView<float>(DType::kF32, {0, 2}, nullptr))
                  .ok());
}

// Error paths: each case mutates a valid call (T = 2, E = 4, K = 2, DeepSeekV3 with 2 groups).
struct ErrorCall {
  RoutingParams params = DeepSeek(2, 2, 1, 1.f, true);
  std::vector<float> logits = {0, 1, 2, 3, 3, 2, 1, 0};
  Shape logits_shape = {2, 4};
  DType logits_dtype = DType::kF32;
  std::vector<int32_t> ids = std::vector<int32_t>(4);
  Shape ids_shape = {2, 2};
  DType ids_dtype = DType::kI32;
  std::vector<float> weights = std::vector<float>(4);
  Shape weights_shape = {2, 2};
  DType weights_dtype = DType::kF32;
  bool null_weights = false;
  std::vector<float> router_bias, correction_bias;
  Shape router_bias_shape = {4}, correction_bias_shape = {4};

  absl::Status Run() {
    if (!router_bias.empty()) {
      params.router_bias = MakeView(DType::kF32, router_bias_shape, router_bias.data());
    }
    if (!correction_bias.empty()) {
      params.correction_bias = MakeView(DType::kF32, correction_bias_shape, correction_bias.data());
    }
    return Route(params, MakeView(logits_dtype, logits_shape, logits.data()),
                 MakeView(ids_dtype, ids_shape, ids.data()),
                 MakeView(weights_dtype, weights_shape,
                          null_weights ? static_cast<float*>(nullptr) : weights.data()));
  }
};

TEST(RouteTest, InvalidArguments) {
  EXPECT_TRUE(ErrorCall().Run().ok());  // the base call is valid
  std::vector<std::pair<const char*, std::function<void(ErrorCall&)>>> cases = {
      {"logits BF16", [](ErrorCall& c) { c.logits_dtype = DType::kBF16; }},
      {"logits rank 1", [](ErrorCall& c) { c.logits_shape = {8}; }},
      {"top_k 0", [](ErrorCall& c) { c.params.top_k = 0; }},
      {"top_k > E",
       [](ErrorCall& c) {
         c.params.method = RoutingMethod::kDefault;
         c.params.top_k = 5;
         c.ids_shape = c.weights_shape = {2, 5};
         c.ids.resize(10);
         c.weights.resize(10);
       }},
      {"ids I64", [](ErrorCall& c) { c.ids_dtype = DType::kI64; }},
      {"ids shape",
       [](ErrorCall& c) {
         c.ids_shape = {2, 1};
       }},
      {"ids rows",
       [](ErrorCall& c) {
         c.ids_shape = {1, 2};
       }},
      {"weights BF16", [](ErrorCall& c) { c.weights_dtype = DType::kBF16; }},
      {"weights shape",
       [](ErrorCall& c) {
         c.weights_shape = {2, 3};
         c.weights.resize(6);
       }},
      {"weights null", [](ErrorCall& c) { c.null_weights = true; }},
      {"NaN logit", [](ErrorCall& c) { c.logits[5] = kNaN; }},
      {"kInf logit", [](ErrorCall& c) { c.logits[0] = -kInf; }},
      {"logit + router_bias overflows",
       [](ErrorCall& c) {
         c.logits[2] = 3e38f;
         c.router_bias = {0, 0, 3e38f, 0};
       }},
      {"router_bias NaN",
       [](ErrorCall& c) {
         c.router_bias = {0, kNaN, 0, 0};
       }},
      {"router_bias shape",
       [](ErrorCall& c) {
         c.router_bias = {0, 0, 0, 0, 0};
         c.router_bias_shape = {5};
       }},
      {"correction_bias kInf",
       [](ErrorCall& c) {
         c.correction_bias = {0, 0, kInf, 0};
       }},
      {"correction_bias shape",
       [](ErrorCall& c) {
         c.correction_bias = {0, 0, 0};
         c.correction_bias_shape = {3};
       }},
      {"n_group 0", [](ErrorCall& c) { c.params.n_group = 0; }},
      {"n_group does not divide E", [](ErrorCall& c) { c.params.n_group = 3; }},
      {"topk_group 0", [](ErrorCall& c) { c.params.topk_group = 0; }},
      {"topk_group > n_group", [](ErrorCall& c) { c.params.topk_group = 3; }},
      {"groups supply fewer than K",
       [](ErrorCall& c) {
         c.params.n_group = 4;  // groups of 1 expert, one kept, K = 2
         c.params.topk_group = 1;
       }},
      {"scaling factor NaN", [](ErrorCall& c) { c.params.routed_scaling_factor = kNaN; }},
      {"scaling factor 0", [](ErrorCall& c) { c.params.routed_scaling_factor = 0.f; }},
  };
  for (const auto& [what, mutate] : cases) {
    ErrorCall call;
    mutate(call);
    EXPECT_EQ(call.Run().code(), absl::StatusCode::kInvalidArgument) << what;
  }
}

TEST(RouteTest, FailedValidationWritesNothing) {
  ErrorCall call;
  call.logits[7] = std::numeric_limits<float>::quiet_NaN();  // last element of the last token
  call.ids.assign(4, -3);
  EXPECT_FALSE(call.Run().ok());
  EXPECT_THAT(call.ids, ElementsAreArray({-3, -3, -3, -3}));
}

}  // namespace
}  // namespace moe
