// A plain implementation of DeepSeek's EPLB global policy (numerics.md section 5), written
// independently of eplb_planner.h and without slot preservation: the yardstick the planner's
// quality test and bench/eplb_bench compare against ("never worse than DeepSeek").
//
// Callers: eplb_planner_test, bench/eplb_bench. Pure: thread-safe.
#ifndef MOE_SERVER_COORDINATOR_EPLB_REFERENCE_H_
#define MOE_SERVER_COORDINATOR_EPLB_REFERENCE_H_

#include <vector>

namespace moe {

// Per layer of load [layers, experts]: replicate by argmax load / count (ties: lower id), pack
// the replicas by descending per-replica load (ties: DeepSeek's replica order) into the lightest
// of `gpus` GPUs with room (slots / gpus each; ties: lower GPU), and return mean / max GPU load
// (1 for an idle layer).
// REQUIRES: gpus divides slots, slots >= experts >= 1, load.size() == layers * experts.
std::vector<double> PlainDeepSeekBalancedness(const std::vector<double>& load, int layers,
                                              int experts, int slots, int gpus);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_EPLB_REFERENCE_H_
