// MoeClient over direct TCP channels against real processes: a coordinator and two moe_shard
// processes, only rank 0 started with --tcp_channel. The client sends rank 0's share over a TCP
// channel and falls back to ForwardRaw for rank 1; the combined output matches the CPU reference
// and equals the gRPC-only path's, channels are reused from call to call, and each shard counts
// every route once.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
#include "client/tcp_channel.h"
#include "gtest/gtest.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr int64_t kT = 9, kK = 2;
constexpr double kBackendTolerance = 1e-3;  // the optimized CPU backend against the reference

int CountOccurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TcpChannelE2eTest, ClientUsesChannelsWhereServedAndMatchesTheReference) {
  const std::string dir = FreshTestDir("tcp_channel_e2e_model");
  model::GenerateOptions gen;
  gen.seed = 9;
  ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
  absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(dir);
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(
      {.model_dir = dir, .num_shards = 2, .shard_flags_by_rank = {{"--tcp_channel"}}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  MoeClient& client = (*cluster)->client();

  const int64_t h = (*ref)->config().hidden;
  std::vector<int32_t> ids;
  std::vector<float> w;
  for (int t = 0; t < kT; ++t) {
    ids.insert(ids.end(), {t % 8, (t * 3 + 1) % 8});
    w.insert(w.end(), {0.7f, 0.3f});
  }
  const std::vector<float> x = Bf16RoundedNormals(kT * h, 11);
  absl::StatusOr<HostTensor> want = (*ref)->Run(1, x, ids, w, kK, false);
  ASSERT_TRUE(want.ok()) << want.status();

  auto forward = [&](bool tcp) -> std::vector<float> {
    ForwardOptions fo;
    fo.tcp_channel = tcp ? TcpChannelUse::kAlways : TcpChannelUse::kNever;
    fo.deadline = absl::Seconds(30);
    absl::StatusOr<ForwardResult> r = client.Forward(
        1, MakeView(DType::kF32, {kT, h}, x.data()), MakeView(DType::kI32, {kT, kK}, ids.data()),
        MakeView(DType::kF32, {kT, kK}, w.data()), fo);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    EXPECT_EQ(r->shards_called, 2);
    const float* out = r->output.data<float>();
    return std::vector<float>(out, out + kT * h);
  };
  const std::vector<float> over_grpc = forward(false);
  ASSERT_EQ(over_grpc.size(), static_cast<size_t>(kT * h));
  EXPECT_LE(RelativeError(over_grpc.data(), want->data<float>(), kT * h), kBackendTolerance);
  for (int call = 0; call < 3; ++call) {
    EXPECT_EQ(forward(true), over_grpc) << "call " << call;
  }
  // One channel, opened once and reused, on the shard that serves them; none on the other.
  const std::string log0 = (*cluster)->shard_process(0).Log();
  EXPECT_TRUE(absl::StrContains(log0, "tcp channels on ")) << log0;
  EXPECT_EQ(CountOccurrences(log0, "tcp channel: connection opened"), 1) << log0;
  EXPECT_FALSE(absl::StrContains((*cluster)->shard_process(1).Log(), "tcp channel"));

  absl::StatusOr<v1::LoadStats> stats = client.GetLoadStats(/*refresh=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->total_routes(), 4 * kT * kK);  // four calls, every route counted once
}

// The default, TcpChannelUse::kAuto, on a plaintext cluster: channels where the shards
// serve them; a shard whose channel cannot be opened (here: its one connection slot is taken)
// gets gRPC calls instead of an error, while kAlways fails.
TEST(TcpChannelE2eTest, DefaultFallsBackToGrpcWhenAChannelCannotOpen) {
  const std::string dir = FreshTestDir("tcp_channel_fallback_model");
  model::GenerateOptions gen;
  gen.seed = 4;
  ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
  absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(dir);
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(
      {.model_dir = dir,
       .num_shards = 2,
       .shard_flags_by_rank = {{"--tcp_channel", "--tcp_channel_max_connections=1"},
                               {"--tcp_channel"}}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  MoeClient& client = (*cluster)->client();
  // Shard 0's only connection slot, held for the whole test.
  std::shared_ptr<grpc::Channel> to_shard0 = MakeChannel((*cluster)->shard_address(0));
  absl::StatusOr<std::unique_ptr<TcpChannel>> held = TcpChannel::Open(to_shard0.get(), "127.0.0.1");
  ASSERT_TRUE(held.ok()) << held.status();

  const int64_t h = (*ref)->config().hidden;
  std::vector<int32_t> ids;
  std::vector<float> w;
  for (int t = 0; t < kT; ++t) {
    ids.insert(ids.end(), {(t * 5) % 8, (t * 3 + 2) % 8});
    w.insert(w.end(), {0.6f, 0.4f});
  }
  const std::vector<float> x = Bf16RoundedNormals(kT * h, 5);
  absl::StatusOr<HostTensor> want = (*ref)->Run(0, x, ids, w, kK, false);
  ASSERT_TRUE(want.ok()) << want.status();
  auto forward = [&](ForwardOptions fo) {
    return client.Forward(0, MakeView(DType::kF32, {kT, h}, x.data()),
                          MakeView(DType::kI32, {kT, kK}, ids.data()),
                          MakeView(DType::kF32, {kT, kK}, w.data()), fo);
  };
  for (int call = 0; call < 2; ++call) {
    absl::StatusOr<ForwardResult> r = forward(ForwardOptions{});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->shards_called, 2);
    EXPECT_LE(RelativeError(r->output.data<float>(), want->data<float>(), kT * h),
              kBackendTolerance);
  }
  ForwardOptions always;
  always.tcp_channel = TcpChannelUse::kAlways;
  always.deadline = absl::Seconds(5);
  absl::StatusOr<ForwardResult> refused = forward(always);
  // The shard's refusal (or, should its close overtake the answer, the broken connection).
  EXPECT_TRUE(refused.status().code() == absl::StatusCode::kResourceExhausted ||
              refused.status().code() == absl::StatusCode::kUnavailable)
      << refused.status();
  // Shard 1 served both default calls over one channel of its own; shard 0 only the held one.
  EXPECT_EQ(CountOccurrences((*cluster)->shard_process(1).Log(), "tcp channel: connection opened"),
            1);
  EXPECT_EQ(CountOccurrences((*cluster)->shard_process(0).Log(), "tcp channel: connection opened"),
            1);
}

}  // namespace
}  // namespace moe::testing
