// ForwardRaw against an in-process shard: same answer as Forward, precise errors for malformed
// frames and payloads, the oversize limit, and the shard still serving after each of them.
#include "server/shard/raw_forward.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/raw_forward.h"
#include "grpcpp/impl/client_unary_call.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/raw_frame.h"
#include "server/model/generator.h"
#include "server/shard/in_process_shard.h"

namespace moe {
namespace {

constexpr int64_t kHidden = 128;
constexpr int64_t kTokens = 5;
constexpr int64_t kMaxMessage = 1 << 20;

class RawForwardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/raw_forward_model");
    model::GenerateOptions gen;
    gen.hidden = kHidden;
    ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
    InProcessShardOptions options;
    options.model_dir = dir;
    options.max_message_bytes = kMaxMessage;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard = InProcessShard::Start(options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = shard->release();
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    channel_ = new std::shared_ptr<grpc::Channel>(grpc::CreateCustomChannel(
        shard_->address(), grpc::InsecureChannelCredentials(), args));
  }
  static void TearDownTestSuite() {
    delete channel_;
    delete shard_;
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return ctx;
  }

  // A BF16 request of kTokens tokens routed to experts (t % 8, (t + 3) % 8); the payload apart.
  static v1::ForwardRequest Header(std::string* payload) {
    v1::ForwardRequest req;
    req.set_layer(1);
    req.set_request_id(42);
    req.set_output_dtype(v1::F32);
    v1::HiddenStates* hs = req.mutable_hidden_states();
    hs->set_format(v1::ACTIVATION_BF16);
    hs->mutable_data()->set_dtype(v1::BF16);
    hs->mutable_data()->add_shape(kTokens);
    hs->mutable_data()->add_shape(kHidden);
    std::vector<uint16_t> x(kTokens * kHidden);
    // BF16 of small varied values: sign/exponent 0x3c.. or 0xbc.., mantissa from the index.
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<uint16_t>((i % 3 == 0 ? 0xbc00 : 0x3c00) | (i * 37 % 256));
    }
    payload->assign(reinterpret_cast<const char*>(x.data()), x.size() * 2);
    std::vector<int32_t> ids;
    std::vector<float> w;
    for (int t = 0; t < kTokens; ++t) {
      ids.insert(ids.end(), {t % 8, (t + 3) % 8});
      w.insert(w.end(), {0.75f, 0.25f});
    }
    v1::Tensor* ti = req.mutable_topk_ids();
    ti->set_dtype(v1::I32);
    ti->add_shape(kTokens);
    ti->add_shape(2);
    ti->set_data(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
    v1::Tensor* tw = req.mutable_topk_weights();
    tw->set_dtype(v1::F32);
    tw->add_shape(kTokens);
    tw->add_shape(2);
    tw->set_data(std::string(reinterpret_cast<const char*>(w.data()), w.size() * 4));
    return req;
  }

  // Sends a hand-made frame (bypassing the client's checks).
  static grpc::Status SendFrame(const grpc::ByteBuffer& frame) {
    grpc::internal::RpcMethod method(kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ByteBuffer response;
    auto ctx = Context();
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_->get(), method, ctx.get(), frame, &response);
  }

  // The shard still answers a valid ForwardRaw.
  static void ExpectStillServing() {
    std::string payload;
    const v1::ForwardRequest header = Header(&payload);
    auto ctx = Context();
    absl::StatusOr<RawForwardReply> reply = ForwardRaw(channel_->get(), ctx.get(), header, payload);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->output.size(), static_cast<size_t>(kTokens * kHidden * 4));
  }

  static InProcessShard* shard_;
  static std::shared_ptr<grpc::Channel>* channel_;
};

InProcessShard* RawForwardTest::shard_ = nullptr;
std::shared_ptr<grpc::Channel>* RawForwardTest::channel_ = nullptr;

TEST_F(RawForwardTest, SameOutputAsProtobufForward) {
  std::string payload;
  const v1::ForwardRequest header = Header(&payload);
  v1::ForwardRequest full = header;
  full.mutable_hidden_states()->mutable_data()->set_data(payload);
  auto stub = v1::ExpertShard::NewStub(*channel_);
  v1::ForwardResponse expected;
  auto ctx1 = Context();
  ASSERT_TRUE(stub->Forward(ctx1.get(), full, &expected).ok());
  // Routed tokens give a non-zero output (the comparison below is not between two zero tensors).
  const std::string& want = expected.output().data();
  ASSERT_EQ(want.size(), static_cast<size_t>(kTokens * kHidden * 4));
  EXPECT_NE(want, std::string(want.size(), '\0'));

  auto ctx2 = Context();
  absl::StatusOr<RawForwardReply> reply = ForwardRaw(channel_->get(), ctx2.get(), header, payload);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->output, want);
  EXPECT_TRUE(reply->header.output().data().empty());
  EXPECT_EQ(reply->header.output().dtype(), v1::F32);
  ASSERT_EQ(reply->header.output().shape_size(), 2);
  EXPECT_EQ(reply->header.output().shape(0), kTokens);
  EXPECT_EQ(reply->header.output().shape(1), kHidden);
  EXPECT_EQ(reply->header.request_id(), 42u);
  EXPECT_EQ(reply->header.map_version(), 1u);
}

TEST_F(RawForwardTest, HeaderCarryingThePayloadIsRejected) {
  std::string payload;
  v1::ForwardRequest header = Header(&payload);
  header.mutable_hidden_states()->mutable_data()->set_data(payload);
  const grpc::Status s = SendFrame(EncodeRawFrame(header, grpc::Slice()));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "hidden_states.data.data: must be empty in a ForwardRaw header (the payload follows "
            "it)");
  // The client library refuses it before sending.
  auto ctx = Context();
  EXPECT_EQ(ForwardRaw(channel_->get(), ctx.get(), header, payload).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectStillServing();
}

TEST_F(RawForwardTest, MalformedFramesAreRejected) {
  const std::string short_frame("\x05\x00", 2);
  grpc::Slice s1(short_frame);
  grpc::Status s = SendFrame(grpc::ByteBuffer(&s1, 1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "raw frame of 2 bytes is shorter than its 4-byte prefix");
  const std::string long_header("\x00\x00\x01\x00xyz", 7);  // claims 65536 header bytes
  grpc::Slice s2(long_header);
  s = SendFrame(grpc::ByteBuffer(&s2, 1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "raw frame header length 65536 exceeds the 3 bytes after the prefix");
  ExpectStillServing();
}

TEST_F(RawForwardTest, PayloadLengthMustMatchShape) {
  std::string payload;
  const v1::ForwardRequest header = Header(&payload);
  for (size_t len : {payload.size() - 2, payload.size() + 2, size_t{0}}) {
    auto ctx = Context();
    absl::StatusOr<RawForwardReply> reply =
        ForwardRaw(channel_->get(), ctx.get(), header, absl::string_view(payload.data(), len));
    EXPECT_EQ(reply.status().code(), absl::StatusCode::kInvalidArgument) << len;
    EXPECT_NE(reply.status().message().find("hidden_states.data"), absl::string_view::npos)
        << reply.status();
  }
  ExpectStillServing();
}

TEST_F(RawForwardTest, OversizeMessageIsResourceExhausted) {
  std::string payload;
  v1::ForwardRequest header = Header(&payload);
  const std::string big(kMaxMessage + 1, '\0');
  auto ctx = Context();
  absl::StatusOr<RawForwardReply> reply = ForwardRaw(channel_->get(), ctx.get(), header, big);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kResourceExhausted) << reply.status();
  ExpectStillServing();
}

}  // namespace
}  // namespace moe
