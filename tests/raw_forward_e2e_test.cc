// ForwardRaw against a real moe_shard process (StandaloneShard): the output matches the CPU
// reference computed in-process on the same checkpoint, a malformed frame gets INVALID_ARGUMENT,
// and the shard keeps serving afterwards.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/raw_forward.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "gtest/gtest.h"
#include "server/common/raw_frame.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr int64_t kT = 3, kK = 2, kH = 128;
constexpr int kLayer = 0;
const std::vector<int32_t> kIds = {1, 4, -1, -1, 6, 2};
const std::vector<float> kWeights = {0.5f, 0.5f, 0.f, 0.f, 0.875f, 0.125f};

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  return ctx;
}

TEST(RawForwardE2eTest, MatchesReferenceAndSurvivesBadFrames) {
  const std::string dir = FreshTestDir("raw_forward_e2e_model");
  model::GenerateOptions gen;
  gen.seed = 5;
  ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
  absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(dir);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<float> x = Bf16RoundedNormals(kT * kH, 3);
  absl::StatusOr<HostTensor> expected = (*ref)->Run(kLayer, x, kIds, kWeights, kK, false);
  ASSERT_TRUE(expected.ok()) << expected.status();

  // The reference backend: this test is about transport, not the optimized kernels' accuracy.
  absl::StatusOr<std::unique_ptr<StandaloneShard>> shard =
      StandaloneShard::Start(dir, "cpu-reference");
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto channel = grpc::CreateChannel((*shard)->address(), grpc::InsecureChannelCredentials());

  v1::ForwardRequest header;
  header.set_layer(kLayer);
  header.set_map_version(1);
  header.set_output_dtype(v1::F32);
  header.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
  SetWireTensor(header.mutable_hidden_states()->mutable_data(), v1::F32, {kT, kH}, "");
  SetWireTensor(header.mutable_topk_ids(), v1::I32, {kT, kK}, RawBytes(kIds));
  SetWireTensor(header.mutable_topk_weights(), v1::F32, {kT, kK}, RawBytes(kWeights));
  const std::string payload = RawBytes(x);

  auto check_good_call = [&] {
    auto ctx = Context();
    absl::StatusOr<RawForwardReply> reply = ForwardRaw(channel.get(), ctx.get(), header, payload);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->output.size(), kT * kH * sizeof(float));
    std::vector<float> got(kT * kH);
    std::memcpy(got.data(), reply->output.data(), reply->output.size());
    EXPECT_LE(RelativeError(got.data(), expected->data<float>(), kT * kH), 1e-5);
    for (int64_t j = 0; j < kH; ++j) ASSERT_EQ(got[kH + j], 0.f) << "token 1 has no route";
  };
  check_good_call();

  // A frame whose header length runs past its end.
  const std::string bad("\x10\x00\x00\x00\x08\x00", 6);
  grpc::Slice slice(bad);
  grpc::ByteBuffer frame(&slice, 1), response;
  grpc::internal::RpcMethod method(kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC);
  auto ctx = Context();
  const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, ctx.get(), frame, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "raw frame header length 16 exceeds the 2 bytes after the prefix");
  check_good_call();
}

}  // namespace
}  // namespace moe::testing
