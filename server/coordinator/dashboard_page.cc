#include "server/coordinator/dashboard_page.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {

constexpr char kStyle[] =
    "body{font-family:sans-serif;margin:16px;color:#222}"
    "h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:18px 0 6px}"
    ".summary{color:#444}table{border-collapse:collapse;font-size:12px}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    "th{background:#f3f3f3}a{color:#0645ad}";

HeatmapView Resolve(HeatmapView view, const DashboardSnapshot& s) {
  if (view != HeatmapView::kAuto) return view;
  return s.window.routes > 0 ? HeatmapView::kWindow : HeatmapView::kCumulative;
}

std::string FormatBalance(double b) { return std::isnan(b) ? "-" : absl::StrFormat("%.3f", b); }

int64_t Sum(const v1::LayerLoad& layer) {
  int64_t total = 0;
  for (int64_t v : layer.expert_load()) total += v;
  return total;
}

// Cumulative counts laid out like the window's: [layers * experts].
std::vector<int64_t> CumulativeLoads(const v1::LoadStats& stats, int cols) {
  std::vector<int64_t> loads(static_cast<size_t>(stats.layers_size()) * cols, 0);
  for (int l = 0; l < stats.layers_size(); ++l) {
    const v1::LayerLoad& layer = stats.layers(l);
    for (int e = 0; e < std::min(cols, layer.expert_load_size()); ++e) {
      loads[static_cast<size_t>(l) * cols + e] = std::max<int64_t>(0, layer.expert_load(e));
    }
  }
  return loads;
}

std::string Summary(const DashboardSnapshot& s) {
  int alive = 0, ready = 0;
  for (const v1::ShardLoad& shard : s.stats.shards()) alive += shard.alive() ? 1 : 0;
  if (s.map.has_value()) {
    for (const v1::ShardEntry& shard : s.map->shards()) ready += shard.ready() ? 1 : 0;
  }
  int experts = 0;
  for (const v1::LayerLoad& layer : s.stats.layers()) {
    experts = std::max(experts, layer.expert_load_size());
  }
  return absl::StrFormat(
      "<p class=\"summary\" id=\"summary\">map version <b>%d</b> &middot; shards alive %d/%d, "
      "ready %d/%d &middot; %d layers &times; %d experts &middot; %d routes in total, %d in the "
      "last %.0f s</p>\n",
      s.stats.map_version(), alive, s.expected_shards, ready, s.expected_shards,
      s.stats.layers_size(), experts, s.stats.total_routes(), s.window.routes,
      absl::ToDoubleSeconds(s.window.span));
}

std::string LayerTable(const DashboardSnapshot& s) {
  std::string out =
      "<table id=\"layers\"><tr><th>layer</th><th>routes</th><th>routes in window</th>"
      "<th>balancedness</th><th>window balancedness</th></tr>\n";
  for (int l = 0; l < s.stats.layers_size(); ++l) {
    const v1::LayerLoad& layer = s.stats.layers(l);
    int64_t window_routes = 0;
    for (int e = 0; e < s.window.num_experts; ++e) {
      if (l < s.window.num_layers) {
        window_routes += s.window.expert_load[static_cast<size_t>(l) * s.window.num_experts + e];
      }
    }
    const double wb = l < static_cast<int>(s.window.balancedness.size()) ? s.window.balancedness[l]
                                                                         : std::nan("");
    absl::StrAppendFormat(
        &out, "<tr><td>%d</td><td>%d</td><td>%d</td><td>%s</td><td>%s</td></tr>\n", l, Sum(layer),
        window_routes, FormatBalance(layer.balancedness()), FormatBalance(wb));
  }
  return out + "</table>\n";
}

// The map's entry for `rank`, or null before publication.
const v1::ShardEntry* MapEntry(const DashboardSnapshot& s, uint32_t rank) {
  if (!s.map.has_value() || rank >= static_cast<uint32_t>(s.map->shards_size())) return nullptr;
  return &s.map->shards(rank);
}

// "active", "draining", ... ("?" without a map entry).
std::string StateName(const v1::ShardEntry* entry) {
  if (entry == nullptr) return "?";
  const std::string full = v1::ShardState_Name(entry->state());
  absl::string_view name = full;
  absl::ConsumePrefix(&name, "SHARD_");
  return absl::AsciiStrToLower(name);
}

std::string ShardTable(const DashboardSnapshot& s) {
  std::string out =
      "<table id=\"shards\"><tr><th>rank</th><th>address</th><th>state</th><th>alive</th>"
      "<th>ready</th><th>requests</th><th>tokens</th><th>batches</th><th>merged</th></tr>\n";
  for (const v1::ShardLoad& shard : s.stats.shards()) {
    const v1::ShardEntry* entry = MapEntry(s, shard.rank());
    absl::StrAppendFormat(
        &out,
        "<tr><td>%d</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%d</td><td>%d</td>"
        "<td>%d</td><td>%d</td></tr>\n",
        shard.rank(), XmlEscape(entry != nullptr ? entry->address() : "?"), StateName(entry),
        shard.alive() ? "yes" : "no", entry != nullptr && entry->ready() ? "yes" : "no",
        shard.requests(), shard.tokens(), shard.batches(), shard.merged_batches());
  }
  return out + "</table>\n";
}

// Polylines through the finite points of `xy`, a NaN y ending the current segment, plus a dot
// per point so that isolated points (load in one interval only) show too.
std::string Polylines(const std::vector<std::pair<double, double>>& xy, const char* cls,
                      const char* style, const char* color) {
  std::string out, points;
  for (const auto& [x, y] : xy) {
    if (!std::isnan(y)) {
      absl::StrAppendFormat(&out,
                            "<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"2\" "
                            "fill=\"%s\"/>\n",
                            cls, x, y, color);
    }
  }
  auto flush = [&] {
    if (!points.empty()) {
      absl::StrAppend(&out, "<polyline class=\"", cls, "\" fill=\"none\" stroke=\"", color, "\" ",
                      style, " points=\"", points, "\"/>\n");
    }
    points.clear();
  };
  for (const auto& [x, y] : xy) {
    if (std::isnan(y)) {
      flush();
      continue;
    }
    absl::StrAppendFormat(&points, "%s%.1f,%.1f", points.empty() ? "" : " ", x, y);
  }
  flush();
  return out;
}

}  // namespace

DashboardPageOptions ParseDashboardQuery(absl::string_view query) {
  DashboardPageOptions options;
  for (absl::string_view pair : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(pair, absl::MaxSplits('=', 1));
    int refresh = 0;
    if (kv.first == "view" && kv.second == "window") options.view = HeatmapView::kWindow;
    if (kv.first == "view" && kv.second == "cumulative") options.view = HeatmapView::kCumulative;
    if (kv.first == "refresh" && absl::SimpleAtoi(kv.second, &refresh) && refresh >= 0 &&
        refresh <= 3600) {
      options.refresh_seconds = refresh;
    }
  }
  return options;
}

HeatmapGrid DashboardGrid(const DashboardSnapshot& s, HeatmapView view) {
  view = Resolve(view, s);
  HeatmapGrid grid;
  grid.rows = s.stats.layers_size();
  for (const v1::LayerLoad& layer : s.stats.layers()) {
    grid.cols = std::max(grid.cols, layer.expert_load_size());
  }
  std::vector<int64_t> cumulative = CumulativeLoads(s.stats, grid.cols);
  std::vector<int64_t> window = s.window.expert_load;
  if (s.window.num_layers != grid.rows || s.window.num_experts != grid.cols) {
    window.assign(cumulative.size(), 0);  // no comparable window yet
  }
  grid.loads = view == HeatmapView::kWindow ? window : cumulative;
  for (int l = 0; l < grid.rows; ++l) {
    const double b =
        view == HeatmapView::kWindow
            ? (l < static_cast<int>(s.window.balancedness.size()) ? s.window.balancedness[l]
                                                                  : std::nan(""))
            : s.stats.layers(l).balancedness();
    grid.row_notes.push_back(absl::StrCat("bal ", FormatBalance(b)));
  }
  grid.cell_attributes = {{"cumulative", std::move(cumulative)}, {"window", std::move(window)}};
  return grid;
}

std::string RenderBalancednessChart(const std::vector<BalancednessPoint>& history, absl::Time now) {
  constexpr int kWidth = 640, kHeight = 200, kLeft = 44, kRight = 12, kTop = 10, kBottom = 26;
  constexpr int kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"balance-chart\" width=\"%d\" "
      "height=\"%d\" data-points=\"%d\" font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n",
      kWidth, kHeight, history.size());
  for (int k = 0; k <= 4; ++k) {
    const double y = kTop + kPlotH * (1 - k / 4.0);
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#e0e0e0\"/>"
                          "<text x=\"4\" y=\"%.1f\">%.2f</text>\n",
                          kLeft, y, kLeft + kPlotW, y, y + 4, k / 4.0);
  }
  if (history.empty()) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\">no samples yet</text>\n</svg>\n",
                          kLeft + 10, kTop + kPlotH / 2);
    return svg;
  }
  const absl::Time t0 = std::min(history.front().time, now - absl::Seconds(1));
  const double span = absl::ToDoubleSeconds(now - t0);
  std::vector<std::pair<double, double>> mean, min;
  for (const BalancednessPoint& p : history) {
    const double x = kLeft + kPlotW * absl::ToDoubleSeconds(p.time - t0) / span;
    auto y = [](double v) {
      return std::isnan(v) ? v : kTop + kPlotH * (1 - std::clamp(v, 0.0, 1.0));
    };
    mean.emplace_back(x, y(p.mean));
    min.emplace_back(x, y(p.min));
  }
  absl::StrAppend(&svg, Polylines(min, "min", "stroke-dasharray=\"4 3\"", "#ff7f0e"),
                  Polylines(mean, "mean", "stroke-width=\"2\"", "#1f77b4"));
  // The latest interval may have been idle: label the latest one with load.
  double latest_mean = std::nan(""), latest_min = std::nan("");
  for (const BalancednessPoint& p : history) {
    if (!std::isnan(p.mean)) {
      latest_mean = p.mean;
      latest_min = p.min;
    }
  }
  absl::StrAppendFormat(
      &svg,
      "<text x=\"%d\" y=\"%d\">-%.0f s</text><text x=\"%d\" y=\"%d\" "
      "text-anchor=\"end\">now</text>\n"
      "<text x=\"%d\" y=\"%d\" fill=\"#1f77b4\">mean over layers (latest) %s</text>"
      "<text x=\"%d\" y=\"%d\" fill=\"#ff7f0e\">worst layer %s</text>\n</svg>\n",
      kLeft, kHeight - 8, span, kLeft + kPlotW, kHeight - 8, kLeft + 60, kHeight - 8,
      FormatBalance(latest_mean), kLeft + 320, kHeight - 8, FormatBalance(latest_min));
  return svg;
}

std::string RenderDashboardHtml(const DashboardSnapshot& s, const DashboardPageOptions& options) {
  const HeatmapView view = Resolve(options.view, s);
  const bool window = view == HeatmapView::kWindow;
  const HeatmapGrid grid = DashboardGrid(s, view);
  SvgHeatmapOptions svg;
  // About 1100 x 560 px of cells whatever the model's shape, within readable cell sizes.
  svg.cell_width = std::clamp(1100 / std::max(grid.cols, 1), 3, 40);
  svg.cell_height = std::clamp(560 / std::max(grid.rows, 1), 6, 28);
  std::string html = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
  if (options.refresh_seconds > 0) {
    absl::StrAppend(&html, "<meta http-equiv=\"refresh\" content=\"", options.refresh_seconds,
                    "\">\n");
  }
  absl::StrAppend(&html, "<title>moe-serve coordinator</title>\n<style>", kStyle,
                  "</style></head>\n<body>\n<h1>moe-serve coordinator</h1>\n", Summary(s));
  absl::StrAppendFormat(
      &html,
      "<h2>Expert load: %s</h2>\n<p>Color: each expert's share of its layer's routes. "
      "Show <a href=\"/?view=window\">window</a> | <a href=\"/?view=cumulative\">cumulative</a>"
      " &middot; <a href=\"/api/load\">JSON</a></p>\n<div id=\"heatmap\" data-view=\"%s\">\n",
      window ? absl::StrFormat("last %.0f s", absl::ToDoubleSeconds(s.window.span))
             : std::string("cumulative"),
      window ? "window" : "cumulative");
  if (grid.rows == 0) {
    absl::StrAppend(&html, "<p>No model registered yet: waiting for shards.</p>\n");
  } else {
    absl::StrAppend(&html, RenderSvgHeatmap(grid, svg));
  }
  absl::StrAppend(&html, "</div>\n<h2>Balancedness over time (mean / max shard load)</h2>\n",
                  "<div id=\"balancedness\">\n", RenderBalancednessChart(s.history, s.now),
                  "</div>\n<h2>Layers</h2>\n", LayerTable(s), "<h2>Shards</h2>\n", ShardTable(s),
                  "</body></html>\n");
  return html;
}

std::string RenderLoadJson(const DashboardSnapshot& s) {
  using nlohmann::json;
  auto number = [](double v) { return std::isnan(v) ? json(nullptr) : json(v); };
  json out;
  out["time_unix_ms"] = absl::ToUnixMillis(s.now);
  out["map_version"] = s.stats.map_version();
  out["expected_shards"] = s.expected_shards;
  out["total_routes"] = s.stats.total_routes();
  out["window_seconds"] = absl::ToDoubleSeconds(s.window.span);
  out["window_routes"] = s.window.routes;
  const HeatmapGrid grid = DashboardGrid(s, HeatmapView::kWindow);
  out["num_layers"] = grid.rows;
  out["num_experts"] = grid.cols;
  json layers = json::array();
  for (int l = 0; l < s.stats.layers_size(); ++l) {
    const v1::LayerLoad& layer = s.stats.layers(l);
    const auto row = grid.loads.begin() + static_cast<size_t>(l) * grid.cols;
    layers.push_back(
        {{"layer", layer.layer()},
         {"expert_load",
          std::vector<int64_t>(layer.expert_load().begin(), layer.expert_load().end())},
         {"window_load", std::vector<int64_t>(row, row + grid.cols)},
         {"shard_load", std::vector<int64_t>(layer.shard_load().begin(), layer.shard_load().end())},
         {"balancedness", layer.balancedness()},
         {"window_balancedness",
          number(l < static_cast<int>(s.window.balancedness.size()) ? s.window.balancedness[l]
                                                                    : std::nan(""))}});
  }
  out["layers"] = std::move(layers);
  json shards = json::array();
  for (const v1::ShardLoad& shard : s.stats.shards()) {
    const v1::ShardEntry* entry = MapEntry(s, shard.rank());
    shards.push_back({{"rank", shard.rank()},
                      {"shard_id", shard.shard_id()},
                      {"address", entry != nullptr ? entry->address() : ""},
                      {"state", StateName(entry)},
                      {"alive", shard.alive()},
                      {"ready", entry != nullptr && entry->ready()},
                      {"requests", shard.requests()},
                      {"tokens", shard.tokens()},
                      {"batches", shard.batches()},
                      {"merged_batches", shard.merged_batches()}});
  }
  out["shards"] = std::move(shards);
  json history = json::array();
  for (const BalancednessPoint& p : s.history) {
    json per_layer = json::array();
    for (double b : p.per_layer) per_layer.push_back(number(b));
    history.push_back({{"time_unix_ms", absl::ToUnixMillis(p.time)},
                       {"mean", number(p.mean)},
                       {"min", number(p.min)},
                       {"per_layer", std::move(per_layer)}});
  }
  out["balancedness_history"] = std::move(history);
  // Replace, never throw, should a shard id ever carry invalid UTF-8.
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace moe
