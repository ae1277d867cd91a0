#include "client/moectl/heatmap.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace {

// Terminal shades, lightest to darkest: idle, then four unicode blocks.
constexpr std::array<const char*, 5> kShades = {".", "\u2591", "\u2592", "\u2593", "\u2588"};

// Color stops of the fill ramp (a yellow-orange-red sequential scale), evenly spaced in [0, 1].
constexpr std::array<std::array<int, 3>, 5> kRamp = {{
    {255, 247, 236},
    {253, 212, 158},
    {252, 141, 89},
    {215, 48, 31},
    {127, 0, 0},
}};

int64_t RowTotal(const HeatmapGrid& grid, int r) {
  int64_t total = 0;
  for (int c = 0; c < grid.cols; ++c) total += grid.loads[static_cast<size_t>(r) * grid.cols + c];
  return total;
}

// Sums groups of `group` adjacent columns (the last group may be narrower).
HeatmapGrid FoldColumns(const HeatmapGrid& grid, int group) {
  HeatmapGrid folded;
  folded.rows = grid.rows;
  folded.cols = (grid.cols + group - 1) / group;
  folded.row_notes = grid.row_notes;
  folded.loads.assign(static_cast<size_t>(folded.rows) * folded.cols, 0);
  for (int r = 0; r < grid.rows; ++r) {
    for (int c = 0; c < grid.cols; ++c) {
      folded.loads[static_cast<size_t>(r) * folded.cols + c / group] +=
          grid.loads[static_cast<size_t>(r) * grid.cols + c];
    }
  }
  return folded;
}

int Digits(int n) { return static_cast<int>(absl::StrCat(std::max(n, 0)).size()); }

std::string RowLabel(int r, int width) { return absl::StrFormat("L%-*d", width, r); }

// Expert-axis label spacing: a power of two wide enough that labels do not overlap.
int AxisStep(int cell_width, int cols) {
  const int min_px = 7 * Digits(cols) + 6;
  int step = 1;
  while (step * cell_width < min_px) step *= 2;
  return step;
}

double Share(int64_t load, int64_t row_total) {
  return row_total > 0 ? static_cast<double>(load) / row_total : 0;
}

std::string SvgCell(const HeatmapGrid& grid, int r, int c, int64_t row_total, double max_share,
                    int x, int y, const SvgHeatmapOptions& o) {
  const size_t i = static_cast<size_t>(r) * grid.cols + c;
  const double share = Share(grid.loads[i], row_total);
  const double t = max_share > 0 ? share / max_share : 0;
  std::string cell = absl::StrFormat(
      "<rect class=\"cell\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" "
      "data-layer=\"%d\" data-expert=\"%d\" data-load=\"%d\" data-share=\"%.6f\"",
      x, y, o.cell_width - 1, o.cell_height - 1, HeatColor(t), r, c, grid.loads[i], share);
  for (const auto& [name, values] : grid.cell_attributes) {
    absl::StrAppend(&cell, " data-", name, "=\"", values[i], "\"");
  }
  absl::StrAppendFormat(&cell, "><title>L%d E%d: %d routes, %.2f%% of the layer</title>", r, c,
                        grid.loads[i], 100 * share);
  absl::StrAppend(&cell, "</rect>\n");
  return cell;
}

}  // namespace

absl::Status ValidateGrid(const HeatmapGrid& grid) {
  if (grid.rows < 0 || grid.cols < 0) return absl::InvalidArgumentError("negative grid size");
  const size_t cells = static_cast<size_t>(grid.rows) * grid.cols;
  if (grid.loads.size() != cells) {
    return absl::InvalidArgumentError(
        absl::StrCat("grid has ", grid.loads.size(), " loads for ", cells, " cells"));
  }
  if (!grid.row_notes.empty() && grid.row_notes.size() != static_cast<size_t>(grid.rows)) {
    return absl::InvalidArgumentError("row_notes must be empty or one per row");
  }
  for (int64_t v : grid.loads) {
    if (v < 0) return absl::InvalidArgumentError("negative load");
  }
  for (const auto& [name, values] : grid.cell_attributes) {
    const bool good_name = !name.empty() && std::all_of(name.begin(), name.end(), [](char ch) {
      return absl::ascii_islower(ch) || absl::ascii_isdigit(ch) || ch == '-';
    });
    if (!good_name || values.size() != cells) {
      return absl::InvalidArgumentError(absl::StrCat("bad cell attribute '", name, "'"));
    }
  }
  return absl::OkStatus();
}

HeatmapGrid GridFromLoadStats(const v1::LoadStats& stats) {
  HeatmapGrid grid;
  grid.rows = stats.layers_size();
  for (const v1::LayerLoad& layer : stats.layers()) {
    grid.cols = std::max(grid.cols, layer.expert_load_size());
  }
  grid.loads.assign(static_cast<size_t>(grid.rows) * grid.cols, 0);
  for (int r = 0; r < grid.rows; ++r) {
    const v1::LayerLoad& layer = stats.layers(r);
    for (int c = 0; c < layer.expert_load_size(); ++c) {
      // Counts from the coordinator are non-negative; clamp so a bad answer cannot break drawing.
      grid.loads[static_cast<size_t>(r) * grid.cols + c] =
          std::max<int64_t>(0, layer.expert_load(c));
    }
    grid.row_notes.push_back(absl::StrFormat("bal %.3f", layer.balancedness()));
  }
  return grid;
}

double CellShare(const HeatmapGrid& grid, int r, int c) {
  return Share(grid.loads[static_cast<size_t>(r) * grid.cols + c], RowTotal(grid, r));
}

double MaxShare(const HeatmapGrid& grid) {
  double max_share = 0;
  for (int r = 0; r < grid.rows; ++r) {
    const int64_t total = RowTotal(grid, r);
    if (total <= 0) continue;
    for (int c = 0; c < grid.cols; ++c) {
      max_share =
          std::max(max_share,
                   static_cast<double>(grid.loads[static_cast<size_t>(r) * grid.cols + c]) / total);
    }
  }
  return max_share;
}

int ShadeLevel(double share, double max_share, int levels) {
  if (share <= 0 || max_share <= 0) return 0;
  const int level = static_cast<int>(std::ceil(share / max_share * (levels - 1) - 1e-9));
  return std::clamp(level, 1, levels - 1);
}

std::string RenderTerminalHeatmap(const HeatmapGrid& input, const TerminalHeatmapOptions& options) {
  int group = 1;
  if (options.max_width > 0 && input.cols > options.max_width) {
    group = (input.cols + options.max_width - 1) / options.max_width;
  }
  const HeatmapGrid grid = group > 1 ? FoldColumns(input, group) : input;
  const int label_width = Digits(grid.rows - 1);
  const double max_share = MaxShare(grid);
  std::string out = absl::StrCat("expert load: ", input.rows, " layers x ", input.cols, " experts");
  if (group > 1) absl::StrAppend(&out, " (one character = ", group, " experts)");
  absl::StrAppend(&out, "\n");
  for (int r = 0; r < grid.rows; ++r) {
    absl::StrAppend(&out, RowLabel(r, label_width), " |");
    const int64_t row_total = RowTotal(grid, r);
    for (int c = 0; c < grid.cols; ++c) {
      const double share = Share(grid.loads[static_cast<size_t>(r) * grid.cols + c], row_total);
      absl::StrAppend(&out, kShades[ShadeLevel(share, max_share, kShades.size())]);
    }
    absl::StrAppend(&out, "|");
    if (!grid.row_notes.empty()) absl::StrAppend(&out, " ", grid.row_notes[r]);
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppendFormat(&out,
                        "shades: %s idle  %s %s %s %s  (%s = the largest share, %.1f%% of a "
                        "layer's routes)\n",
                        kShades[0], kShades[1], kShades[2], kShades[3], kShades[4], kShades[4],
                        100 * max_share);
  return out;
}

std::string HeatColor(double t) {
  t = std::clamp(std::isnan(t) ? 0.0 : t, 0.0, 1.0);
  const double pos = t * (kRamp.size() - 1);
  const size_t lo = std::min(static_cast<size_t>(pos), kRamp.size() - 2);
  const double f = pos - lo;
  std::array<int, 3> rgb;
  for (int k = 0; k < 3; ++k) {
    rgb[k] = static_cast<int>(std::lround(kRamp[lo][k] + f * (kRamp[lo + 1][k] - kRamp[lo][k])));
  }
  return absl::StrFormat("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

std::string XmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(ch);
    }
  }
  return out;
}

std::string RenderSvgHeatmap(const HeatmapGrid& grid, const SvgHeatmapOptions& o) {
  constexpr int kMargin = 8, kCharPx = 7, kAxisHeight = 14, kLegendHeight = 34;
  const int title_height = o.title.empty() ? 0 : 20;
  const int label_width = kCharPx * (1 + Digits(grid.rows - 1)) + 8;
  size_t note_chars = 0;
  for (const std::string& note : grid.row_notes) note_chars = std::max(note_chars, note.size());
  const int note_width = note_chars == 0 ? 0 : static_cast<int>(kCharPx * note_chars) + 12;
  const int x0 = kMargin + label_width, y0 = kMargin + title_height + kAxisHeight;
  const int grid_width = std::max(grid.cols * o.cell_width, 160);
  // Wide enough for the title (13 px monospace: about 8 px a character) and the legend's text.
  const int width = std::max({x0 + grid_width + note_width + kMargin, x0 + 40 * kCharPx,
                              2 * kMargin + 8 * static_cast<int>(o.title.size())});
  const int height = y0 + grid.rows * o.cell_height + 8 + kLegendHeight + kMargin;
  const double max_share = MaxShare(grid);

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"heatmap\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" data-rows=\"%d\" data-cols=\"%d\" font-family=\"monospace\" "
      "font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n",
      width, height, width, height, grid.rows, grid.cols);
  if (!o.title.empty()) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\" font-size=\"13\">%s</text>\n", kMargin,
                          kMargin + 13, XmlEscape(o.title));
  }
  const int step = AxisStep(o.cell_width, grid.cols);
  for (int c = 0; c < grid.cols; c += step) {
    absl::StrAppendFormat(&svg, "<text class=\"axis\" x=\"%d\" y=\"%d\">%d</text>\n",
                          x0 + c * o.cell_width, y0 - 3, c);
  }
  for (int r = 0; r < grid.rows; ++r) {
    const int y = y0 + r * o.cell_height;
    const int64_t row_total = RowTotal(grid, r);
    absl::StrAppendFormat(&svg, "<text class=\"row-label\" x=\"%d\" y=\"%d\">L%d</text>\n", kMargin,
                          y + o.cell_height - 3, r);
    for (int c = 0; c < grid.cols; ++c) {
      absl::StrAppend(&svg, SvgCell(grid, r, c, row_total, max_share, x0 + c * o.cell_width, y, o));
    }
    if (!grid.row_notes.empty()) {
      absl::StrAppendFormat(&svg, "<text class=\"row-note\" x=\"%d\" y=\"%d\">%s</text>\n",
                            x0 + grid.cols * o.cell_width + 8, y + o.cell_height - 3,
                            XmlEscape(grid.row_notes[r]));
    }
  }
  // Legend: the ramp in ten steps, idle on the left, the largest share on the right.
  const int ly = y0 + grid.rows * o.cell_height + 8;
  for (int k = 0; k < 10; ++k) {
    absl::StrAppendFormat(&svg,
                          "<rect class=\"legend\" x=\"%d\" y=\"%d\" width=\"16\" height=\"10\" "
                          "fill=\"%s\"/>\n",
                          x0 + 16 * k, ly, HeatColor(k / 9.0));
  }
  absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\">idle .. %.1f%% of a layer's routes</text>\n",
                        x0, ly + 24, 100 * max_share);
  absl::StrAppend(&svg, "</svg>\n");
  return svg;
}

}  // namespace moe
