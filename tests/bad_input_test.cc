// Malformed and mismatched requests against live shard processes. Every bad request must get its
// documented status code (DESIGN.md section 8) and must not disturb the server: after each one the
// SAME process answers a good request, checked against the in-process CPU reference. Requests are
// built by hand with raw v1::ExpertShard stubs (and a generic stub for bytes that are no protobuf
// at all), so nothing is validated on the client side first.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

// The shards run the default (optimized) CPU backend, whose contract against the reference is
// 1e-2 (performance.md); it lands near 1e-4. A routing, replica or combine error is O(1), so 1e-3
// still catches every mistake these tests are about.
constexpr double kBackendTolerance = 1e-3;

constexpr absl::Duration kCallDeadline = absl::Seconds(30);
// The generated model: 2 layers, E = 8, top-2, H = 128, I = 64 (generator defaults).
constexpr int64_t kT = 4, kK = 2, kH = 128, kE = 8;
constexpr int kLayer = 1;

// Four tokens: two routes, one route, no route, two routes.
const std::vector<int32_t> kIds = {0, 5, 7, -1, -1, -1, 3, 6};
const std::vector<float> kWeights = {0.625f, 0.375f, 1.f, 0.f, 0.f, 0.f, 0.25f, 0.75f};

std::unique_ptr<grpc::ClientContext> DeadlineContext() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  return ctx;
}

// The standalone shard, the reference output and the good request, shared by the suite.
struct Fixture {
  std::string model_dir;
  std::unique_ptr<StandaloneShard> shard;
  std::unique_ptr<v1::ExpertShard::Stub> stub;
  v1::ForwardRequest good;
  HostTensor expected;  // F32 [T, H]
};

Fixture* g_fixture = nullptr;

absl::Status SetUpFixture() {
  auto f = std::make_unique<Fixture>();
  f->model_dir = FreshTestDir("bad_input_model");
  model::GenerateOptions gen;
  gen.seed = 31;
  if (absl::Status s = model::GenerateModel(gen, f->model_dir); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(f->model_dir);
  if (!ref.ok()) return ref.status();
  const std::vector<float> x = Bf16RoundedNormals(kT * kH, 8);
  absl::StatusOr<HostTensor> expected = (*ref)->Run(kLayer, x, kIds, kWeights, kK, false);
  if (!expected.ok()) return expected.status();
  f->expected = *std::move(expected);

  v1::ForwardRequest& req = f->good;
  req.set_model_fingerprint((*ref)->config().Fingerprint());
  req.set_layer(kLayer);
  req.set_map_version(1);
  req.set_output_dtype(v1::F32);
  req.set_request_id(77);
  req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
  SetWireTensor(req.mutable_hidden_states()->mutable_data(), v1::F32, {kT, kH}, RawBytes(x));
  SetWireTensor(req.mutable_topk_ids(), v1::I32, {kT, kK}, RawBytes(kIds));
  SetWireTensor(req.mutable_topk_weights(), v1::F32, {kT, kK}, RawBytes(kWeights));

  absl::StatusOr<std::unique_ptr<StandaloneShard>> shard = StandaloneShard::Start(f->model_dir);
  if (!shard.ok()) return shard.status();
  f->shard = *std::move(shard);
  f->stub = v1::ExpertShard::NewStub(MakeChannel(f->shard->address()));
  g_fixture = f.release();
  return absl::OkStatus();
}

// Checks a Forward answer to the good request: F32 [T, H], the reference's values, exact zeros for
// the token without routes.
void ExpectGoodResponse(const v1::ForwardResponse& resp, uint64_t request_id) {
  EXPECT_EQ(resp.request_id(), request_id);
  EXPECT_EQ(resp.map_version(), 1u);
  const v1::Tensor& out = resp.output();
  ASSERT_EQ(out.dtype(), v1::F32);
  ASSERT_EQ(std::vector<int64_t>(out.shape().begin(), out.shape().end()),
            (std::vector<int64_t>{kT, kH}));
  ASSERT_EQ(out.data().size(), kT * kH * sizeof(float));
  std::vector<float> got(kT * kH);
  std::memcpy(got.data(), out.data().data(), out.data().size());
  EXPECT_LE(RelativeError(got.data(), g_fixture->expected.data<float>(), kT * kH),
            kBackendTolerance);
  for (int64_t j = 0; j < kH; ++j) ASSERT_EQ(got[2 * kH + j], 0.f) << "token 2 has no route";
}

void ExpectServesGoodRequest(v1::ExpertShard::Stub& stub) {
  v1::ForwardResponse resp;
  const grpc::Status s = stub.Forward(DeadlineContext().get(), g_fixture->good, &resp);
  ASSERT_TRUE(s.ok()) << "the shard stopped serving: " << s.error_code() << " "
                      << s.error_message();
  ExpectGoodResponse(resp, g_fixture->good.request_id());
}

class BadInputEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const absl::Status s = SetUpFixture();
    ASSERT_TRUE(s.ok()) << s;
  }
  void TearDown() override {
    delete g_fixture;
    g_fixture = nullptr;
  }
};

const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new BadInputEnvironment());

// ---- One table row per malformed request ----

using Mutation = std::function<void(v1::ForwardRequest&)>;

struct BadCase {
  std::string name;
  Mutation mutate;
  grpc::StatusCode code;
  std::string message;  // must appear in the status message (usually the offending field)
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

v1::Tensor* Hidden(v1::ForwardRequest& r) { return r.mutable_hidden_states()->mutable_data(); }

// Replaces float `index` of a wire F32 tensor.
void SetFloat(v1::Tensor* t, int index, float value) {
  std::memcpy(t->mutable_data()->data() + index * sizeof(float), &value, sizeof(float));
}
void SetInt(v1::Tensor* t, int index, int32_t value) {
  std::memcpy(t->mutable_data()->data() + index * sizeof(int32_t), &value, sizeof(int32_t));
}
void Reshape(v1::Tensor* t, std::vector<int64_t> shape) {
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
}

constexpr grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
constexpr grpc::StatusCode kPrecondition = grpc::StatusCode::FAILED_PRECONDITION;

std::vector<BadCase> ShapeAndRangeCases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  return {
      {"empty_request", [](auto& r) { r = v1::ForwardRequest(); }, kInvalid, "hidden_states.data"},
      {"hidden_rank_3",
       [](auto& r) {
         Reshape(Hidden(r), {kT, kH, 1});
       },
       kInvalid, "hidden_states.data"},
      {"hidden_h_not_the_models",
       [](auto& r) {
         Reshape(Hidden(r), {2 * kT, kH / 2});
       },
       kInvalid, "hidden_states.data"},
      {"hidden_rows_differ_from_ids",
       [](auto& r) {
         Reshape(Hidden(r), {kT - 1, kH});
         Hidden(r)->mutable_data()->resize((kT - 1) * kH * sizeof(float));
       },
       kInvalid, "topk_ids"},
      {"id_equal_to_e", [](auto& r) { SetInt(r.mutable_topk_ids(), 0, kE); }, kInvalid,
       "topk_ids: id 8"},
      {"id_minus_2", [](auto& r) { SetInt(r.mutable_topk_ids(), 3, -2); }, kInvalid,
       "topk_ids: id -2"},
      {"nan_weight", [nan](auto& r) { SetFloat(r.mutable_topk_weights(), 1, nan); }, kInvalid,
       "topk_weights"},
      {"inf_weight", [inf](auto& r) { SetFloat(r.mutable_topk_weights(), 6, inf); }, kInvalid,
       "topk_weights"},
      {"minus_inf_weight", [inf](auto& r) { SetFloat(r.mutable_topk_weights(), 0, -inf); },
       kInvalid, "topk_weights"},
      {"weights_shape_differs_from_ids",
       [](auto& r) {
         SetWireTensor(r.mutable_topk_weights(), v1::F32, {kT, kK + 1},
                       RawBytes(std::vector<float>(kT * (kK + 1), 0.5f)));
       },
       kInvalid, "topk_weights"},
      {"ids_rank_1", [](auto& r) { Reshape(r.mutable_topk_ids(), {kT * kK}); }, kInvalid,
       "topk_ids"},
      {"k_zero",
       [](auto& r) {
         SetWireTensor(r.mutable_topk_ids(), v1::I32, {kT, 0}, "");
         SetWireTensor(r.mutable_topk_weights(), v1::F32, {kT, 0}, "");
       },
       kInvalid, "topk_ids"},
      {"k_above_e",
       [](auto& r) {
         SetWireTensor(r.mutable_topk_ids(), v1::I32, {kT, kE + 1},
                       RawBytes(std::vector<int32_t>(kT * (kE + 1), -1)));
         SetWireTensor(r.mutable_topk_weights(), v1::F32, {kT, kE + 1},
                       RawBytes(std::vector<float>(kT * (kE + 1), 0.f)));
       },
       kInvalid, "topk_ids"},
      {"negative_dimension",
       [](auto& r) {
         Reshape(Hidden(r), {-kT, kH});
       },
       kInvalid, "hidden_states.data"},
      {"shape_product_overflows",
       [](auto& r) {
         Reshape(r.mutable_topk_ids(), {int64_t{1} << 40, int64_t{1} << 40});
       },
       kInvalid, "topk_ids"},
      {"truncated_hidden", [](auto& r) { Hidden(r)->mutable_data()->pop_back(); }, kInvalid,
       "hidden_states.data"},
      {"truncated_ids", [](auto& r) { r.mutable_topk_ids()->mutable_data()->resize(7 * 4); },
       kInvalid, "topk_ids"},
      {"extra_weight_bytes",
       [](auto& r) { r.mutable_topk_weights()->mutable_data()->append(4, '\0'); }, kInvalid,
       "topk_weights"},
      {"token_indices_wrong_length",
       [](auto& r) {
         SetWireTensor(r.mutable_token_indices(), v1::I64, {kT + 1},
                       RawBytes(std::vector<int64_t>(kT + 1, 0)));
       },
       kInvalid, "token_indices"},
      {"shared_mask_wrong_length",
       [](auto& r) {
         SetWireTensor(r.mutable_shared_mask(), v1::BOOL, {kT - 1}, std::string(kT - 1, '\1'));
       },
       kInvalid, "shared_mask"},
      {"is_padding_byte_2",
       [](auto& r) { SetWireTensor(r.mutable_is_padding(), v1::BOOL, {kT}, "\2\0\0\0"); }, kInvalid,
       "is_padding"},
      {"unknown_layer", [](auto& r) { r.set_layer(2); }, kInvalid, "layer 2"},
      {"huge_layer", [](auto& r) { r.set_layer(4000000000u); }, kInvalid, "layer 4000000000"},
  };
}

std::vector<BadCase> DtypeAndFormatCases() {
  return {
      {"ids_as_f32", [](auto& r) { r.mutable_topk_ids()->set_dtype(v1::F32); }, kInvalid,
       "topk_ids"},
      {"weights_as_i32", [](auto& r) { r.mutable_topk_weights()->set_dtype(v1::I32); }, kInvalid,
       "topk_weights"},
      {"ids_dtype_unspecified",
       [](auto& r) { r.mutable_topk_ids()->set_dtype(v1::DTYPE_UNSPECIFIED); }, kInvalid,
       "topk_ids"},
      {"ids_dtype_outside_enum",
       [](auto& r) { r.mutable_topk_ids()->set_dtype(static_cast<v1::DType>(42)); }, kInvalid,
       "topk_ids"},
      {"hidden_u8_under_f32_format",
       [](auto& r) {
         Hidden(r)->set_dtype(v1::U8);
         Reshape(Hidden(r), {kT, kH * 4});
       },
       kInvalid, "hidden_states.data"},
      {"bf16_format_with_f32_data",
       [](auto& r) { r.mutable_hidden_states()->set_format(v1::ACTIVATION_BF16); }, kInvalid,
       "hidden_states.data"},
      {"token_indices_i32",
       [](auto& r) {
         SetWireTensor(r.mutable_token_indices(), v1::I32, {kT},
                       RawBytes(std::vector<int32_t>{0, 1, 2, 3}));
       },
       kInvalid, "token_indices"},
      {"is_padding_f32",
       [](auto& r) {
         SetWireTensor(r.mutable_is_padding(), v1::F32, {kT}, RawBytes(std::vector<float>(kT)));
       },
       kInvalid, "is_padding"},
      {"output_dtype_u8", [](auto& r) { r.set_output_dtype(v1::U8); }, kInvalid, "output_dtype"},
      {"activation_format_unspecified",
       [](auto& r) { r.mutable_hidden_states()->set_format(v1::ACTIVATION_FORMAT_UNSPECIFIED); },
       kInvalid, "hidden_states.format"},
      {"activation_format_unknown",
       [](auto& r) {
         r.mutable_hidden_states()->set_format(static_cast<v1::ActivationFormat>(99));
       },
       kInvalid, "hidden_states.format"},
      {"mxfp8_without_scales",
       [](auto& r) {
         r.mutable_hidden_states()->set_format(v1::ACTIVATION_MXFP8);
         SetWireTensor(Hidden(r), v1::E4M3, {kT, kH}, std::string(kT * kH, '\x38'));
       },
       kInvalid, "hidden_states"},
      {"nvfp4_payload_width_not_h_over_2",
       [](auto& r) {
         r.mutable_hidden_states()->set_format(v1::ACTIVATION_NVFP4);
         SetWireTensor(Hidden(r), v1::U8, {kT, kH / 4}, std::string(kT * kH / 4, '\0'));
       },
       kInvalid, "hidden_states.data"},
      {"router_logits_wrong_width",
       [](auto& r) {
         r.clear_topk_ids();
         r.clear_topk_weights();
         SetWireTensor(r.mutable_router_logits(), v1::F32, {kT, kE - 1},
                       RawBytes(std::vector<float>(kT * (kE - 1), 0.f)));
       },
       kInvalid, "router_logits"},
      {"unknown_routing_method",
       [](auto& r) {
         r.clear_topk_ids();
         r.clear_topk_weights();
         SetWireTensor(r.mutable_router_logits(), v1::F32, {kT, kE},
                       RawBytes(std::vector<float>(kT * kE, 0.f)));
         r.mutable_routing()->set_method("bogus");
       },
       kInvalid, "routing.method"},
      // [T, top_k] buffers are sized from top_k: it must be validated first (this used to end
      // in std::bad_alloc, answered UNKNOWN by gRPC, or in exhausted memory).
      {"routing_top_k_huge",
       [](auto& r) {
         r.clear_topk_ids();
         r.clear_topk_weights();
         SetWireTensor(r.mutable_router_logits(), v1::F32, {kT, kE},
                       RawBytes(std::vector<float>(kT * kE, 0.f)));
         r.mutable_routing()->set_top_k(2000000000);
       },
       kInvalid, "top_k"},
      {"wrong_model_fingerprint", [](auto& r) { r.set_model_fingerprint("gpt-oss-mxfp4-0"); },
       kPrecondition, "wrong model"},
      {"map_version_not_served", [](auto& r) { r.set_map_version(2); }, kPrecondition,
       "current map version is 1"},
  };
}

class BadRequestTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadRequestTest, RejectedWithItsCodeAndTheShardKeepsServing) {
  ASSERT_NE(g_fixture, nullptr);
  const BadCase& c = GetParam();
  v1::ForwardRequest req = g_fixture->good;
  c.mutate(req);
  v1::ForwardResponse resp;
  const grpc::Status s = g_fixture->stub->Forward(DeadlineContext().get(), req, &resp);
  EXPECT_EQ(s.error_code(), c.code) << s.error_message();
  EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
  ExpectServesGoodRequest(*g_fixture->stub);
}

INSTANTIATE_TEST_SUITE_P(ShapesAndRanges, BadRequestTest, ::testing::ValuesIn(ShapeAndRangeCases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(DtypesAndFormats, BadRequestTest,
                         ::testing::ValuesIn(DtypeAndFormatCases()),
                         [](const auto& info) { return info.param.name; });

TEST(BadInputTest, GoodRequestIsAnsweredCorrectly) {
  ASSERT_NE(g_fixture, nullptr);
  ExpectServesGoodRequest(*g_fixture->stub);
}

// The shard's receive limit is 256 MiB (main.cc); gRPC itself refuses a larger message.
TEST(BadInputTest, OversizeMessageIsResourceExhausted) {
  ASSERT_NE(g_fixture, nullptr);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(512 << 20);
  auto stub = v1::ExpertShard::NewStub(grpc::CreateCustomChannel(
      g_fixture->shard->address(), grpc::InsecureChannelCredentials(), args));
  v1::ForwardRequest req = g_fixture->good;
  const int64_t tokens = (int64_t{257} << 20) / (kH * sizeof(float));  // 257 MiB of F32 hidden
  SetWireTensor(Hidden(req), v1::F32, {tokens, kH}, std::string(tokens * kH * sizeof(float), '\0'));
  v1::ForwardResponse resp;
  const grpc::Status s = stub->Forward(DeadlineContext().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  ExpectServesGoodRequest(*g_fixture->stub);
}

// Bytes that are no ForwardRequest: gRPC's generated handler fails to parse them and answers
// INTERNAL itself, before the service runs (so the service's INVALID_ARGUMENT cannot apply).
// The first byte 0x07 is a tag with field number 0, which protobuf always rejects; the rest is
// random.
TEST(BadInputTest, GarbageBytesAreRejectedByGrpc) {
  ASSERT_NE(g_fixture, nullptr);
  std::string garbage(4096, '\0');
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (char& c : garbage) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    c = static_cast<char>(state >> 56);
  }
  garbage[0] = '\x07';
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::GenericStub generic(MakeChannel(g_fixture->shard->address()));
  std::unique_ptr<grpc::ClientContext> ctx = DeadlineContext();
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(ctx.get(), "/moe.v1.ExpertShard/Forward", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kCallDeadline + absl::Seconds(5)));
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  ExpectServesGoodRequest(*g_fixture->stub);
}

// A bad request on a stream ends that stream with the request's code (naming its request_id);
// the responses before it arrive, and the shard keeps serving other calls.
TEST(BadInputTest, BadStreamRequestEndsOnlyThatStream) {
  ASSERT_NE(g_fixture, nullptr);
  struct StreamCase {
    Mutation mutate;
    grpc::StatusCode code;
  };
  const std::vector<StreamCase> cases = {
      {[](auto& r) { SetFloat(r.mutable_topk_weights(), 0, NAN); }, kInvalid},
      {[](auto& r) { r.set_map_version(9); }, kPrecondition},
      {[](auto& r) { r.set_layer(7); }, kInvalid},
  };
  for (const StreamCase& c : cases) {
    std::unique_ptr<grpc::ClientContext> ctx = DeadlineContext();
    auto stream = g_fixture->stub->ForwardStream(ctx.get());
    v1::ForwardRequest good = g_fixture->good;
    good.set_request_id(1);
    ASSERT_TRUE(stream->Write(good));
    v1::ForwardResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ExpectGoodResponse(resp, 1);
    v1::ForwardRequest bad = g_fixture->good;
    bad.set_request_id(2);
    c.mutate(bad);
    stream->Write(bad);  // may already see the end of the stream
    stream->WritesDone();
    EXPECT_FALSE(stream->Read(&resp)) << "no answer to a bad request";
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find("request_id 2"), std::string::npos) << s.error_message();
    ExpectServesGoodRequest(*g_fixture->stub);
  }
}

// A cluster shard serves only the map version it has: another version is FAILED_PRECONDITION
// naming the current one, and the current version keeps working.
TEST(ClusterShardTest, MapVersionNotServedIsFailedPrecondition) {
  ASSERT_NE(g_fixture, nullptr);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start({.model_dir = g_fixture->model_dir, .num_shards = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const v1::ClusterMap map = (*cluster)->client().cluster_map();
  ASSERT_EQ(map.version(), 1u);
  auto stub = v1::ExpertShard::NewStub(MakeChannel((*cluster)->shard_address(0)));
  for (uint64_t version : {uint64_t{2}, uint64_t{1000}}) {
    v1::ForwardRequest req = g_fixture->good;
    req.set_map_version(version);
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(DeadlineContext().get(), req, &resp);
    EXPECT_EQ(s.error_code(), kPrecondition) << s.error_message();
    EXPECT_NE(s.error_message().find("current map version is 1"), std::string::npos)
        << s.error_message();
    ExpectServesGoodRequest(*stub);
  }
}

}  // namespace
}  // namespace moe::testing
