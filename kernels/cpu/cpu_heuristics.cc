// Cost model of PlanGemm: one unit of an expert costs its weight traffic (a constant: every unit
// of one matrix has the same bytes) plus a share per route. On the 2-core development machine a
// 16-row MXFP4 group of H = 2880 streams 23 KB (about 0.7 us at 33 GB/s) and costs about
// 0.15 us of int16 multiply per route, hence the ratio below.
#include "kernels/cpu/cpu_heuristics.h"

#include <algorithm>

namespace moe::cpu {
namespace {

constexpr double kUnitCost = 1.0;
constexpr double kRouteCost = 0.2;
constexpr int64_t kPanelBytes = 16 * 1024;

}  // namespace

Range EvenSplit(int64_t n, int index, int count) {
  return Range{n * index / count, n * (index + 1) / count};
}

int64_t PanelCols(int64_t cols, int block) {
  const int64_t want = kPanelBytes / (16 * static_cast<int64_t>(sizeof(int16_t)));
  const int64_t blocks = std::max<int64_t>(1, want / block);
  return std::min(cols, blocks * block);
}

void PlanGemm(absl::Span<const int64_t> route_begin, int64_t units, int pieces, GemmPlan* plan) {
  plan->items.clear();
  plan->next = 0;
  const int64_t experts = static_cast<int64_t>(route_begin.size()) - 1;
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t routes = route_begin[e + 1] - route_begin[e];
    if (routes > 0) total += units * (kUnitCost + kRouteCost * routes);
  }
  // Unit u belongs to the piece of [0, total) that holds the unit's cost midpoint.
  double position = 0;
  int current = -1;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t routes = route_begin[e + 1] - route_begin[e];
    if (routes == 0) continue;
    const double cost = kUnitCost + kRouteCost * routes;
    for (int64_t u = 0; u < units; ++u, position += cost) {
      const int piece =
          std::min<int>(pieces - 1, static_cast<int>((position + cost / 2) * pieces / total));
      if (!plan->items.empty() && plan->items.back().expert == e && piece == current) {
        ++plan->items.back().end;
        continue;
      }
      current = piece;
      plan->items.push_back(
          GemmWorkItem{static_cast<int32_t>(e), routes > kStreamMaxRoutes, u, u + 1});
    }
  }
}

}  // namespace moe::cpu
