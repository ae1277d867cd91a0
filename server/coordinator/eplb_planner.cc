#include "server/coordinator/eplb_planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace moe {
namespace {

// Gains below this are rounding noise, never worth a copy.
constexpr double kMinUsefulGain = 1e-9;

// The GPUs of the new placement, derived from slot_to_gpu.
struct Layout {
  std::vector<std::vector<int32_t>> gpu_slots;  // ascending slots of each GPU
  std::vector<int32_t> capacity;                // slots per GPU
  int live_slots = 0;
  bool equal_capacity = true;
};

// The experts each GPU (in the policy's numbering) receives, as a multiset.
using Packs = std::vector<std::vector<int32_t>>;

absl::Status CheckGpuIds(absl::Span<const int32_t> slot_to_gpu, int num_gpus, const char* name) {
  for (size_t p = 0; p < slot_to_gpu.size(); ++p) {
    if (slot_to_gpu[p] < -1 || slot_to_gpu[p] >= num_gpus) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", p, "] = ", slot_to_gpu[p], " outside [-1, ", num_gpus, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateProblem(const EplbProblem& p) {
  if (p.num_layers < 1 || p.num_logical < 1 || p.num_gpus < 1 || p.num_nodes < 1 ||
      p.num_groups < 1) {
    return absl::InvalidArgumentError("layers, experts, GPUs, nodes and groups must be >= 1");
  }
  const size_t num_physical = p.slot_to_gpu.size();
  if (p.load.size() != static_cast<size_t>(p.num_layers) * p.num_logical) {
    return absl::InvalidArgumentError(absl::StrCat(
        "load has ", p.load.size(), " entries, expected ", p.num_layers, " x ", p.num_logical));
  }
  for (size_t i = 0; i < p.load.size(); ++i) {
    if (!std::isfinite(p.load[i]) || p.load[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("load[", i, "] = ", p.load[i]));
    }
  }
  if (absl::Status s = CheckGpuIds(p.slot_to_gpu, p.num_gpus, "slot_to_gpu"); !s.ok()) return s;
  if (!p.current_slot_to_gpu.empty()) {
    if (p.current_slot_to_gpu.size() != num_physical) {
      return absl::InvalidArgumentError("current_slot_to_gpu and slot_to_gpu differ in size");
    }
    if (absl::Status s = CheckGpuIds(p.current_slot_to_gpu, p.num_gpus, "current_slot_to_gpu");
        !s.ok()) {
      return s;
    }
  }
  if (!p.current.empty()) {
    if (p.current.size() != static_cast<size_t>(p.num_layers) * num_physical) {
      return absl::InvalidArgumentError(absl::StrCat("current has ", p.current.size(),
                                                     " entries, expected ", p.num_layers, " x ",
                                                     num_physical));
    }
    for (size_t i = 0; i < p.current.size(); ++i) {
      if (p.current[i] < -1 || p.current[i] >= p.num_logical) {
        return absl::InvalidArgumentError(absl::StrCat("current[", i, "] = ", p.current[i]));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Layout> MakeLayout(const EplbProblem& p) {
  Layout layout;
  layout.gpu_slots.resize(p.num_gpus);
  for (size_t s = 0; s < p.slot_to_gpu.size(); ++s) {
    if (p.slot_to_gpu[s] >= 0) layout.gpu_slots[p.slot_to_gpu[s]].push_back(static_cast<int>(s));
  }
  for (int g = 0; g < p.num_gpus; ++g) {
    const int n = static_cast<int>(layout.gpu_slots[g].size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat("GPU ", g, " has no slot"));
    layout.capacity.push_back(n);
    layout.live_slots += n;
    layout.equal_capacity = layout.equal_capacity && n == layout.capacity[0];
  }
  if (layout.live_slots < p.num_logical) {
    return absl::InvalidArgumentError(
        absl::StrCat(layout.live_slots, " live slots for ", p.num_logical, " experts"));
  }
  return layout;
}

bool UseHierarchical(const EplbProblem& p, const Layout& layout) {
  return p.num_nodes > 1 && layout.equal_capacity && p.num_gpus % p.num_nodes == 0 &&
         p.num_groups % p.num_nodes == 0 && p.num_logical % p.num_groups == 0;
}

// Replicas of `experts` (ids into `w`) over `num_slots`, packed onto `num_packs` packs of
// `capacity`; appends each pack's experts to packs[first_pack + i].
void ReplicateAndPack(absl::Span<const double> w, const std::vector<int32_t>& experts,
                      int num_slots, const std::vector<int32_t>& capacity, int first_pack,
                      Packs& packs) {
  std::vector<double> local_w(experts.size());
  for (size_t i = 0; i < experts.size(); ++i) local_w[i] = w[experts[i]];
  const Replication rep = ReplicateExperts(local_w, num_slots);
  std::vector<double> replica_w(rep.replica_to_logical.size());
  for (size_t r = 0; r < replica_w.size(); ++r) {
    const int32_t e = rep.replica_to_logical[r];
    replica_w[r] = local_w[e] / rep.count[e];
  }
  const std::vector<int32_t> pack = BalancedPacking(replica_w, capacity);
  for (size_t r = 0; r < pack.size(); ++r) {
    packs[first_pack + pack[r]].push_back(experts[rep.replica_to_logical[r]]);
  }
}

Packs GlobalPolicy(absl::Span<const double> w, const Layout& layout) {
  std::vector<int32_t> all(w.size());
  std::iota(all.begin(), all.end(), 0);
  Packs packs(layout.capacity.size());
  ReplicateAndPack(w, all, layout.live_slots, layout.capacity, 0, packs);
  return packs;
}

Packs HierarchicalPolicy(absl::Span<const double> w, const EplbProblem& p, const Layout& layout) {
  const int group_size = p.num_logical / p.num_groups;
  const int gpus_per_node = p.num_gpus / p.num_nodes;
  std::vector<double> group_w(p.num_groups, 0.0);
  for (int e = 0; e < p.num_logical; ++e) group_w[e / group_size] += w[e];
  const std::vector<int32_t> node_of_group =
      BalancedPacking(group_w, std::vector<int32_t>(p.num_nodes, p.num_groups / p.num_nodes));
  Packs packs(p.num_gpus);
  const std::vector<int32_t> gpu_capacity(gpus_per_node, layout.capacity[0]);
  for (int node = 0; node < p.num_nodes; ++node) {
    std::vector<int32_t> experts;
    for (int g = 0; g < p.num_groups; ++g) {
      if (node_of_group[g] != node) continue;
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) experts.push_back(e);
    }
    ReplicateAndPack(w, experts, gpus_per_node * layout.capacity[0], gpu_capacity,
                     node * gpus_per_node, packs);
  }
  return packs;
}

// Experts (with multiplicity) each GPU hosts under the current placement of one layer: [G][E].
std::vector<std::vector<int32_t>> HostedCounts(absl::Span<const int32_t> current,
                                               absl::Span<const int32_t> current_gpu, int num_gpus,
                                               int num_logical) {
  std::vector<std::vector<int32_t>> hosted(num_gpus, std::vector<int32_t>(num_logical, 0));
  for (size_t s = 0; s < current.size(); ++s) {
    if (current[s] >= 0 && current_gpu[s] >= 0) ++hosted[current_gpu[s]][current[s]];
  }
  return hosted;
}

// Experts of `pack` that `hosted` (one GPU's counts) already holds, with multiplicity.
int Overlap(const std::vector<int32_t>& pack, const std::vector<int32_t>& hosted) {
  std::vector<int32_t> sorted = pack;
  std::sort(sorted.begin(), sorted.end());
  int overlap = 0;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    overlap += std::min<int>(static_cast<int>(j - i), hosted[sorted[i]]);
    i = j;
  }
  return overlap;
}

// Assigns policy pack i to a real GPU with the same key (capacity and node), greedily by the
// number of experts the GPU already holds. Returns the GPU of each pack.
std::vector<int32_t> MatchPacksToGpus(const Packs& packs, const std::vector<int64_t>& key,
                                      const std::vector<std::vector<int32_t>>& hosted) {
  const int n = static_cast<int>(packs.size());
  std::vector<std::tuple<int, int, int>> candidates;  // (-overlap, pack, gpu)
  for (int i = 0; i < n; ++i) {
    for (int g = 0; g < n; ++g) {
      if (key[i] != key[g]) continue;
      const int overlap = Overlap(packs[i], hosted[g]);
      if (overlap > 0) candidates.emplace_back(-overlap, i, g);
    }
  }
  std::sort(candidates.begin(), candidates.end());
  std::vector<int32_t> gpu_of_pack(n, -1);
  std::vector<bool> gpu_taken(n, false);
  for (const auto& [neg_overlap, i, g] : candidates) {
    if (gpu_of_pack[i] >= 0 || gpu_taken[g]) continue;
    gpu_of_pack[i] = g;
    gpu_taken[g] = true;
  }
  for (int i = 0; i < n; ++i) {
    if (gpu_of_pack[i] >= 0) continue;
    for (int g = 0; g < n; ++g) {
      if (gpu_taken[g] || key[i] != key[g]) continue;
      gpu_of_pack[i] = g;
      gpu_taken[g] = true;
      break;
    }
    CHECK_GE(gpu_of_pack[i], 0) << "pack " << i << " found no GPU of its key";
  }
  return gpu_of_pack;
}

// Writes one GPU's experts into its slots: a slot whose current expert is still wanted on this
// GPU keeps it; the rest fill the remaining slots in pack order. Returns how many distinct
// experts are new on the GPU.
int FillGpuSlots(const std::vector<int32_t>& pack, const std::vector<int32_t>& slots, int gpu,
                 absl::Span<const int32_t> current, absl::Span<const int32_t> current_gpu,
                 const std::vector<int32_t>& hosted, absl::Span<int32_t> out) {
  std::vector<int32_t> need(hosted.size(), 0);
  for (int32_t e : pack) ++need[e];
  std::vector<bool> filled(slots.size(), false);
  if (!current.empty()) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t s = slots[i];
      const int32_t e = current[s];
      if (current_gpu[s] != gpu || e < 0 || need[e] == 0) continue;
      out[s] = e;
      --need[e];
      filled[i] = true;
    }
  }
  size_t next = 0;
  for (int32_t e : pack) {
    if (need[e] == 0) continue;
    --need[e];
    while (filled[next]) ++next;
    out[slots[next]] = e;
    filled[next] = true;
  }
  std::vector<int32_t> sorted = pack;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  int added = 0;
  for (int32_t e : sorted) added += hosted[e] == 0 ? 1 : 0;
  return added;
}

// Replicas per expert in a set of packs, and the heaviest pack when each replica of e carries
// w[e] / count[e].
std::vector<int32_t> ReplicaCounts(const Packs& packs, int num_logical) {
  std::vector<int32_t> count(num_logical, 0);
  for (const auto& pack : packs) {
    for (int32_t e : pack) ++count[e];
  }
  return count;
}

double MaxPackLoad(const Packs& packs, absl::Span<const double> w,
                   const std::vector<int32_t>& count) {
  double max_load = 0;
  for (const auto& pack : packs) {
    double load = 0;
    for (int32_t e : pack) load += w[e] / count[e];
    max_load = std::max(max_load, load);
  }
  return max_load;
}

// Swaps replicas between GPUs to keep more experts where they are, never letting a GPU exceed
// `max_load` (so balance never gets worse): a replica of e that is new on GPU g trades places with
// a replica f on a GPU h that already holds e, when that lowers the number of new
// (GPU, expert) pairs. A few passes over the GPU-indexed packs; each swap strictly improves.
void SwapTowardCurrent(absl::Span<const double> w, const std::vector<int32_t>& count,
                       const std::vector<std::vector<int32_t>>& hosted, double max_load,
                       Packs& packs) {
  const int num_gpus = static_cast<int>(packs.size());
  std::vector<double> load(num_gpus, 0.0);
  std::vector<std::vector<int32_t>> in_pack(num_gpus, std::vector<int32_t>(w.size(), 0));
  for (int g = 0; g < num_gpus; ++g) {
    for (int32_t e : packs[g]) {
      load[g] += w[e] / count[e];
      ++in_pack[g][e];
    }
  }
  // Change in new pairs when one e leaves g / arrives on g.
  auto leave = [&](int g, int32_t e) { return in_pack[g][e] == 1 && hosted[g][e] == 0 ? -1 : 0; };
  auto arrive = [&](int g, int32_t e) { return in_pack[g][e] == 0 && hosted[g][e] == 0 ? 1 : 0; };
  constexpr int kPasses = 4;
  for (int pass = 0; pass < kPasses; ++pass) {
    bool improved = false;
    for (int g = 0; g < num_gpus; ++g) {
      for (size_t i = 0; i < packs[g].size(); ++i) {
        const int32_t e = packs[g][i];
        if (hosted[g][e] > 0) continue;
        const double we = w[e] / count[e];
        bool swapped = false;
        for (int h = 0; h < num_gpus && !swapped; ++h) {
          if (h == g || hosted[h][e] == 0) continue;
          for (size_t j = 0; j < packs[h].size(); ++j) {
            const int32_t f = packs[h][j];
            const double wf = w[f] / count[f];
            if (f == e || load[g] - we + wf > max_load || load[h] - wf + we > max_load) continue;
            const int delta = leave(g, e) + arrive(h, e) + leave(h, f);
            --in_pack[g][e];
            --in_pack[h][f];
            const int gain = delta + arrive(g, f);
            ++in_pack[g][e];
            ++in_pack[h][f];
            if (gain >= 0) continue;
            --in_pack[g][e];
            ++in_pack[h][e];
            --in_pack[h][f];
            ++in_pack[g][f];
            load[g] += wf - we;
            load[h] += we - wf;
            std::swap(packs[g][i], packs[h][j]);
            swapped = improved = true;
            break;
          }
        }
      }
    }
    if (!improved) break;
  }
}

}  // namespace

std::vector<int32_t> BalancedPacking(absl::Span<const double> weights,
                                     absl::Span<const int32_t> capacity) {
  std::vector<int32_t> order(weights.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return weights[a] > weights[b]; });
  std::vector<double> pack_weight(capacity.size(), 0.0);
  std::vector<int32_t> pack_items(capacity.size(), 0);
  std::vector<int32_t> pack_of(weights.size(), -1);
  for (int32_t item : order) {
    int best = -1;
    for (size_t k = 0; k < capacity.size(); ++k) {
      if (pack_items[k] >= capacity[k]) continue;
      if (best < 0 || pack_weight[k] < pack_weight[best]) best = static_cast<int>(k);
    }
    CHECK_GE(best, 0) << "BalancedPacking: capacities hold fewer than " << weights.size()
                      << " items";
    pack_of[item] = best;
    pack_weight[best] += weights[item];
    ++pack_items[best];
  }
  return pack_of;
}

Replication ReplicateExperts(absl::Span<const double> weights, int num_replicas) {
  const int num_logical = static_cast<int>(weights.size());
  CHECK_GE(num_logical, 1);
  CHECK_GE(num_replicas, num_logical);
  Replication rep;
  rep.replica_to_logical.resize(num_logical);
  std::iota(rep.replica_to_logical.begin(), rep.replica_to_logical.end(), 0);
  rep.count.assign(num_logical, 1);
  for (int r = num_logical; r < num_replicas; ++r) {
    int best = 0;
    for (int e = 1; e < num_logical; ++e) {
      if (weights[e] / rep.count[e] > weights[best] / rep.count[best]) best = e;
    }
    rep.replica_to_logical.push_back(best);
    ++rep.count[best];
  }
  return rep;
}

double PredictedBalancedness(absl::Span<const double> load,
                             absl::Span<const int32_t> physical_to_logical,
                             absl::Span<const int32_t> slot_to_gpu, int num_gpus) {
  CHECK_EQ(physical_to_logical.size(), slot_to_gpu.size());
  std::vector<int32_t> count(load.size(), 0);
  for (size_t s = 0; s < physical_to_logical.size(); ++s) {
    if (physical_to_logical[s] >= 0 && slot_to_gpu[s] >= 0) ++count[physical_to_logical[s]];
  }
  for (size_t e = 0; e < load.size(); ++e) {
    if (load[e] > 0 && count[e] == 0) return 0.0;
  }
  std::vector<double> gpu_load(num_gpus, 0.0);
  for (size_t s = 0; s < physical_to_logical.size(); ++s) {
    const int32_t e = physical_to_logical[s];
    if (e >= 0 && slot_to_gpu[s] >= 0) gpu_load[slot_to_gpu[s]] += load[e] / count[e];
  }
  const double max_load = *std::max_element(gpu_load.begin(), gpu_load.end());
  if (max_load <= 0) return 1.0;
  const double sum = std::accumulate(gpu_load.begin(), gpu_load.end(), 0.0);
  return sum / num_gpus / max_load;
}

namespace {

// What PlanEplb shares between layers.
struct PlanContext {
  const EplbProblem& problem;
  const Layout& layout;
  absl::Span<const int32_t> current_gpu;  // GPU of each slot in the current placement
  bool layout_changed = false;
  bool hierarchical = false;
  std::vector<int64_t> key;  // GPUs with the same key are interchangeable
};

// The experts each real GPU receives in layer `w`'s new placement: the policy's packs, matched to
// the GPUs that hold most of them, or the sticky variant when it moves less at no loss of balance.
Packs PlanGpuPacks(const PlanContext& c, absl::Span<const double> w, absl::Span<const int32_t> cur,
                   const std::vector<std::vector<int32_t>>& hosted) {
  const EplbProblem& p = c.problem;
  const Packs policy =
      c.hierarchical ? HierarchicalPolicy(w, p, c.layout) : GlobalPolicy(w, c.layout);
  if (cur.empty()) return policy;
  const std::vector<int32_t> gpu_of_pack = MatchPacksToGpus(policy, c.key, hosted);
  Packs gpu_packs(p.num_gpus);
  for (int i = 0; i < p.num_gpus; ++i) gpu_packs[gpu_of_pack[i]] = policy[i];
  const std::vector<int32_t> count = ReplicaCounts(policy, p.num_logical);
  // A swap could carry an expert to another node and break the hierarchical policy's grouping;
  // that plan keeps its matched packs as they are.
  if (c.hierarchical) return gpu_packs;
  SwapTowardCurrent(w, count, hosted, MaxPackLoad(policy, w, count), gpu_packs);
  return gpu_packs;
}

void PlanLayer(const PlanContext& c, int l, EplbPlan& plan) {
  const EplbProblem& p = c.problem;
  const size_t num_physical = p.slot_to_gpu.size();
  const absl::Span<const double> w =
      p.load.subspan(static_cast<size_t>(l) * p.num_logical, p.num_logical);
  const absl::Span<const int32_t> cur =
      p.current.empty() ? absl::Span<const int32_t>()
                        : p.current.subspan(static_cast<size_t>(l) * num_physical, num_physical);
  const absl::Span<int32_t> out = absl::MakeSpan(plan.physical_to_logical)
                                      .subspan(static_cast<size_t>(l) * num_physical, num_physical);
  const std::vector<std::vector<int32_t>> hosted =
      cur.empty()
          ? std::vector<std::vector<int32_t>>(p.num_gpus, std::vector<int32_t>(p.num_logical, 0))
          : HostedCounts(cur, c.current_gpu, p.num_gpus, p.num_logical);
  const Packs gpu_packs = PlanGpuPacks(c, w, cur, hosted);
  EplbLayerPlan& lp = plan.layers[l];
  int moved = 0;
  for (int g = 0; g < p.num_gpus; ++g) {
    moved +=
        FillGpuSlots(gpu_packs[g], c.layout.gpu_slots[g], g, cur, c.current_gpu, hosted[g], out);
  }
  lp.balancedness_after = PredictedBalancedness(w, out, p.slot_to_gpu, p.num_gpus);
  if (cur.empty()) {
    lp.changed = true;
    return;
  }
  lp.balancedness_before = PredictedBalancedness(w, cur, c.current_gpu, p.num_gpus);
  const double gain = lp.balancedness_after - lp.balancedness_before;
  const bool same = std::equal(cur.begin(), cur.end(), out.begin());
  // A changed layout moves slots between GPUs, so every layer takes its new placement.
  if (!c.layout_changed && (same || gain < p.min_gain || gain <= kMinUsefulGain)) {
    std::copy(cur.begin(), cur.end(), out.begin());
    lp.balancedness_after = lp.balancedness_before;
    return;
  }
  lp.changed = true;
  lp.moved_experts = moved;
  plan.moved_experts += moved;
}

}  // namespace

absl::StatusOr<EplbPlan> PlanEplb(const EplbProblem& p) {
  if (absl::Status s = ValidateProblem(p); !s.ok()) return s;
  absl::StatusOr<Layout> layout = MakeLayout(p);
  if (!layout.ok()) return layout.status();
  PlanContext c{p, *layout};
  c.current_gpu = p.current_slot_to_gpu.empty() ? p.slot_to_gpu : p.current_slot_to_gpu;
  c.layout_changed = !std::equal(c.current_gpu.begin(), c.current_gpu.end(), p.slot_to_gpu.begin(),
                                 p.slot_to_gpu.end());
  c.hierarchical = UseHierarchical(p, *layout);
  const int gpus_per_node = c.hierarchical ? p.num_gpus / p.num_nodes : p.num_gpus;
  for (int g = 0; g < p.num_gpus; ++g) {
    c.key.push_back(int64_t{layout->capacity[g]} * p.num_gpus + g / gpus_per_node);
  }
  EplbPlan plan;
  plan.hierarchical = c.hierarchical;
  plan.physical_to_logical.assign(static_cast<size_t>(p.num_layers) * p.slot_to_gpu.size(), -1);
  plan.layers.resize(p.num_layers);
  for (int l = 0; l < p.num_layers; ++l) PlanLayer(c, l, plan);
  plan.bytes_to_move = plan.moved_experts * p.expert_bytes;
  return plan;
}

}  // namespace moe
