// ForwardRaw against an in-process shard: same answer as Forward, precise errors for malformed
// frames and payloads, the oversize limit, and the shard still serving after each of them.
#include "server/shard/raw_forward.h"
#include "server/shard/transport_test_util.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/raw_forward.h"
#include "grpcpp/impl/client_unary_call.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/raw_frame.h"
#include "server/shard/in_process_shard.h"
#include "server/shard/model_source.h"
#include "server/shard/raw_forward.h"

namespace moe {
namespace {

constexpr int64_t kHidden = 128;
constexpr int64_t kTokens = 5;
constexpr int64_t kMaxMessage = 1 << 20;
constexpr char kModel[] = "raw_forward_model";

class RawForwardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    InProcessShardOptions options;
    options.max_message_bytes = kMaxMessage;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard =
        StartTestShard(kModel, kHidden, options);
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

  // A BF16 request of kTokens tokens (transport_test_util.h); the payload apart.
  static v1::ForwardRequest Header(std::string* payload) {
    return RoutedBf16Header(kTokens, kHidden, payload);
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

// Wraps the CPU reference and records, per Run, whether the hidden states and output lay in
// memory registered with it (what lets a CUDA backend skip its staging copies).
class RegistrationRecordingBackend final : public ExpertBackend {
 public:
  explicit RegistrationRecordingBackend(std::unique_ptr<ExpertBackend> inner)
      : inner_(std::move(inner)) {}
  absl::string_view name() const override { return "recording"; }
  std::string device() const override { return "cpu"; }
  absl::Status CheckSupported(const ExpertLayer& l) const override {
    return inner_->CheckSupported(l);
  }
  absl::Status PrepareLayer(int i, const ExpertLayer& l) override {
    return inner_->PrepareLayer(i, l);
  }
  absl::Status Run(int i, const ExpertLayer& l, const ExpertsRequest& r) override {
    absl::MutexLock lock(&mu_);
    hidden_registered.push_back(Registered(r.hidden_states));
    out_registered.push_back(Registered(r.out));
    return inner_->Run(i, l, r);
  }
  absl::Status RegisterHostMemory(void* data, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ranges_[data] = bytes;
    return absl::OkStatus();
  }
  void UnregisterHostMemory(void* data) override {
    absl::MutexLock lock(&mu_);
    ranges_.erase(data);
  }

  std::vector<bool> hidden_registered, out_registered;

 private:
  bool Registered(const TensorView& v) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto* p = static_cast<const char*>(v.data);
    for (const auto& [base, bytes] : ranges_) {
      const auto* b = static_cast<const char*>(base);
      if (p >= b && p + v.NumBytes() <= b + bytes) return true;
    }
    return false;
  }

  std::unique_ptr<ExpertBackend> inner_;
  absl::Mutex mu_;
  std::map<void*, size_t> ranges_ ABSL_GUARDED_BY(mu_);
};

// A payload that arrives in pieces is gathered into a pooled, registered buffer and the output is
// written into one; both are reused by the next call; the answers equal the one-piece frame's.
TEST_F(RawForwardTest, PayloadAndOutputUseRegisteredPooledBuffers) {
  absl::StatusOr<std::string> dir = TestModelDir(kModel, kHidden);
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<ModelWeightSource>> source = ModelWeightSource::Open(*dir);
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<std::unique_ptr<ExpertBackend>> reference = CreateBackend("cpu-reference");
  ASSERT_TRUE(reference.ok());
  RegistrationRecordingBackend backend(*std::move(reference));
  ExpertShardService service(source->get(), &backend, ExecutorOptions());
  const ServedModel& model = (*source)->model();
  ASSERT_TRUE(
      service.Activate(ShardPlacement::Standalone(model.num_layers, model.num_experts, 1)).ok());
  HostBufferPoolOptions pool;
  pool.register_min_bytes = 0;  // this test's tensors are small
  RawForwardService raw(&service, pool);

  std::string payload;
  const v1::ForwardRequest header = Header(&payload);
  const grpc::ByteBuffer whole = EncodeRawFrame(header, grpc::Slice(payload));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(whole.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  const size_t cut = payload.size() / 3;
  // Separate copies: gRPC would merge adjacent sub-slices of one slice back into one.
  grpc::Slice pieces[3] = {slices[0], grpc::Slice(payload.data(), cut),
                           grpc::Slice(payload.data() + cut, payload.size() - cut)};
  const grpc::ByteBuffer split(pieces, 3);

  std::string outputs[3];
  for (int call = 0; call < 3; ++call) {
    grpc::ByteBuffer response;
    const grpc::Status s = raw.ForwardRaw(nullptr, call == 1 ? &whole : &split, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    v1::ForwardResponse reply;
    ASSERT_TRUE(DecodeRawFrame(response, &reply, &outputs[call]).ok());
  }  // each response (and its output buffer) is released before the next call
  EXPECT_EQ(outputs[0].size(), static_cast<size_t>(kTokens * kHidden * 4));
  EXPECT_NE(outputs[0], std::string(outputs[0].size(), '\0'));
  EXPECT_EQ(outputs[1], outputs[0]);
  EXPECT_EQ(outputs[2], outputs[0]);
  // The one-piece payload is read where gRPC put it; gathered ones are in registered memory.
  EXPECT_EQ(backend.hidden_registered, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(backend.out_registered, (std::vector<bool>{true, true, true}));
  const HostBufferPoolStats stats = raw.pool_stats();
  EXPECT_EQ(stats.allocations, 2);  // one payload buffer, one output buffer
  EXPECT_EQ(stats.reuses, 3);
  EXPECT_EQ(stats.registered, 2);
  EXPECT_EQ(stats.lent_bytes, 0u);
}

}  // namespace
}  // namespace moe
