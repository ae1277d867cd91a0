// Admission control and deadline propagation of the shard's Forward path, in process: a real
// ExpertShardService (CPU backend wrapped in a gate the test opens) behind a gRPC server with
// bearer tokens over local TCP credentials, so clients are identified by their token's name.
//
// Quota: with at most 1 request in flight per client and 2 in total, a second request of the same
// client (on another connection) and a third client's request while two are in flight get
// RESOURCE_EXHAUSTED at once; the admitted ones finish with the reference output and the shard
// keeps serving. Deadline: a request whose deadline passes while it waits behind a running batch
// is dropped when its batch is formed: the backend never runs it and GetStats counts it as
// expired, not as a request.
#include "server/shard/admission.h"

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/raw_forward.h"
#include "client/tcp_channel.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/auth.h"
#include "server/common/tls.h"
#include "server/model/generator.h"
#include "server/shard/model_source.h"
#include "server/shard/raw_forward.h"
#include "server/shard/service.h"
#include "server/shard/tcp_channel.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);
constexpr int64_t kT = 3, kK = 2;
const std::vector<int32_t> kIds = {0, 3, 5, -1, 7, 2};
const std::vector<float> kWeights = {0.5f, 0.5f, 1.f, 0.f, 0.25f, 0.75f};

// The CPU backend, but Run waits until the test opens the gate; counts the batches it ran.
class GatedBackend : public ExpertBackend {
 public:
  explicit GatedBackend(std::unique_ptr<ExpertBackend> inner) : inner_(std::move(inner)) {}
  absl::string_view name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::Status CheckSupported(const ExpertLayer& layer) const override {
    return inner_->CheckSupported(layer);
  }
  absl::Status PrepareLayer(int layer_index, const ExpertLayer& layer) override {
    return inner_->PrepareLayer(layer_index, layer);
  }
  absl::Status Run(int layer_index, const ExpertLayer& layer,
                   const ExpertsRequest& request) override {
    {
      absl::MutexLock lock(&mu_);
      ++entered_;
      mu_.Await(absl::Condition(&open_));
    }
    return inner_->Run(layer_index, layer, request);
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  bool WaitEntered(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entered_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kWait);
  }
  int entered() {
    absl::MutexLock lock(&mu_);
    return entered_;
  }

 private:
  std::unique_ptr<ExpertBackend> inner_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
};

class AdmissionTest : public ::testing::Test {
 protected:
  // Starts the shard with `admission` bounds.
  void StartShard(AdmissionOptions admission) {
    const std::string dir = FreshTestDir("admission_model");
    model::GenerateOptions gen;
    gen.seed = 23;
    ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
    absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(dir);
    ASSERT_TRUE(ref.ok()) << ref.status();
    hidden_ = Bf16RoundedNormals(kT * gen.hidden, 4);
    absl::StatusOr<HostTensor> expected = (*ref)->Run(1, hidden_, kIds, kWeights, kK, false);
    ASSERT_TRUE(expected.ok()) << expected.status();
    expected_ = *std::move(expected);

    request_.set_model_fingerprint((*ref)->config().Fingerprint());
    request_.set_layer(1);
    request_.set_map_version(1);
    request_.set_output_dtype(v1::F32);
    request_.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    SetWireTensor(request_.mutable_hidden_states()->mutable_data(), v1::F32, {kT, gen.hidden},
                  RawBytes(hidden_));
    SetWireTensor(request_.mutable_topk_ids(), v1::I32, {kT, kK}, RawBytes(kIds));
    SetWireTensor(request_.mutable_topk_weights(), v1::F32, {kT, kK}, RawBytes(kWeights));

    absl::StatusOr<std::unique_ptr<ModelWeightSource>> source = ModelWeightSource::Open(dir);
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = *std::move(source);
    absl::StatusOr<std::unique_ptr<ExpertBackend>> cpu = CreateBackend("cpu");
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<GatedBackend>(*std::move(cpu));
    admission_ = std::make_unique<AdmissionController>(admission);
    service_ =
        std::make_unique<ExpertShardService>(source_.get(), backend_.get(), ExecutorOptions{});
    service_->set_admission(admission_.get());
    const ServedModel& model = source_->model();
    ASSERT_TRUE(
        service_->Activate(ShardPlacement::Standalone(model.num_layers, model.num_experts, 1))
            .ok());

    absl::StatusOr<TokenTable> tokens =
        TokenTable::Parse("frontend tok-a alice\nfrontend tok-b bob\nfrontend tok-c carol\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        MakeServerCredentials({}, std::make_shared<TokenAuthProcessor>(*std::move(tokens)));
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port);
    builder.RegisterService(service_.get());
    raw_ = std::make_unique<RawForwardService>(service_.get());
    builder.RegisterService(raw_.get());
    absl::StatusOr<std::unique_ptr<TcpChannelService>> tcp =
        TcpChannelService::Start(service_.get(), TcpChannelOptions{});
    ASSERT_TRUE(tcp.ok()) << tcp.status();
    tcp_ = *std::move(tcp);
    builder.RegisterService(tcp_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port != 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }

  void TearDown() override {
    if (backend_) backend_->Open();
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    if (tcp_) tcp_->Stop();
  }

  // A new connection authenticated with `token`.
  std::unique_ptr<v1::ExpertShard::Stub> Client(const std::string& token) {
    return v1::ExpertShard::NewStub(MakeChannel(address_, ChannelSecurity{nullptr, token}));
  }

  grpc::Status Forward(v1::ExpertShard::Stub& stub, v1::ForwardResponse* response,
                       absl::Duration deadline = kWait) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub.Forward(&ctx, request_, response);
  }

  // Runs `stub`'s Forward on `thread` and waits until the backend holds it at the gate. False
  // when it never got there (the thread is then joined; the outcome is in `status`).
  bool StartHeld(v1::ExpertShard::Stub& stub, std::thread& thread, grpc::Status& status,
                 v1::ForwardResponse& response) {
    thread = std::thread([this, &stub, &status, &response] { status = Forward(stub, &response); });
    if (backend_->WaitEntered(1)) return true;
    thread.join();
    return false;
  }

  void ExpectReferenceOutput(const v1::ForwardResponse& response) {
    ASSERT_EQ(response.output().data().size(), expected_.view().NumBytes());
    std::vector<float> got(expected_.NumElements());
    std::memcpy(got.data(), response.output().data().data(), expected_.view().NumBytes());
    EXPECT_LE(RelativeError(got.data(), expected_.data<float>(), expected_.NumElements()),
              1e-3);  // the CPU backend vs the reference
  }

  v1::ShardStats Stats() {
    v1::ShardStats stats;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
    EXPECT_TRUE(Client("tok-c")->GetStats(&ctx, {}, &stats).ok());
    return stats;
  }

  std::vector<float> hidden_;
  HostTensor expected_;
  v1::ForwardRequest request_;
  std::unique_ptr<ModelWeightSource> source_;
  std::unique_ptr<GatedBackend> backend_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<ExpertShardService> service_;
  std::unique_ptr<RawForwardService> raw_;
  std::unique_ptr<TcpChannelService> tcp_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(AdmissionTest, QuotasRefuseExcessAndShardKeepsServing) {
  StartShard({.max_inflight_per_client = 1, .max_inflight_total = 2});
  auto alice = Client("tok-a");
  v1::ForwardResponse a_response, c_response;
  grpc::Status a_status, c_status;
  std::thread a;
  if (!StartHeld(*alice, a, a_status, a_response)) {  // alice's request held at the gate
    FAIL() << "alice's request never reached the backend: " << a_status.error_code() << " "
           << a_status.error_message();
  }

  // Alice again, on a second connection: over her quota of 1.
  v1::ForwardResponse refused;
  grpc::Status s = Forward(*Client("tok-a"), &refused);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();

  // Bob is admitted (queued behind alice); then two are in flight: carol is over the total.
  auto bob = Client("tok-b");
  std::thread c([&] { c_status = Forward(*bob, &c_response); });
  const absl::Time deadline = absl::Now() + kWait;
  while (admission_->stats().in_flight < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (admission_->stats().in_flight != 2) {
    backend_->Open();
    a.join();
    c.join();
    FAIL() << "bob's request was not admitted: " << c_status.error_code() << " "
           << c_status.error_message();
  }
  s = Forward(*Client("tok-c"), &refused);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();

  backend_->Open();
  a.join();
  c.join();
  ASSERT_TRUE(a_status.ok()) << a_status.error_message();
  ASSERT_TRUE(c_status.ok()) << c_status.error_message();
  ExpectReferenceOutput(a_response);
  ExpectReferenceOutput(c_response);
  v1::ShardStats stats = Stats();
  EXPECT_EQ(stats.requests(), 2u);
  EXPECT_EQ(stats.rejected(), 2u);

  // Quotas are released: alice and carol are served again.
  v1::ForwardResponse again;
  ASSERT_TRUE(Forward(*alice, &again).ok());
  ExpectReferenceOutput(again);
  ASSERT_TRUE(Forward(*Client("tok-c"), &again).ok());
  EXPECT_EQ(Stats().requests(), 4u);
  EXPECT_EQ(admission_->stats().in_flight, 0);
}

// ForwardRaw and TCP channels count against the same per-client quota as Forward: the TCP
// channel under the identity of the call that opened it.
TEST_F(AdmissionTest, RawAndTcpPathsShareTheQuota) {
  StartShard({.max_inflight_per_client = 1});
  auto alice_channel = MakeChannel(address_, ChannelSecurity{nullptr, "tok-a"});
  absl::StatusOr<std::unique_ptr<TcpChannel>> alice_tcp =
      TcpChannel::Open(alice_channel.get(), "127.0.0.1");
  ASSERT_TRUE(alice_tcp.ok()) << alice_tcp.status();
  v1::ForwardRequest header = request_;
  const std::string payload = header.hidden_states().data().data();
  header.mutable_hidden_states()->mutable_data()->clear_data();
  std::vector<uint8_t> out(expected_.view().NumBytes());

  auto alice = Client("tok-a");
  v1::ForwardResponse a_response;
  grpc::Status a_status;
  std::thread a;
  if (!StartHeld(*alice, a, a_status, a_response)) {
    FAIL() << "alice's request never reached the backend: " << a_status.error_message();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  EXPECT_EQ(ForwardRaw(alice_channel.get(), &ctx, header, payload).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*alice_tcp)->Forward(header, payload, absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE((*alice_tcp)->broken());  // a refusal keeps the connection

  backend_->Open();
  a.join();
  ASSERT_TRUE(a_status.ok()) << a_status.error_message();
  absl::StatusOr<v1::ForwardResponse> again =
      (*alice_tcp)->Forward(header, payload, absl::MakeSpan(out));
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<float> got(expected_.NumElements());
  std::memcpy(got.data(), out.data(), out.size());
  EXPECT_LE(RelativeError(got.data(), expected_.data<float>(), expected_.NumElements()), 1e-3);
  EXPECT_EQ(Stats().rejected(), 2u);
  EXPECT_EQ(admission_->stats().in_flight, 0);
}

TEST_F(AdmissionTest, ExpiredRequestIsDroppedNotRun) {
  StartShard({});
  auto alice = Client("tok-a");
  v1::ForwardResponse a_response;
  grpc::Status a_status;
  std::thread a;
  if (!StartHeld(*alice, a, a_status, a_response)) {
    FAIL() << "alice's request never reached the backend: " << a_status.error_code() << " "
           << a_status.error_message();
  }

  // Bob's request waits behind alice's running batch; its 300 ms deadline passes there.
  auto bob = Client("tok-b");
  v1::ForwardResponse b_response;
  grpc::Status b_status;
  std::thread b([&] { b_status = Forward(*bob, &b_response, absl::Milliseconds(300)); });
  const absl::Time deadline = absl::Now() + kWait;
  while (service_->queued_requests() < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(service_->queued_requests(), 1u);
  b.join();
  EXPECT_EQ(b_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's copy of the deadline comes from the grpc-timeout header: the remaining time,
  // rounded up, counted from the server's receipt. It can pass a little after the client's
  // (CI saw bob run when alice's batch finished right after the client gave up), so the gate
  // opens only once the server's deadline has surely passed too.
  absl::SleepFor(absl::Milliseconds(500));

  backend_->Open();
  a.join();
  ASSERT_TRUE(a_status.ok()) << a_status.error_message();
  ExpectReferenceOutput(a_response);
  // The executor drops bob's request when it forms its batch.
  v1::ShardStats stats = Stats();
  while (stats.expired() < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    stats = Stats();
  }
  EXPECT_EQ(stats.expired(), 1u);
  EXPECT_EQ(stats.requests(), 1u);
  EXPECT_EQ(backend_->entered(), 1);  // only alice's batch reached the backend
  EXPECT_EQ(service_->queued_requests(), 0u);
}

}  // namespace
}  // namespace moe::testing
