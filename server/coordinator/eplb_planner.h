// The EPLB planner: DeepSeek's expert-parallel load balancer (numerics.md section 5) with the two
// additions the coordinator needs: slot preservation (an expert that stays on a shard keeps its
// slot, so only experts that really move are copied) and a minimum-gain threshold (a layer whose
// predicted balancedness improves by less keeps its placement).
//
// The algorithm, per layer, from the per-expert load w [E] over a window:
//   replicate_experts(w, P): one replica each, then repeatedly one more for argmax w[e] / count[e];
//   balanced_packing(items, packs): items by descending weight, each into the lightest pack that
//     still has room;
//   global policy: replicate over all slots, then pack the replicas (weight w / count) onto GPUs;
//   hierarchical policy (expert groups divide evenly over nodes, GPUs all equal): pack groups onto
//     nodes, replicate inside each node, pack the node's replicas onto its GPUs.
// The planner then matches the resulting packs to the real GPUs (packs are interchangeable among
// GPUs of the same capacity and node, so this never changes balance) to keep as many experts
// where they already are, and inside a GPU keeps every slot whose expert stays.
//
// Ties break deterministically: equal weights in ascending index order, equal packs (and equal
// replica candidates) toward the lower index.
//
// Called by the coordinator's Rebalance (ClusterState) and by the benchmark. Pure and stateless:
// thread-safe.
#ifndef MOE_SERVER_COORDINATOR_EPLB_PLANNER_H_
#define MOE_SERVER_COORDINATOR_EPLB_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe {

struct EplbProblem {
  int num_layers = 0;
  int num_logical = 0;  // E
  // [L, E]: load per (layer, logical expert) over the window; finite and >= 0.
  absl::Span<const double> load;
  // [P]: the GPU (shard) of each slot in the new placement, in [0, num_gpus), or -1 for a slot that
  // stays vacant (its shard is gone). Every GPU needs at least one slot and the live slots must be
  // at least E.
  absl::Span<const int32_t> slot_to_gpu;
  int num_gpus = 1;
  // Hierarchical policy inputs: GPUs are node-major (GPU g is on node g / (num_gpus / num_nodes))
  // and experts form num_groups groups of consecutive ids. The hierarchical policy runs when
  // num_groups % num_nodes == 0, num_nodes > 1 divides num_gpus, num_groups divides E and every
  // GPU has the same number of slots; otherwise the global policy.
  int num_nodes = 1;
  int num_groups = 1;
  // [L, P]: the current placement (-1 = vacant), or empty when there is none (every layer is
  // planned and nothing counts as moved).
  absl::Span<const int32_t> current;
  // [P]: the GPU hosting each slot in the current placement (-1: none); empty means the same as
  // slot_to_gpu. When it differs from slot_to_gpu the layout itself changes, and every layer is
  // re-planned regardless of min_gain.
  absl::Span<const int32_t> current_slot_to_gpu;
  // A layer is re-placed only when balancedness_after - balancedness_before >= min_gain (and the
  // gain is positive).
  double min_gain = 0;
  // Bytes of one expert (bytes_to_move = moved_experts x expert_bytes).
  int64_t expert_bytes = 0;
};

struct EplbLayerPlan {
  double balancedness_before = 1.0;  // current placement; 1 without one
  double balancedness_after = 1.0;   // the returned placement
  bool changed = false;
  int moved_experts = 0;  // (GPU, expert) pairs the new placement adds
};

struct EplbPlan {
  std::vector<int32_t> physical_to_logical;  // [L, P], -1 for vacant slots
  std::vector<EplbLayerPlan> layers;         // [L]
  int64_t moved_experts = 0;
  int64_t bytes_to_move = 0;
  bool hierarchical = false;
};

// INVALID_ARGUMENT for inconsistent sizes, GPU ids out of range, a GPU without slots, fewer live
// slots than experts, negative or non-finite load, or current entries outside [-1, E).
absl::StatusOr<EplbPlan> PlanEplb(const EplbProblem& problem);

// ---- Building blocks (exposed for tests) ----

// Assigns each item to a pack: items by descending weight (ties: lower index first), each into the
// lightest pack with room (ties: lower pack index). Returns pack index per item.
// REQUIRES: sum(capacity) == weights.size(), every capacity >= 0.
std::vector<int32_t> BalancedPacking(absl::Span<const double> weights,
                                     absl::Span<const int32_t> capacity);

struct Replication {
  std::vector<int32_t> replica_to_logical;  // [num_replicas]: 0..E-1, then the added replicas
  std::vector<int32_t> count;               // [E] replicas per expert
};

// One replica per expert, then num_replicas - E more, each to argmax weights[e] / count[e]
// (ties: lower e). REQUIRES: num_replicas >= weights.size() >= 1.
Replication ReplicateExperts(absl::Span<const double> weights, int num_replicas);

// Mean / max GPU load of one layer when each replica of expert e carries load[e] / count[e]
// (count over the slots with a GPU); 1 when no GPU has load. An expert with load but no hosted
// replica makes it 0 (that load cannot be served).
// REQUIRES: physical_to_logical and slot_to_gpu have the same size; entries in [-1, E) and
// [-1, num_gpus).
double PredictedBalancedness(absl::Span<const double> load,
                             absl::Span<const int32_t> physical_to_logical,
                             absl::Span<const int32_t> slot_to_gpu, int num_gpus);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_EPLB_PLANNER_H_
