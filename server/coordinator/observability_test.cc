// CoordinatorObservability over real HTTP against an in-process ClusterState fed by hand-made
// heartbeats: /metrics values and cardinality (with and without per-expert series), the dashboard
// page and /api/load.
#include "server/coordinator/observability.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/common/http_get.h"
#include "server/common/prometheus_text.h"

namespace moe {
namespace {

using ::moe::testing::HttpGet;
using ::moe::testing::ParsePrometheusText;
using ::moe::testing::PromScrape;

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

// 2 shards, 2 layers, 4 experts, no redundant slots: slots 0-1 on rank 0, 2-3 on rank 1.
// Layer 0 expert loads {5, 3, 2, 10}, layer 1 {1, 0, 0, 4}.
std::unique_ptr<ClusterState> LoadedState() {
  ClusterOptions options;
  options.num_shards = 2;
  // Long enough that the shards stay alive however slowly the test runs.
  options.heartbeat_interval = absl::Seconds(60);
  auto state = std::make_unique<ClusterState>(options);
  v1::ModelShape model;
  model.set_fingerprint("fp");
  model.set_num_layers(2);
  model.set_num_experts(4);
  model.set_top_k(2);
  model.set_hidden_size(8);
  model.set_intermediate_size(8);
  const std::vector<std::vector<int64_t>> counts = {{5, 3, 0, 0, 1, 0, 0, 0},
                                                    {0, 0, 2, 10, 0, 0, 0, 4}};
  std::vector<std::string> ids;
  for (int r = 0; r < 2; ++r) {
    v1::RegisterShardRequest reg;
    reg.set_address(absl::StrCat("127.0.0.1:", 7000 + r));
    reg.set_requested_rank(r);
    *reg.mutable_model() = model;
    absl::StatusOr<v1::RegisterShardResponse> response = state->RegisterShard(reg);
    EXPECT_TRUE(response.ok()) << response.status();
    ids.push_back(response.ok() ? response->shard_id() : "");
  }
  for (int r = 0; r < 2; ++r) {
    v1::HeartbeatRequest beat;
    beat.set_shard_id(ids[r]);
    beat.set_ready_map_version(1);
    v1::LoadDelta* delta = beat.mutable_load();
    delta->set_num_layers(2);
    delta->set_num_physical(4);
    delta->mutable_slot_counts()->Add(counts[r].begin(), counts[r].end());
    delta->set_requests(10 + r);
    delta->set_tokens(100 + r);
    delta->set_batches(7);
    delta->set_merged_batches(r);
    absl::StatusOr<v1::HeartbeatResponse> response = state->Heartbeat(beat);
    EXPECT_TRUE(response.ok()) << response.status();
  }
  return state;
}

std::unique_ptr<CoordinatorObservability> Start(const ClusterState* state, bool per_expert) {
  ObservabilityOptions options;
  options.metrics = {"127.0.0.1", 0, ""};
  options.dashboard = {"127.0.0.1", 0, ""};
  options.metrics_per_expert = per_expert;
  options.expected_shards = 2;
  absl::StatusOr<std::unique_ptr<CoordinatorObservability>> o =
      CoordinatorObservability::Start(options, state);
  EXPECT_TRUE(o.ok()) << o.status();
  return o.ok() ? *std::move(o) : nullptr;
}

PromScrape Scrape(int port) {
  absl::StatusOr<testing::HttpResponse> r = HttpGet("127.0.0.1", port, "/metrics", Deadline());
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  absl::StatusOr<PromScrape> scrape = ParsePrometheusText(r->body);
  EXPECT_TRUE(scrape.ok()) << scrape.status();
  return scrape.ok() ? *scrape : PromScrape{};
}

TEST(ObservabilityTest, MetricsFollowTheClusterState) {
  std::unique_ptr<ClusterState> state = LoadedState();
  auto o = Start(state.get(), /*per_expert=*/false);
  ASSERT_NE(o, nullptr);
  const PromScrape m = Scrape(o->metrics_port());
  EXPECT_EQ(m.Value("moe_coordinator_shards_expected"), 2.0);
  EXPECT_EQ(m.Value("moe_coordinator_shards_alive"), 2.0);
  EXPECT_EQ(m.Value("moe_coordinator_shards_ready"), 2.0);
  EXPECT_EQ(m.Value("moe_coordinator_map_version"), 1.0);
  EXPECT_EQ(m.Value("moe_coordinator_layer_routes_total", {{"layer", "0"}}), 20.0);
  EXPECT_EQ(m.Value("moe_coordinator_layer_routes_total", {{"layer", "1"}}), 5.0);
  // Shard loads: layer 0 {8, 12} -> 10/12; layer 1 {1, 4} -> 2.5/4.
  EXPECT_NEAR(*m.Value("moe_coordinator_layer_balancedness", {{"layer", "0"}}), 10.0 / 12, 1e-9);
  EXPECT_NEAR(*m.Value("moe_coordinator_layer_balancedness", {{"layer", "1"}}), 0.625, 1e-9);
  EXPECT_EQ(m.Value("moe_coordinator_shard_routes_total", {{"rank", "0"}}), 9.0);
  EXPECT_EQ(m.Value("moe_coordinator_shard_routes_total", {{"rank", "1"}}), 16.0);
  EXPECT_EQ(m.Value("moe_coordinator_shard_requests_total", {{"rank", "1"}}), 11.0);
  EXPECT_EQ(m.Value("moe_coordinator_shard_tokens_total", {{"rank", "0"}}), 100.0);
  EXPECT_EQ(m.Value("moe_coordinator_shard_merged_batches_total", {{"rank", "1"}}), 1.0);
  EXPECT_EQ(m.Value("moe_coordinator_shard_alive", {{"rank", "0"}}), 1.0);
  EXPECT_EQ(m.types.at("moe_coordinator_layer_routes_total"), "counter");
  EXPECT_EQ(m.types.at("moe_coordinator_layer_balancedness"), "gauge");
  // Bounded by default: no per-expert family at all.
  EXPECT_TRUE(m.Find("moe_coordinator_expert_routes_total").empty());
  size_t coordinator_series = 0;
  for (const auto& s : m.samples) coordinator_series += absl::StartsWith(s.name, "moe_") ? 1 : 0;
  // 4 cluster gauges + 2 layers x (routes, balancedness, at most window) + 2 ranks x 6.
  EXPECT_LE(coordinator_series, 4u + 2 * 3 + 2 * 6);
}

TEST(ObservabilityTest, PerExpertSeriesOnlyWhenAsked) {
  std::unique_ptr<ClusterState> state = LoadedState();
  auto o = Start(state.get(), /*per_expert=*/true);
  ASSERT_NE(o, nullptr);
  const PromScrape m = Scrape(o->metrics_port());
  EXPECT_EQ(m.Find("moe_coordinator_expert_routes_total").size(), 8u);
  const std::map<std::pair<std::string, std::string>, double> expected = {
      {{"0", "0"}, 5}, {{"0", "1"}, 3}, {{"0", "2"}, 2}, {{"0", "3"}, 10},
      {{"1", "0"}, 1}, {{"1", "1"}, 0}, {{"1", "2"}, 0}, {{"1", "3"}, 4}};
  for (const auto& [key, value] : expected) {
    EXPECT_EQ(m.Value("moe_coordinator_expert_routes_total",
                      {{"layer", key.first}, {"expert", key.second}}),
              value)
        << key.first << "/" << key.second;
  }
}

TEST(ObservabilityTest, DashboardPageAndJson) {
  std::unique_ptr<ClusterState> state = LoadedState();
  auto o = Start(state.get(), false);
  ASSERT_NE(o, nullptr);
  absl::StatusOr<testing::HttpResponse> page =
      HttpGet("127.0.0.1", o->dashboard_port(), "/?view=cumulative", Deadline());
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(testing::HeaderValue(*page, "Content-Type"), "text/html; charset=utf-8");
  EXPECT_TRUE(absl::StrContains(page->body, "data-layer=\"0\" data-expert=\"3\" data-load=\"10\""));
  EXPECT_TRUE(absl::StrContains(page->body, "data-layer=\"1\" data-expert=\"0\" data-load=\"1\""));
  EXPECT_TRUE(absl::StrContains(page->body, "127.0.0.1:7001"));

  absl::StatusOr<testing::HttpResponse> api =
      HttpGet("127.0.0.1", o->dashboard_port(), "/api/load", Deadline());
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_EQ(testing::HeaderValue(*api, "Content-Type"), "application/json");
  const nlohmann::json j = nlohmann::json::parse(api->body);
  EXPECT_EQ(j["layers"][0]["expert_load"], nlohmann::json({5, 3, 2, 10}));
  EXPECT_EQ(j["layers"][1]["expert_load"], nlohmann::json({1, 0, 0, 4}));
  EXPECT_EQ(j["total_routes"], 25);

  absl::StatusOr<testing::HttpResponse> missing =
      HttpGet("127.0.0.1", o->dashboard_port(), "/favicon.ico", Deadline());
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);
}

TEST(ObservabilityTest, EndpointsOffAndBadOptions) {
  std::unique_ptr<ClusterState> state = LoadedState();
  absl::StatusOr<std::unique_ptr<CoordinatorObservability>> off =
      CoordinatorObservability::Start(ObservabilityOptions{}, state.get());
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ((*off)->metrics_port(), 0);
  EXPECT_EQ((*off)->dashboard_port(), 0);

  ObservabilityOptions bad;
  bad.sample_interval = absl::ZeroDuration();
  EXPECT_EQ(CoordinatorObservability::Start(bad, state.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = {};
  bad.dashboard.port = 65536;
  EXPECT_EQ(CoordinatorObservability::Start(bad, state.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe
