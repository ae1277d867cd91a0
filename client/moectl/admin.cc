#include "client/moectl/admin.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "server/common/status.h"

namespace moe {

std::string FormatRebalancePlan(const v1::RebalancePlan& plan, bool dry_run) {
  std::string out = absl::StrFormat("%-6s %12s %12s %8s %6s\n", "layer", "balanced", "planned",
                                    "changed", "moved");
  for (const v1::LayerRebalance& l : plan.layers()) {
    absl::StrAppendFormat(&out, "%-6d %12.4f %12.4f %8s %6d\n", l.layer(), l.balancedness_before(),
                          l.balancedness_after(), l.changed() ? "yes" : "-", l.moved_experts());
  }
  absl::StrAppendFormat(
      &out,
      "mean balancedness %.4f -> %.4f (%s policy, %d routes in the window, planned in %.2f ms)\n",
      plan.mean_balancedness_before(), plan.mean_balancedness_after(),
      plan.hierarchical() ? "hierarchical" : "global", plan.window_routes(), plan.planning_ms());
  absl::StrAppendFormat(&out, "%d experts to move, %d bytes\n", plan.moved_experts(),
                        plan.bytes_to_move());
  if (dry_run) {
    absl::StrAppend(&out, "dry run: the map is unchanged\n");
  } else if (plan.new_map_version() == 0) {
    absl::StrAppend(&out, "nothing worth moving: the map is unchanged\n");
  } else {
    absl::StrAppend(&out, "map version ", plan.new_map_version(),
                    plan.committed() ? " committed\n" : " pending (shards are loading it)\n");
  }
  return out;
}

absl::Status RunRebalance(const std::string& coordinator, const v1::RebalanceRequest& request,
                          absl::Duration timeout, std::ostream& out) {
  auto stub = v1::Coordinator::NewStub(MakeChannel(coordinator));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::RebalancePlan plan;
  grpc::Status status = stub->Rebalance(&context, request, &plan);
  if (!status.ok()) return FromGrpcStatus(status);
  out << FormatRebalancePlan(plan, request.dry_run());
  if (request.wait() && plan.new_map_version() > 0 && !plan.committed()) {
    return absl::DeadlineExceededError(
        absl::StrCat("map version ", plan.new_map_version(), " did not commit in time"));
  }
  return absl::OkStatus();
}

absl::Status RunDrain(const std::string& coordinator, const v1::DrainRequest& request,
                      absl::Duration timeout, std::ostream& out) {
  auto stub = v1::Coordinator::NewStub(MakeChannel(coordinator));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::DrainResponse response;
  grpc::Status status = stub->Drain(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  out << "draining " << request.shard_id() << ": " << response.moved_slots()
      << " slots move to the other shards";
  if (response.new_map_version() > 0) {
    out << " in map version " << response.new_map_version()
        << (response.committed() ? " (committed)" : " (pending)");
  }
  out << "; the shard stops serving once older map versions have drained\n";
  if (request.wait() && !response.committed()) {
    return absl::DeadlineExceededError("the drain did not commit in time");
  }
  return absl::OkStatus();
}

}  // namespace moe
