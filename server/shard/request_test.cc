// StageForwardRequest: the validation edge of Forward. Replica choice, local filtering and padding
// are checked against hand-derived values; quantized inputs against the staging decoders.
#include "server/shard/request.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/staging.h"
#include "server/common/wire.h"

namespace moe {
namespace {

constexpr int64_t kH = 128;

ServedModel Model() { return ServedModel{"fp", /*layers=*/2, /*experts=*/4, /*top_k=*/2, kH, 64}; }

// E = 4, P = 6: slots [0,1,2,3,0,1]; rank 0 hosts slots 0-2, rank 1 hosts slots 3-5.
std::shared_ptr<const ShardPlacement> Rank1Placement() {
  v1::ClusterMap map;
  map.set_version(7);
  map.mutable_model()->set_num_experts(4);
  map.mutable_model()->set_num_layers(2);
  map.set_num_physical(6);
  for (uint32_t r : {0, 0, 0, 1, 1, 1}) map.add_slot_to_rank(r);
  for (int l = 0; l < 2; ++l) {
    auto* layer = map.add_layers();
    for (int e : {0, 1, 2, 3, 0, 1}) layer->add_physical_to_logical(e);
  }
  auto p = ShardPlacement::FromClusterMap(map, 1);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

template <typename T>
void Put(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)));
}

v1::ForwardRequest BaseRequest() {
  v1::ForwardRequest r;
  r.set_layer(1);
  r.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
  std::vector<float> x(3 * kH);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>(i % 97) - 0.3f;
  Put(r.mutable_hidden_states()->mutable_data(), v1::F32, {3, kH}, x);
  Put<int32_t>(r.mutable_topk_ids(), v1::I32, {3, 2}, {0, 3, 1, 2, 0, 1});
  Put<float>(r.mutable_topk_weights(), v1::F32, {3, 2}, {0.75f, 0.25f, 0.5f, 0.5f, 0.6f, 0.4f});
  Put<int64_t>(r.mutable_token_indices(), v1::I64, {3}, {1, 0, 7});
  Put<uint8_t>(r.mutable_is_padding(), v1::BOOL, {3}, {0, 0, 1});
  return r;
}

TEST(RequestTest, RemapsFiltersAndPadsAsDerivedByHand) {
  auto placement = Rank1Placement();
  absl::StatusOr<StagedRequest> s = StageForwardRequest(BaseRequest(), Model(), *placement);
  ASSERT_TRUE(s.ok()) << s.status();
  // Token 0 has batch index 1: h = 2654435769 (odd), so expert 0 (slots {0, 4}) -> slot 4;
  // expert 3 -> slot 3. Token 1 has index 0: h = 0, expert 1 (slots {1, 5}) -> slot 1, expert 2
  // -> slot 2. Token 2 is padding.
  const std::vector<int32_t> physical = {4, 3, 1, 2, -1, -1};
  // Rank 1 hosts slots 3, 4, 5 as local 0, 1, 2.
  const std::vector<int32_t> local = {1, 0, -1, -1, -1, -1};
  const std::vector<float> weights = {0.75f, 0.25f, 0.5f, 0.5f, 0.f, 0.f};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(s->physical_ids.data<int32_t>()[i], physical[i]) << i;
    EXPECT_EQ(s->local_ids.data<int32_t>()[i], local[i]) << i;
    EXPECT_EQ(s->weights.data<float>()[i], weights[i]) << i;
  }
  EXPECT_EQ(s->layer, 1);
  EXPECT_EQ(s->num_tokens, 3);
  EXPECT_EQ(s->out_dtype, DType::kBF16);
}

TEST(RequestTest, Mxfp8InputIsDecodedLikeTheStagingDecoder) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  HostTensor x(DType::kF32, {3, kH}), q(DType::kE4M3, {3, kH}), sc(DType::kI32, {3, kH / 128}),
      want(DType::kF32, {3, kH});
  for (int64_t i = 0; i < x.NumElements(); ++i) x.data<float>()[i] = normal(rng);
  ASSERT_TRUE(QuantizeMxfp8(x.view(), q.view(), sc.view()).ok());
  ASSERT_TRUE(DequantizeMxfp8(q.view(), sc.view(), want.view()).ok());
  v1::ForwardRequest r = BaseRequest();
  r.mutable_hidden_states()->set_format(v1::ACTIVATION_MXFP8);
  ToWire(q.view(), r.mutable_hidden_states()->mutable_data());
  ToWire(sc.view(), r.mutable_hidden_states()->mutable_scales());
  absl::StatusOr<StagedRequest> s = StageForwardRequest(r, Model(), *Rank1Placement());
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->hidden.dtype, DType::kF32);
  EXPECT_EQ(std::memcmp(s->hidden.data, want.data<float>(), want.NumElements() * 4), 0);
}

// Hidden states passed outside the message (raw frames, shared memory) are read in place when
// aligned to their element size, copied once (aligned) when not; either way bit-exact. The
// message must not carry them too.
TEST(RequestTest, OutsidePayloadInPlaceOrAlignedCopy) {
  v1::ForwardRequest r = BaseRequest();
  const std::string bytes = r.hidden_states().data().data();
  r.mutable_hidden_states()->mutable_data()->clear_data();
  std::vector<uint64_t> storage(bytes.size() / 8 + 2);  // 8-byte aligned
  char* base = reinterpret_cast<char*>(storage.data());
  std::memcpy(base, bytes.data(), bytes.size());
  absl::StatusOr<StagedRequest> s = StageForwardRequest(
      r, Model(), *Rank1Placement(), absl::string_view(base, bytes.size()));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->hidden.data, base) << "aligned payload not read in place";
  std::memmove(base + 1, base, bytes.size());  // now at an odd address
  s = StageForwardRequest(r, Model(), *Rank1Placement(),
                          absl::string_view(base + 1, bytes.size()));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->hidden.data, static_cast<void*>(base + 1));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s->hidden.data) % alignof(float), 0u);
  EXPECT_EQ(std::memcmp(s->hidden.data, bytes.data(), bytes.size()), 0);
  // The payload in both places: refused.
  r.mutable_hidden_states()->mutable_data()->set_data(bytes);
  s = StageForwardRequest(r, Model(), *Rank1Placement(), absl::string_view(base, bytes.size()));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestTest, MonolithicRoutingReturnsItsDecisions) {
  v1::ForwardRequest r = BaseRequest();
  r.clear_topk_ids();
  r.clear_topk_weights();
  // Expert 3 then 1 are the top-2 of every token.
  Put<float>(r.mutable_router_logits(), v1::F32, {3, 4},
             {0.f, 2.f, 1.f, 3.f, 0.f, 2.f, 1.f, 3.f, 0.f, 2.f, 1.f, 3.f});
  r.mutable_routing()->set_method("renormalize");
  absl::StatusOr<StagedRequest> s = StageForwardRequest(r, Model(), *Rank1Placement());
  ASSERT_TRUE(s.ok()) << s.status();
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(s->routed_ids.data<int32_t>()[2 * t], 3);
    EXPECT_EQ(s->routed_ids.data<int32_t>()[2 * t + 1], 1);
    // softmax over {3, 2}: e^1 / (e^1 + 1).
    EXPECT_NEAR(s->routed_weights.data<float>()[2 * t], std::exp(1.0) / (std::exp(1.0) + 1), 1e-6);
  }
}

TEST(RequestTest, RejectsMalformedRequests) {
  auto placement = Rank1Placement();
  struct Case {
    const char* what;
    std::function<void(v1::ForwardRequest&)> mutate;
  };
  std::vector<Case> cases = {
      {"unknown layer", [](v1::ForwardRequest& r) { r.set_layer(2); }},
      {"id = E",
       [](v1::ForwardRequest& r) {
         r.clear_topk_ids();
         Put<int32_t>(r.mutable_topk_ids(), v1::I32, {3, 2}, {0, 4, 1, 2, 0, 1});
       }},
      {"NaN weight",
       [](v1::ForwardRequest& r) {
         r.clear_topk_weights();
         Put<float>(r.mutable_topk_weights(), v1::F32, {3, 2}, {NAN, 0.f, 0.f, 0.f, 0.f, 0.f});
       }},
      {"weights of another shape",
       [](v1::ForwardRequest& r) {
         r.clear_topk_weights();
         Put<float>(r.mutable_topk_weights(), v1::F32, {3, 1}, {1.f, 1.f, 1.f});
       }},
      {"truncated hidden",
       [](v1::ForwardRequest& r) {
         r.mutable_hidden_states()->mutable_data()->mutable_data()->pop_back();
       }},
      {"wrong H",
       [](v1::ForwardRequest& r) {
         r.mutable_hidden_states()->clear_data();
         Put(r.mutable_hidden_states()->mutable_data(), v1::F32, {3, 64},
             std::vector<float>(3 * 64, 0.f));
       }},
      {"BF16 declared, F32 sent",
       [](v1::ForwardRequest& r) { r.mutable_hidden_states()->set_format(v1::ACTIVATION_BF16); }},
      {"unknown activation format",
       [](v1::ForwardRequest& r) {
         r.mutable_hidden_states()->set_format(static_cast<v1::ActivationFormat>(42));
       }},
      {"I64 token indices of wrong length",
       [](v1::ForwardRequest& r) {
         r.clear_token_indices();
         Put<int64_t>(r.mutable_token_indices(), v1::I64, {2}, {0, 1});
       }},
      {"bad output dtype", [](v1::ForwardRequest& r) { r.set_output_dtype(v1::U8); }},
  };
  // Zero-width payloads carry no bytes, so nothing but the width check bounds T: each must be
  // refused before [T, H] is allocated (2^34 * 128 floats would be 8 TiB; found by fuzzing).
  for (v1::ActivationFormat format :
       {v1::ACTIVATION_F32, v1::ACTIVATION_BF16, v1::ACTIVATION_MXFP8, v1::ACTIVATION_NVFP4}) {
    const v1::DType dtype = format == v1::ACTIVATION_F32     ? v1::F32
                            : format == v1::ACTIVATION_BF16  ? v1::BF16
                            : format == v1::ACTIVATION_MXFP8 ? v1::E4M3
                                                             : v1::U8;
    cases.push_back({"2^34 tokens of zero width", [format, dtype](v1::ForwardRequest& r) {
                       r.mutable_hidden_states()->set_format(format);
                       r.mutable_hidden_states()->clear_data();
                       Put<uint8_t>(r.mutable_hidden_states()->mutable_data(), dtype,
                                    {int64_t{1} << 34, 0}, {});
                     }});
  }
  for (const Case& c : cases) {
    v1::ForwardRequest r = BaseRequest();
    c.mutate(r);
    absl::StatusOr<StagedRequest> s = StageForwardRequest(r, Model(), *placement);
    ASSERT_FALSE(s.ok()) << c.what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << s.status();
  }
}

}  // namespace
}  // namespace moe
