// Heatmap rendering: shade levels, the terminal rows (hottest cell darkest, idle cells lightest,
// folding), the SVG cells with their data attributes and colors, dimensions and escaping.
#include "client/moectl/heatmap.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr char kIdle[] = ".";
constexpr char kLight[] = "\u2591";
constexpr char kMedium[] = "\u2592";
constexpr char kDark[] = "\u2593";
constexpr char kFull[] = "\u2588";

// Row 0 shares: 0, 0.1, 0.3, 0.6 (the hottest cell of the grid); row 1: 0.25 each.
HeatmapGrid TwoLayers() {
  HeatmapGrid grid;
  grid.rows = 2;
  grid.cols = 4;
  grid.loads = {0, 10, 30, 60, 5, 5, 5, 5};
  return grid;
}

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

// The SVG element of the cell at (layer, expert), up to its closing tag.
std::string CellElement(const std::string& svg, int layer, int expert) {
  const std::string key = "data-layer=\"" + std::to_string(layer) + "\" data-expert=\"" +
                          std::to_string(expert) + "\" ";
  const size_t at = svg.find(key);
  if (at == std::string::npos) return "";
  const size_t start = svg.rfind("<rect", at);
  return svg.substr(start, svg.find("</rect>", at) + 7 - start);
}

TEST(HeatmapTest, ShadeLevels) {
  EXPECT_EQ(ShadeLevel(0, 0.6, 5), 0);
  EXPECT_EQ(ShadeLevel(0.6, 0.6, 5), 4);
  EXPECT_EQ(ShadeLevel(0.001, 0.6, 5), 1);  // any load is visible
  EXPECT_EQ(ShadeLevel(0.3, 0.6, 5), 2);
  EXPECT_EQ(ShadeLevel(0.25, 0.6, 5), 2);  // 1.67 rounds up
  EXPECT_EQ(ShadeLevel(0.5, 0, 5), 0);     // idle grid
}

TEST(HeatmapTest, TerminalRowsShadeByShareOfTheLayer) {
  HeatmapGrid grid = TwoLayers();
  grid.row_notes = {"bal 0.40", "bal 1.00"};
  const std::string text = RenderTerminalHeatmap(grid, {});
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << text;  // header, two layers, legend
  EXPECT_EQ(lines[0], "expert load: 2 layers x 4 experts");
  EXPECT_EQ(lines[1], std::string("L0 |") + kIdle + kLight + kMedium + kFull + "| bal 0.40");
  EXPECT_EQ(lines[2], std::string("L1 |") + kMedium + kMedium + kMedium + kMedium + "| bal 1.00");
  EXPECT_TRUE(absl::StrContains(lines[3], "60.0% of a layer's routes")) << lines[3];
  // The darkest shade appears exactly once in the rows: at the hottest cell.
  EXPECT_EQ(Count(lines[1] + lines[2], kFull), 1u);
}

TEST(HeatmapTest, TerminalFoldsWideRowsAndAlignsLabels) {
  HeatmapGrid grid = TwoLayers();
  const std::string folded = RenderTerminalHeatmap(grid, {.max_width = 2});
  std::vector<std::string> lines = absl::StrSplit(folded, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_TRUE(absl::StrContains(lines[0], "one character = 2 experts"));
  // Row 0 folds to loads {10, 90} (shares 0.1, 0.9), row 1 to {10, 10} (0.5 each).
  EXPECT_EQ(lines[1], std::string("L0 |") + kLight + kFull + "|");
  EXPECT_EQ(lines[2], std::string("L1 |") + kDark + kDark + "|");

  HeatmapGrid tall;
  tall.rows = 12;
  tall.cols = 1;
  tall.loads.assign(12, 1);
  std::vector<std::string> rows = absl::StrSplit(RenderTerminalHeatmap(tall, {}), '\n');
  EXPECT_EQ(rows[1], std::string("L0  |") + kFull + "|");
  EXPECT_EQ(rows[12], std::string("L11 |") + kFull + "|");
}

TEST(HeatmapTest, IdleGridIsAllLightest) {
  HeatmapGrid grid;
  grid.rows = 1;
  grid.cols = 3;
  grid.loads = {0, 0, 0};
  std::vector<std::string> lines = absl::StrSplit(RenderTerminalHeatmap(grid, {}), '\n');
  EXPECT_EQ(lines[1], "L0 |...|");
  const std::string svg = RenderSvgHeatmap(grid, {});
  EXPECT_EQ(Count(svg, "fill=\"#fff7ec\" data-layer"), 3u);
}

TEST(HeatmapTest, SvgCellsCarryLoadsSharesAndColors) {
  HeatmapGrid grid = TwoLayers();
  grid.cell_attributes = {{"window", {1, 2, 3, 4, 5, 6, 7, 8}}};
  const std::string svg = RenderSvgHeatmap(grid, {});
  EXPECT_TRUE(absl::StartsWith(svg, "<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_EQ(Count(svg, "<rect class=\"cell\""), 8u);
  EXPECT_EQ(Count(svg, "</rect>"), 8u);
  EXPECT_EQ(Count(svg, "<text"), Count(svg, "</text>"));

  const std::string hottest = CellElement(svg, 0, 3);
  EXPECT_TRUE(absl::StrContains(hottest, "fill=\"#7f0000\"")) << hottest;  // darkest
  EXPECT_TRUE(absl::StrContains(hottest, "data-load=\"60\" data-share=\"0.600000\""));
  EXPECT_TRUE(absl::StrContains(hottest, "data-window=\"4\"")) << hottest;
  EXPECT_TRUE(absl::StrContains(hottest, "<title>L0 E3: 60 routes, 60.00% of the layer</title>"));
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 0, 0), "fill=\"#fff7ec\""));  // idle
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 0, 2), "fill=\"#fc8d59\""));  // half the max
  // Share 0.25 of max 0.6: two thirds of the way from the 2nd ramp stop to the 3rd.
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 1, 0), "fill=\"#fca570\""));
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 1, 1), "data-window=\"6\""));
}

TEST(HeatmapTest, SvgDimensionsFollowTheGrid) {
  const std::string svg = RenderSvgHeatmap(TwoLayers(), {.cell_width = 12, .cell_height = 14});
  // Cells start after the margin (8) and the row-label column (7 px x "L" + 1 digit, + 8 px).
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 0, 0), "x=\"30\" y=\"22\" width=\"11\""));
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 0, 3), "x=\"66\" y=\"22\""));
  EXPECT_TRUE(absl::StrContains(CellElement(svg, 1, 3),
                                "x=\"66\" y=\"36\" width=\"11\" "
                                "height=\"13\""));
  EXPECT_TRUE(absl::StrContains(svg, "data-rows=\"2\" data-cols=\"4\""));

  HeatmapGrid wide;
  wide.rows = 1;
  wide.cols = 64;
  wide.loads.assign(64, 1);
  const std::string wide_svg = RenderSvgHeatmap(wide, {.cell_width = 10, .cell_height = 10});
  // 8 (margin) + 22 (label column) + 640 (cells) + 8 (margin).
  EXPECT_TRUE(absl::StrContains(wide_svg, "width=\"678\"")) << wide_svg.substr(0, 200);
}

TEST(HeatmapTest, SvgEscapesTextAndTheColorRampIsMonotone) {
  HeatmapGrid grid = TwoLayers();
  grid.row_notes = {"a<b & \"c\"", "'d'>"};
  const std::string svg = RenderSvgHeatmap(grid, {.title = "load <run & 'x'>"});
  EXPECT_TRUE(absl::StrContains(svg, ">load &lt;run &amp; &#39;x&#39;&gt;</text>"));
  EXPECT_TRUE(absl::StrContains(svg, ">a&lt;b &amp; &quot;c&quot;</text>"));
  EXPECT_TRUE(absl::StrContains(svg, ">&#39;d&#39;&gt;</text>"));
  EXPECT_FALSE(absl::StrContains(svg, "<run"));
  EXPECT_EQ(HeatColor(0), "#fff7ec");
  EXPECT_EQ(HeatColor(1), "#7f0000");
  EXPECT_EQ(HeatColor(2), "#7f0000");
  EXPECT_EQ(HeatColor(-1), "#fff7ec");
}

TEST(HeatmapTest, GridFromLoadStats) {
  v1::LoadStats stats;
  v1::LayerLoad* l0 = stats.add_layers();
  for (int64_t v : {3, 0, 1}) l0->add_expert_load(v);
  l0->set_balancedness(0.5);
  v1::LayerLoad* l1 = stats.add_layers();
  for (int64_t v : {0, 0, 7}) l1->add_expert_load(v);
  l1->set_balancedness(1);
  const HeatmapGrid grid = GridFromLoadStats(stats);
  ASSERT_TRUE(ValidateGrid(grid).ok());
  EXPECT_EQ(grid.rows, 2);
  EXPECT_EQ(grid.cols, 3);
  EXPECT_EQ(grid.loads, (std::vector<int64_t>{3, 0, 1, 0, 0, 7}));
  EXPECT_EQ(grid.row_notes, (std::vector<std::string>{"bal 0.500", "bal 1.000"}));
}

TEST(HeatmapTest, ValidateGridRejectsInconsistentShapes) {
  HeatmapGrid grid = TwoLayers();
  grid.loads.pop_back();
  EXPECT_FALSE(ValidateGrid(grid).ok());
  grid = TwoLayers();
  grid.loads[0] = -1;
  EXPECT_FALSE(ValidateGrid(grid).ok());
  grid = TwoLayers();
  grid.row_notes = {"only one"};
  EXPECT_FALSE(ValidateGrid(grid).ok());
  grid = TwoLayers();
  grid.cell_attributes = {{"Bad\"name", std::vector<int64_t>(8, 0)}};
  EXPECT_FALSE(ValidateGrid(grid).ok());
  grid.cell_attributes = {{"window", std::vector<int64_t>(7, 0)}};
  EXPECT_FALSE(ValidateGrid(grid).ok());
}

}  // namespace
}  // namespace moe
