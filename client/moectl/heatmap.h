// Expert-load heatmaps (layers x experts) rendered as terminal text (unicode shade blocks, one row
// per layer) or as a standalone SVG document whose cells carry their numbers as data attributes.
//
// The colored quantity is each cell's share of its row's load (so layers with different traffic
// compare), scaled by the largest share in the grid: the hottest cell always gets the darkest
// shade, an idle cell the lightest. Used by `moectl load --heatmap / --heatmap_svg` and by the
// coordinator's dashboard page.
//
// Thread-safety: pure functions. Ownership: results are returned by value.
#ifndef MOE_CLIENT_MOECTL_HEATMAP_H_
#define MOE_CLIENT_MOECTL_HEATMAP_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

struct HeatmapGrid {
  int rows = 0;  // layers
  int cols = 0;  // experts
  // Row-major [rows * cols], non-negative: the loads that are colored (SVG: data-load).
  std::vector<int64_t> loads;
  // Optional per-row text shown after the row (e.g. "bal 0.93"); empty or [rows].
  std::vector<std::string> row_notes;
  // Optional extra per-cell numbers written as SVG attributes data-NAME ([rows * cols] each).
  std::vector<std::pair<std::string, std::vector<int64_t>>> cell_attributes;
};

// INVALID_ARGUMENT unless rows, cols >= 0, every vector has its documented size, loads are
// non-negative and attribute names are non-empty [a-z0-9-].
absl::Status ValidateGrid(const HeatmapGrid& grid);

// The cumulative expert load of every layer in `stats` (rows = layers, cols = experts), each row
// noted with its balancedness.
HeatmapGrid GridFromLoadStats(const v1::LoadStats& stats);

// Share of cell (r, c) in its row's total load (0 for an idle row).
double CellShare(const HeatmapGrid& grid, int r, int c);
// Largest CellShare in the grid (0 when every row is idle).
double MaxShare(const HeatmapGrid& grid);

// Shade index in [0, levels): 0 for zero share, levels - 1 for the largest share, proportional in
// between (rounded up so any load is visible). REQUIRES: levels >= 2.
int ShadeLevel(double share, double max_share, int levels);

struct TerminalHeatmapOptions {
  // Folds adjacent experts into one character (summing their load) until a row fits this many
  // characters; 0 keeps one character per expert.
  int max_width = 0;
};

// One line per layer: "L<r> |<shades>| <note>", plus a header and a legend. Shades, lightest to
// darkest: '.' (idle) and the unicode blocks U+2591, U+2592, U+2593, U+2588.
std::string RenderTerminalHeatmap(const HeatmapGrid& grid, const TerminalHeatmapOptions& options);

struct SvgHeatmapOptions {
  int cell_width = 12;
  int cell_height = 14;
  std::string title;  // escaped; omitted when empty
};

// A standalone <svg> element: one <rect class="cell"> per (layer, expert) with data-layer,
// data-expert, data-load, data-share and the grid's extra attributes, a <title> tooltip each, row
// labels, row notes and a color legend. Fill runs from near-white (idle) to dark red (hottest).
std::string RenderSvgHeatmap(const HeatmapGrid& grid, const SvgHeatmapOptions& options);

// The fill color of shade `t` in [0, 1] as "#rrggbb".
std::string HeatColor(double t);

// `text` with & < > " ' replaced by entities (safe in XML text and attribute values).
std::string XmlEscape(const std::string& text);

}  // namespace moe

#endif  // MOE_CLIENT_MOECTL_HEATMAP_H_
