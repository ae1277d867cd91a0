// moectl's placement commands: `rebalance` (EPLB plan, dry run or two-phase apply) and `drain`
// (move a shard's slots to the others, then stop it), talking to the coordinator directly so
// they work whatever state the cluster is in.
//
// Called by moectl's main. Thread-safety: stateless functions.
#ifndef MOE_CLIENT_MOECTL_ADMIN_H_
#define MOE_CLIENT_MOECTL_ADMIN_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

// A plan as a per-layer table (balancedness before -> after, moved experts) with totals.
std::string FormatRebalancePlan(const v1::RebalancePlan& plan, bool dry_run);

// Sends `request` to the coordinator at `coordinator` and prints the plan to `out`.
absl::Status RunRebalance(const std::string& coordinator, const v1::RebalanceRequest& request,
                          absl::Duration timeout, std::ostream& out);

// Drains `request.shard_id()` and prints the outcome to `out`.
absl::Status RunDrain(const std::string& coordinator, const v1::DrainRequest& request,
                      absl::Duration timeout, std::ostream& out);

}  // namespace moe

#endif  // MOE_CLIENT_MOECTL_ADMIN_H_
