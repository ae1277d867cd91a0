// Synthetic expert-load traces for the EPLB planner's quality test and benchmark (spec
// performance.md "EPLB"): per layer, routes drawn from a Zipf law over the experts, with the
// popularity order shuffled independently per layer.
//
// Callers: eplb_planner_test, bench/eplb_bench. Pure given the seed: thread-safe.
#ifndef MOE_SERVER_COORDINATOR_EPLB_TRACE_H_
#define MOE_SERVER_COORDINATOR_EPLB_TRACE_H_

#include <cstdint>
#include <vector>

namespace moe {

// [num_layers, num_experts] route counts: `routes_per_layer` draws per layer where the expert of
// popularity rank r (1-based) has probability proportional to r^-exponent.
// REQUIRES: num_layers, num_experts >= 1, routes_per_layer >= 0, exponent >= 0.
std::vector<double> ZipfLoadTrace(int num_layers, int num_experts, double exponent,
                                  int64_t routes_per_layer, uint64_t seed);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_EPLB_TRACE_H_
