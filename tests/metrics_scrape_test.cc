// Prometheus metrics of real processes: a moe_coordinator and two moe_shard processes, driven with
// raw Forward calls of known sizes (and two bad ones), then scraped over HTTP. The shard counters
// must equal what was sent, request by request; the coordinator's families must equal its own
// GetLoadStats answer; label cardinality stays per layer / per rank unless --metrics_per_expert.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/tcp_channel.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"
#include "moe/v1/tcp.grpc.pb.h"
#include "server/common/tcp_channel_frame.h"
#include "server/common/http_get.h"
#include "server/common/prometheus_text.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr absl::Duration kDeadline = absl::Seconds(30);
constexpr int kLayers = 2, kExperts = 8, kTopK = 2, kHidden = 128;

// Polls a port file the server writes at start-up (bounded by kDeadline).
absl::StatusOr<int> ReadPortFile(const std::string& path) {
  const absl::Time give_up = absl::Now() + kDeadline;
  while (absl::Now() < give_up) {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    int port = 0;
    if (absl::EndsWith(text, "\n") && absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port)) {
      return port;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port in ", path));
}

PromScrape Scrape(int port) {
  absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", port, "/metrics", absl::Now() + kDeadline);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  EXPECT_EQ(r->status, 200);
  absl::StatusOr<PromScrape> scrape = ParsePrometheusText(r->body);
  EXPECT_TRUE(scrape.ok()) << scrape.status() << "\n" << r->body;
  return scrape.ok() ? *scrape : PromScrape{};
}

// A blocking TCP connection to 127.0.0.1:port.
absl::StatusOr<int> ConnectLoopback(uint32_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to port ", port));
  }
  return fd;
}

size_t SeriesWithPrefix(const PromScrape& scrape, absl::string_view prefix) {
  size_t n = 0;
  for (const PromSample& s : scrape.samples) n += absl::StartsWith(s.name, prefix) ? 1 : 0;
  return n;
}

class MetricsScrapeTest : public ::testing::Test {
 protected:
  void StartCluster(bool per_expert, std::vector<std::string> shard0_flags = {}) {
    const std::string model_dir = FreshTestDir("metrics_model");
    model::GenerateOptions gen;
    gen.layers = kLayers;
    gen.experts = kExperts;
    gen.top_k = kTopK;
    gen.hidden = kHidden;
    ASSERT_TRUE(model::GenerateModel(gen, model_dir).ok());
    dir_ = FreshTestDir("metrics_ports");
    LocalClusterOptions options{.model_dir = model_dir, .num_shards = 2, .redundant_slots = 2};
    options.coordinator_flags = {absl::StrCat("--metrics_port_file=", dir_, "/coordinator")};
    if (per_expert) options.coordinator_flags.push_back("--metrics_per_expert");
    for (int r = 0; r < 2; ++r) {
      options.shard_flags_by_rank.push_back(
          {absl::StrCat("--metrics_port_file=", dir_, "/shard", r)});
    }
    for (std::string& f : shard0_flags) options.shard_flags_by_rank[0].push_back(std::move(f));
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    map_ = cluster_->client().cluster_map();
  }

  int MetricsPort(const std::string& name) {
    absl::StatusOr<int> port = ReadPortFile(absl::StrCat(dir_, "/", name));
    EXPECT_TRUE(port.ok()) << port.status();
    return port.ok() ? *port : 0;
  }

  // A Forward request of `tokens` tokens (hidden states inside the message).
  static v1::ForwardRequest Request(uint32_t layer, int64_t tokens, uint64_t map_version) {
    std::vector<int32_t> ids(tokens * kTopK);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 3) % kExperts);
    const std::vector<float> w(tokens * kTopK, 0.5f);
    v1::ForwardRequest req;
    req.set_layer(layer);
    req.set_map_version(map_version);
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    SetWireTensor(req.mutable_hidden_states()->mutable_data(), v1::F32, {tokens, kHidden},
                  RawBytes(Bf16RoundedNormals(tokens * kHidden, 7)));
    SetWireTensor(req.mutable_topk_ids(), v1::I32, {tokens, kTopK}, RawBytes(ids));
    SetWireTensor(req.mutable_topk_weights(), v1::F32, {tokens, kTopK}, RawBytes(w));
    return req;
  }

  // One Forward of `tokens` tokens to shard `rank`; returns the gRPC status code.
  grpc::StatusCode Send(int rank, uint32_t layer, int64_t tokens, uint64_t map_version) {
    const v1::ForwardRequest req = Request(layer, tokens, map_version);
    auto stub = v1::ExpertShard::NewStub(MakeChannel(cluster_->shard_address(rank)));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kDeadline));
    v1::ForwardResponse resp;
    return stub->Forward(&ctx, req, &resp).error_code();
  }

  std::string dir_;
  std::unique_ptr<LocalCluster> cluster_;
  v1::ClusterMap map_;
};

TEST_F(MetricsScrapeTest, CountersEqualWhatWasSentAndCardinalityIsBounded) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*per_expert=*/false));
  const uint64_t v = map_.version();
  // Rank 0: layer 0 gets 5 + 7 + 2 tokens, layer 1 gets 4; rank 1: layer 1 gets 3 + 6.
  for (int64_t t : {5, 7, 2}) ASSERT_EQ(Send(0, 0, t, v), grpc::StatusCode::OK);
  ASSERT_EQ(Send(0, 1, 4, v), grpc::StatusCode::OK);
  for (int64_t t : {3, 6}) ASSERT_EQ(Send(1, 1, t, v), grpc::StatusCode::OK);
  // Two failures on rank 0: a layer out of range and a map version it never had.
  ASSERT_EQ(Send(0, 99, 1, v), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(Send(0, 0, 1, v + 1000), grpc::StatusCode::FAILED_PRECONDITION);

  const PromScrape s0 = Scrape(MetricsPort("shard0"));
  EXPECT_EQ(s0.Value("moe_shard_requests_total", {{"layer", "0"}}), 3.0);
  EXPECT_EQ(s0.Value("moe_shard_requests_total", {{"layer", "1"}}), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_tokens_total", {{"layer", "0"}}), 14.0);
  EXPECT_EQ(s0.Value("moe_shard_tokens_total", {{"layer", "1"}}), 4.0);
  EXPECT_EQ(s0.Value("moe_shard_request_errors_total", {{"code", "INVALID_ARGUMENT"}}), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_request_errors_total", {{"code", "FAILED_PRECONDITION"}}), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_forward_latency_seconds_count"), 6.0);  // errors are timed too
  EXPECT_EQ(s0.Value("moe_shard_forward_latency_seconds_bucket", {{"le", "+Inf"}}), 6.0);
  EXPECT_EQ(s0.Value("moe_shard_batches_total"), 4.0);  // one call at a time: nothing merges
  EXPECT_EQ(s0.Value("moe_shard_merged_batches_total"), 0.0);
  EXPECT_EQ(s0.Value("moe_shard_batch_tokens_count"), 4.0);
  EXPECT_EQ(s0.Value("moe_shard_batch_tokens_sum"), 18.0);
  // Batches of 5, 7, 2 and 4 tokens: two are <= 4, all four <= 8.
  EXPECT_EQ(s0.Value("moe_shard_batch_tokens_bucket", {{"le", "4"}}), 2.0);
  EXPECT_EQ(s0.Value("moe_shard_batch_tokens_bucket", {{"le", "8"}}), 4.0);
  EXPECT_EQ(s0.Value("moe_shard_map_version"), static_cast<double>(v));
  EXPECT_EQ(s0.Value("moe_shard_ready"), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_queue_depth"), 0.0);
  EXPECT_EQ(s0.types.at("moe_shard_requests_total"), "counter");
  EXPECT_EQ(s0.types.at("moe_shard_forward_latency_seconds"), "histogram");
  const PromScrape s1 = Scrape(MetricsPort("shard1"));
  EXPECT_EQ(s1.Value("moe_shard_requests_total", {{"layer", "0"}}), 0.0);
  EXPECT_EQ(s1.Value("moe_shard_requests_total", {{"layer", "1"}}), 2.0);
  EXPECT_EQ(s1.Value("moe_shard_tokens_total", {{"layer", "1"}}), 9.0);
  EXPECT_TRUE(s1.Find("moe_shard_request_errors_total").empty());
  // Per layer, per code and fixed buckets: the shard's series do not grow with experts or calls.
  EXPECT_EQ(s0.Find("moe_shard_requests_total").size(), static_cast<size_t>(kLayers));
  // 2 per layer, 2 error codes, 69 histogram lines (18 + 14 + 7 + 18 buckets, each family with
  // +Inf, _sum and _count) and 6 unlabelled series.
  EXPECT_EQ(SeriesWithPrefix(s0, "moe_shard_"), 2u * kLayers + 2 + 69 + 6);

  // The coordinator, after pulling every shard's pending load, against its own RPC answer.
  absl::StatusOr<v1::LoadStats> stats = cluster_->client().GetLoadStats(/*refresh=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  const PromScrape c = Scrape(MetricsPort("coordinator"));
  EXPECT_EQ(c.Value("moe_coordinator_shard_requests_total", {{"rank", "0"}}), 4.0);
  EXPECT_EQ(c.Value("moe_coordinator_shard_tokens_total", {{"rank", "0"}}), 18.0);
  EXPECT_EQ(c.Value("moe_coordinator_shard_requests_total", {{"rank", "1"}}), 2.0);
  EXPECT_EQ(c.Value("moe_coordinator_shard_tokens_total", {{"rank", "1"}}), 9.0);
  EXPECT_EQ(c.Value("moe_coordinator_shards_alive"), 2.0);
  EXPECT_EQ(c.Value("moe_coordinator_shards_ready"), 2.0);
  EXPECT_EQ(c.Value("moe_coordinator_map_version"), static_cast<double>(v));
  ASSERT_EQ(stats->layers_size(), kLayers);
  int64_t all_routes = 0;
  for (const v1::LayerLoad& layer : stats->layers()) {
    int64_t routes = 0;
    for (int64_t x : layer.expert_load()) routes += x;
    all_routes += routes;
    const std::string l = absl::StrCat(layer.layer());
    EXPECT_EQ(c.Value("moe_coordinator_layer_routes_total", {{"layer", l}}),
              static_cast<double>(routes));
    EXPECT_NEAR(*c.Value("moe_coordinator_layer_balancedness", {{"layer", l}}),
                layer.balancedness(), 1e-12);
  }
  // Every route of a non-padded token on a hosting shard: (14 + 4 + 9) tokens x top-2 spread over
  // two shards that each count only their own slots, so the total is positive and at most 54.
  EXPECT_GT(all_routes, 0);
  EXPECT_LE(all_routes, 54);
  EXPECT_EQ(c.Sum("moe_coordinator_shard_routes_total"), static_cast<double>(all_routes));
  EXPECT_TRUE(c.Find("moe_coordinator_expert_routes_total").empty());
  EXPECT_LE(SeriesWithPrefix(c, "moe_coordinator_"), 4u + 3 * kLayers + 6 * 2);
}

// TCP request channels: their connections and requests, and connections refused or ended by a
// bad frame, as series of the shard that serves them (and of no other).
TEST_F(MetricsScrapeTest, TcpChannelSeries) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*per_expert=*/false, {"--tcp_channel"}));
  const uint64_t v = map_.version();
  std::shared_ptr<grpc::Channel> grpc_channel = MakeChannel(cluster_->shard_address(0));
  absl::StatusOr<std::unique_ptr<TcpChannel>> channel =
      TcpChannel::Open(grpc_channel.get(), "127.0.0.1");
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (int64_t tokens : {3, 5}) {
    v1::ForwardRequest req = Request(0, tokens, v);
    const std::string payload = req.hidden_states().data().data();
    req.mutable_hidden_states()->mutable_data()->clear_data();
    std::vector<uint8_t> output(tokens * kHidden * 2);  // BF16, the default output dtype
    absl::StatusOr<v1::ForwardResponse> answer =
        (*channel)->Forward(req, payload, absl::MakeSpan(output));
    ASSERT_TRUE(answer.ok()) << answer.status();
  }
  // A second channel, closed again below: no longer counted as open.
  absl::StatusOr<std::unique_ptr<TcpChannel>> closed =
      TcpChannel::Open(grpc_channel.get(), "127.0.0.1");
  ASSERT_TRUE(closed.ok()) << closed.status();
  {
    // A ticket used twice: the first connection sends a frame with a bad magic (a framing
    // error), the second one's hello is refused.
    v1::TcpChannelShard::Stub stub(grpc_channel);
    grpc::ClientContext ctx;
    v1::OpenTcpChannelResponse opened;
    ASSERT_TRUE(stub.OpenTcpChannel(&ctx, v1::OpenTcpChannelRequest(), &opened).ok());
    for (int attempt = 0; attempt < 2; ++attempt) {
      absl::StatusOr<int> fd = ConnectLoopback(opened.port());
      ASSERT_TRUE(fd.ok()) << fd.status();
      std::string hello(kTcpChannelMagic, sizeof(kTcpChannelMagic));
      hello += opened.ticket();
      uint8_t prefix[kTcpPrefixBytes];
      ASSERT_EQ(send(*fd, hello.data(), hello.size(), MSG_NOSIGNAL),
                static_cast<ssize_t>(hello.size()));
      ASSERT_TRUE(ReadExactly(*fd, prefix, sizeof(prefix), absl::Now() + kDeadline).ok());
      EXPECT_EQ(DecodeTcpPrefix(prefix).word,
                attempt == 0 ? 0u : static_cast<uint32_t>(absl::StatusCode::kPermissionDenied));
      if (attempt == 0) {
        // A frame with a bad magic on the accepted connection.
        EncodeTcpPrefix({0x20544547u, 0, 0}, prefix);
        ASSERT_EQ(send(*fd, prefix, sizeof(prefix), MSG_NOSIGNAL),
                  static_cast<ssize_t>(sizeof(prefix)));
        ASSERT_TRUE(ReadExactly(*fd, prefix, sizeof(prefix), absl::Now() + kDeadline).ok());
        EXPECT_EQ(DecodeTcpPrefix(prefix).word,
                  static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
      }
      close(*fd);
    }
  }
  closed->reset();
  // The shard counts a connection as closed once its thread has seen the close.
  const int port = MetricsPort("shard0");
  PromScrape s0;
  for (const absl::Time give_up = absl::Now() + kDeadline; absl::Now() < give_up;
       absl::SleepFor(absl::Milliseconds(20))) {
    s0 = Scrape(port);
    if (s0.Value("moe_shard_tcp_channel_connections") == 1.0) break;
  }
  EXPECT_EQ(s0.Value("moe_shard_tcp_channel_connections"), 1.0);  // `channel`, still open
  EXPECT_EQ(s0.Value("moe_shard_tcp_channel_requests_total"), 2.0);
  EXPECT_EQ(s0.Value("moe_shard_tcp_channel_refused_total"), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_tcp_channel_framing_errors_total"), 1.0);
  EXPECT_EQ(s0.Value("moe_shard_requests_total", {{"layer", "0"}}), 2.0);
  EXPECT_EQ(s0.types.at("moe_shard_tcp_channel_connections"), "gauge");
  EXPECT_EQ(s0.types.at("moe_shard_tcp_channel_requests_total"), "counter");
  EXPECT_EQ(SeriesWithPrefix(s0, "moe_shard_tcp_channel_"), 4u);
  EXPECT_EQ(SeriesWithPrefix(Scrape(MetricsPort("shard1")), "moe_shard_tcp_channel_"), 0u);
}

TEST_F(MetricsScrapeTest, PerExpertSeriesWhenEnabled) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*per_expert=*/true));
  const uint64_t v = map_.version();
  for (int rank = 0; rank < 2; ++rank) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      ASSERT_EQ(Send(rank, layer, 6 + rank, v), grpc::StatusCode::OK);
    }
  }
  absl::StatusOr<v1::LoadStats> stats = cluster_->client().GetLoadStats(/*refresh=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  const PromScrape c = Scrape(MetricsPort("coordinator"));
  EXPECT_EQ(c.Find("moe_coordinator_expert_routes_total").size(),
            static_cast<size_t>(kLayers * kExperts));
  for (const v1::LayerLoad& layer : stats->layers()) {
    for (int e = 0; e < layer.expert_load_size(); ++e) {
      EXPECT_EQ(c.Value("moe_coordinator_expert_routes_total",
                        {{"layer", absl::StrCat(layer.layer())}, {"expert", absl::StrCat(e)}}),
                static_cast<double>(layer.expert_load(e)))
          << "layer " << layer.layer() << " expert " << e;
    }
  }
}

}  // namespace
}  // namespace moe::testing
