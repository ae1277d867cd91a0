// The coordinator's dashboard content: one self-contained HTML page (inline SVG and CSS, no
// scripts or external resources, so it works offline) with the expert-load heatmap (layers x
// experts), balancedness over time, per-layer and per-shard tables, and the same data as JSON
// for /api/load.
//
// Every heatmap cell carries data-layer, data-expert, data-load (the colored count),
// data-cumulative and data-window, so tests and scripts can read the numbers from the DOM.
//
// Called by CoordinatorObservability's HTTP handler. Thread-safety: pure functions of their
// inputs. Ownership: results are returned by value.
#ifndef MOE_SERVER_COORDINATOR_DASHBOARD_PAGE_H_
#define MOE_SERVER_COORDINATOR_DASHBOARD_PAGE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/moectl/heatmap.h"
#include "moe/v1/coordinator.pb.h"
#include "server/coordinator/load_history.h"

namespace moe {

// Everything one page shows, read at one moment.
struct DashboardSnapshot {
  absl::Time now;
  v1::LoadStats stats;                // cumulative load
  std::optional<v1::ClusterMap> map;  // nullopt before the first map is published
  int expected_shards = 0;
  LoadWindow window;
  std::vector<BalancednessPoint> history;
};

// Which load the heatmap colors. kAuto: the window when it holds any routes, else cumulative.
enum class HeatmapView { kAuto, kWindow, kCumulative };

struct DashboardPageOptions {
  HeatmapView view = HeatmapView::kAuto;
  // <meta http-equiv="refresh"> period; 0 disables it.
  int refresh_seconds = 5;
};

// Reads "view=window|cumulative" and "refresh=N" (0..3600) from a URL query; unknown keys and
// malformed values keep the defaults.
DashboardPageOptions ParseDashboardQuery(absl::string_view query);

// The heatmap grid of `view` (resolved when kAuto), with both counts as cell attributes.
HeatmapGrid DashboardGrid(const DashboardSnapshot& snapshot, HeatmapView view);

std::string RenderDashboardHtml(const DashboardSnapshot& snapshot,
                                const DashboardPageOptions& options);

// An SVG line chart of the mean and minimum per-layer balancedness over `history`, time running
// to `now` on the right.
std::string RenderBalancednessChart(const std::vector<BalancednessPoint>& history, absl::Time now);

// The snapshot as JSON (NaN balancedness as null).
std::string RenderLoadJson(const DashboardSnapshot& snapshot);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_DASHBOARD_PAGE_H_
