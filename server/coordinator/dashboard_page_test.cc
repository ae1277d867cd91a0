// Dashboard content: query parsing, the view's grid, the HTML page (cells, attributes, escaping,
// no external resources), the balancedness chart and the JSON document.
#include "server/coordinator/dashboard_page.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'700'000'100);

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos;
       p = haystack.find(needle, p + needle.size())) {
    ++n;
  }
  return n;
}

// 2 layers x 3 experts, 2 shards; the window saw only layer 0.
DashboardSnapshot Snapshot() {
  DashboardSnapshot s;
  s.now = kNow;
  s.expected_shards = 2;
  s.stats.set_map_version(7);
  s.stats.set_total_routes(30);
  const std::vector<std::vector<int64_t>> experts = {{10, 4, 6}, {0, 9, 1}};
  const std::vector<std::vector<int64_t>> shards = {{14, 6}, {9, 1}};
  const std::vector<double> balance = {10.0 / 14, 5.0 / 9};
  for (int l = 0; l < 2; ++l) {
    v1::LayerLoad* layer = s.stats.add_layers();
    layer->set_layer(l);
    layer->mutable_expert_load()->Add(experts[l].begin(), experts[l].end());
    layer->mutable_shard_load()->Add(shards[l].begin(), shards[l].end());
    layer->set_balancedness(balance[l]);
  }
  for (int r = 0; r < 2; ++r) {
    v1::ShardLoad* shard = s.stats.add_shards();
    shard->set_rank(r);
    shard->set_shard_id(absl::StrCat("shard-", r));
    shard->set_alive(r == 0);
    shard->set_requests(100 + r);
    shard->set_tokens(1000 + r);
  }
  s.map.emplace();
  s.map->set_version(7);
  v1::ShardEntry* a = s.map->add_shards();
  a->set_address("127.0.0.1:5000");
  a->set_ready(true);
  v1::ShardEntry* b = s.map->add_shards();
  b->set_address("<evil&host>");
  b->set_state(v1::SHARD_DRAINING);
  s.window.span = absl::Seconds(10);
  s.window.num_layers = 2;
  s.window.num_experts = 3;
  s.window.expert_load = {2, 0, 1, 0, 0, 0};
  s.window.routes = 3;
  s.window.balancedness = {0.5, std::nan("")};
  for (int k = 0; k < 4; ++k) {
    BalancednessPoint p;
    p.time = kNow - absl::Seconds(3 - k);
    p.mean = k == 1 ? std::nan("") : 0.5 + 0.1 * k;
    p.min = k == 1 ? std::nan("") : 0.4;
    p.per_layer = {p.mean, std::nan("")};
    s.history.push_back(p);
  }
  return s;
}

TEST(DashboardPageTest, ParsesQuery) {
  EXPECT_EQ(ParseDashboardQuery("").view, HeatmapView::kAuto);
  EXPECT_EQ(ParseDashboardQuery("").refresh_seconds, 5);
  DashboardPageOptions o = ParseDashboardQuery("view=cumulative&refresh=0");
  EXPECT_EQ(o.view, HeatmapView::kCumulative);
  EXPECT_EQ(o.refresh_seconds, 0);
  EXPECT_EQ(ParseDashboardQuery("refresh=99999&view=bogus").refresh_seconds, 5);
  EXPECT_EQ(ParseDashboardQuery("refresh=-1").refresh_seconds, 5);
  EXPECT_EQ(ParseDashboardQuery("x&view=window&=").view, HeatmapView::kWindow);
}

TEST(DashboardPageTest, GridOfEachView) {
  const DashboardSnapshot s = Snapshot();
  HeatmapGrid window = DashboardGrid(s, HeatmapView::kAuto);  // the window has routes
  EXPECT_EQ(window.loads, (std::vector<int64_t>{2, 0, 1, 0, 0, 0}));
  EXPECT_EQ(window.row_notes, (std::vector<std::string>{"bal 0.500", "bal -"}));
  HeatmapGrid cumulative = DashboardGrid(s, HeatmapView::kCumulative);
  EXPECT_EQ(cumulative.loads, (std::vector<int64_t>{10, 4, 6, 0, 9, 1}));
  EXPECT_EQ(cumulative.row_notes, (std::vector<std::string>{"bal 0.714", "bal 0.556"}));
  ASSERT_EQ(cumulative.cell_attributes.size(), 2u);
  EXPECT_EQ(cumulative.cell_attributes[0].first, "cumulative");
  EXPECT_EQ(cumulative.cell_attributes[1].second, window.loads);
  ASSERT_TRUE(ValidateGrid(cumulative).ok());

  DashboardSnapshot idle = s;
  idle.window.routes = 0;
  idle.window.expert_load.assign(6, 0);
  EXPECT_EQ(DashboardGrid(idle, HeatmapView::kAuto).loads, cumulative.loads);
}

TEST(DashboardPageTest, HtmlHasEveryCellAndNoExternalResources) {
  const std::string html = RenderDashboardHtml(Snapshot(), {.view = HeatmapView::kCumulative});
  EXPECT_TRUE(absl::StartsWith(html, "<!DOCTYPE html>"));
  EXPECT_EQ(Count(html, "<rect class=\"cell\""), 6u);
  EXPECT_TRUE(absl::StrContains(html, "data-layer=\"1\" data-expert=\"1\" data-load=\"9\""));
  EXPECT_TRUE(absl::StrContains(html, "data-cumulative=\"9\" data-window=\"0\""));
  EXPECT_TRUE(absl::StrContains(html, "<div id=\"heatmap\" data-view=\"cumulative\">"));
  EXPECT_TRUE(absl::StrContains(html, "<meta http-equiv=\"refresh\" content=\"5\">"));
  EXPECT_TRUE(absl::StrContains(html, "map version <b>7</b>"));
  EXPECT_TRUE(absl::StrContains(html, "shards alive 1/2, ready 1/2"));
  EXPECT_TRUE(
      absl::StrContains(html, "<td>&lt;evil&amp;host&gt;</td><td>draining</td><td>no</td>"));
  EXPECT_TRUE(absl::StrContains(html, "<td>127.0.0.1:5000</td><td>active</td><td>yes</td>"));
  EXPECT_FALSE(absl::StrContains(html, "<evil"));
  EXPECT_FALSE(absl::StrContains(html, "<script"));
  EXPECT_FALSE(absl::StrContains(html, "<link"));
  EXPECT_FALSE(absl::StrContains(html, "src="));
  EXPECT_EQ(Count(html, "<tr>"), 1u + 2u + 1u + 2u);  // two tables: header + rows each

  const std::string no_refresh = RenderDashboardHtml(Snapshot(), {.refresh_seconds = 0});
  EXPECT_FALSE(absl::StrContains(no_refresh, "http-equiv"));
  EXPECT_TRUE(absl::StrContains(no_refresh, "data-view=\"window\""));

  DashboardSnapshot empty;
  empty.now = kNow;
  const std::string waiting = RenderDashboardHtml(empty, {});
  EXPECT_TRUE(absl::StrContains(waiting, "waiting for shards"));
  EXPECT_EQ(Count(waiting, "class=\"cell\""), 0u);
}

TEST(DashboardPageTest, BalancednessChartSplitsAtIdleIntervals) {
  const std::string chart = RenderBalancednessChart(Snapshot().history, kNow);
  EXPECT_TRUE(absl::StrContains(chart, "data-points=\"4\""));
  // Points 0, 2 and 3 have values; the NaN at 1 splits the line into two polylines.
  EXPECT_EQ(Count(chart, "<polyline class=\"mean\""), 2u);
  EXPECT_EQ(Count(chart, "<circle class=\"mean\""), 3u);
  EXPECT_EQ(Count(chart, "<polyline class=\"min\""), 2u);
  // The latest point (0.8) is labelled.
  EXPECT_TRUE(absl::StrContains(chart, "mean over layers (latest) 0.800"));
  // Time runs 3 s back from now: the last point sits at the plot's right edge (x = 628).
  EXPECT_TRUE(absl::StrContains(chart, "cx=\"628.0\"")) << chart;
  EXPECT_TRUE(absl::StrContains(RenderBalancednessChart({}, kNow), "no samples yet"));
}

TEST(DashboardPageTest, JsonCarriesLoadsAndNullForIdle) {
  const nlohmann::json j = nlohmann::json::parse(RenderLoadJson(Snapshot()));
  EXPECT_EQ(j["map_version"], 7);
  EXPECT_EQ(j["num_layers"], 2);
  EXPECT_EQ(j["num_experts"], 3);
  EXPECT_EQ(j["window_routes"], 3);
  EXPECT_EQ(j["window_seconds"], 10.0);
  EXPECT_EQ(j["layers"][0]["expert_load"], nlohmann::json({10, 4, 6}));
  EXPECT_EQ(j["layers"][0]["window_load"], nlohmann::json({2, 0, 1}));
  EXPECT_EQ(j["layers"][1]["shard_load"], nlohmann::json({9, 1}));
  EXPECT_TRUE(j["layers"][1]["window_balancedness"].is_null());
  EXPECT_EQ(j["shards"][1]["address"], "<evil&host>");
  EXPECT_EQ(j["shards"][1]["alive"], false);
  EXPECT_EQ(j["shards"][1]["state"], "draining");
  EXPECT_EQ(j["shards"][0]["ready"], true);
  ASSERT_EQ(j["balancedness_history"].size(), 4u);
  EXPECT_TRUE(j["balancedness_history"][1]["mean"].is_null());
  EXPECT_NEAR(j["balancedness_history"][3]["mean"].get<double>(), 0.8, 1e-12);
  EXPECT_EQ(j["balancedness_history"][3]["time_unix_ms"], absl::ToUnixMillis(kNow));
}

}  // namespace
}  // namespace moe
