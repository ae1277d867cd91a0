#include "server/coordinator/supervisor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "server/common/tls.h"

namespace moe {
namespace {

constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";
// HealthCheckResponse.status (field 1, varint): SERVING = 1.
constexpr uint8_t kStatusFieldTag = 0x08;
constexpr uint8_t kServing = 1;
// Rounds in a row that a shard must time out (a busy machine answers late) or answer NOT_SERVING
// (it may be between loading its weights and flipping its health status) before it is removed.
// An unreachable shard is confirmed by one immediate second check instead: a single failure can be
// a connection recycled by its maximum age.
constexpr int kStrikesToRemove = 3;

struct PendingProbe {
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  grpc::Status status;
};

// The serving status in a HealthCheckResponse; 0 (UNKNOWN) when absent.
int ServingStatus(const grpc::ByteBuffer& response) {
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return 0;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  // The message has one small enum field: tag then a one-byte varint.
  if (bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == kStatusFieldTag) {
    return static_cast<uint8_t>(bytes[1]);
  }
  return 0;
}

ProbeResult Classify(const ShardTarget& target, const PendingProbe& probe) {
  ProbeResult result{target, ProbeOutcome::kServing, ""};
  if (probe.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    result.outcome = ProbeOutcome::kTimedOut;
    result.detail = "health check timed out";
  } else if (!probe.status.ok()) {
    result.outcome = ProbeOutcome::kUnreachable;
    result.detail = absl::StrCat("health check failed: ", probe.status.error_message());
  } else if (const int status = ServingStatus(probe.response); status != kServing) {
    result.outcome = ProbeOutcome::kNotServing;
    result.detail = absl::StrCat("health check answered status ", status, " (not SERVING)");
  }
  return result;
}

}  // namespace

std::shared_ptr<grpc::Channel> HealthProber::ChannelFor(const std::string& address) {
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    channel = CreateSecureChannel(address, DefaultChannelSecurity(), grpc::ChannelArguments());
  }
  return channel;
}

std::vector<ProbeResult> HealthProber::ProbeAll(const std::vector<ShardTarget>& targets) {
  std::vector<PendingProbe> probes(targets.size());
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  absl::BlockingCounter remaining(static_cast<int>(targets.size()));
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout_);
  for (size_t i = 0; i < targets.size(); ++i) {
    PendingProbe& probe = probes[i];
    grpc::Slice empty("", 0);  // HealthCheckRequest{service: ""}: the server as a whole
    probe.request = grpc::ByteBuffer(&empty, 1);
    probe.context.set_deadline(deadline);
    stubs.push_back(std::make_unique<grpc::GenericStub>(ChannelFor(targets[i].address)));
    stubs.back()->UnaryCall(&probe.context, kHealthCheckMethod, grpc::StubOptions(), &probe.request,
                            &probe.response, [&probe, &remaining](grpc::Status status) {
                              probe.status = std::move(status);
                              remaining.DecrementCount();
                            });
  }
  // Every call carries the deadline, so this wait is bounded.
  remaining.Wait();
  std::vector<ProbeResult> results;
  for (size_t i = 0; i < targets.size(); ++i) results.push_back(Classify(targets[i], probes[i]));
  return results;
}

Supervisor::Supervisor(ClusterState* state, SupervisorOptions options)
    : state_(state), options_(options), prober_(options.probe_interval) {
  CHECK_GT(options_.tick, absl::ZeroDuration());
  CHECK_GT(options_.probe_interval, absl::ZeroDuration());
}

Supervisor::~Supervisor() { Stop(); }

void Supervisor::Start() {
  next_probe_ = absl::Now() + options_.probe_interval;
  next_rebalance_ = absl::Now() + options_.rebalance_interval;
  thread_ = std::thread([this] { Loop(); });
}

void Supervisor::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void Supervisor::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.tick)) {
    state_->Tick();
    const absl::Time now = absl::Now();
    if (options_.health_checks && now >= next_probe_) {
      Probe();
      next_probe_ = absl::Now() + options_.probe_interval;
    }
    if (options_.rebalance_interval > absl::ZeroDuration() && now >= next_rebalance_) {
      MaybeRebalance();
      next_rebalance_ = absl::Now() + options_.rebalance_interval;
    }
  }
}

void Supervisor::Probe() {
  std::vector<ShardTarget> targets = state_->ProbeTargets();
  if (targets.empty()) return;
  std::vector<ShardTarget> again;
  for (const ProbeResult& r : prober_.ProbeAll(targets)) {
    if (r.outcome == ProbeOutcome::kUnreachable) {
      again.push_back(r.target);
    } else if (r.outcome == ProbeOutcome::kServing) {
      strikes_.erase(r.target.shard_id);
    } else if (++strikes_[r.target.shard_id] >= kStrikesToRemove) {
      (void)state_->ReportUnhealthy(r.target.shard_id, r.detail);
    }
  }
  if (again.empty()) return;
  // An unreachable shard is asked once more right away before it is removed.
  for (const ProbeResult& r : prober_.ProbeAll(again)) {
    if (r.outcome == ProbeOutcome::kUnreachable) {
      (void)state_->ReportUnhealthy(r.target.shard_id, r.detail);
    }
  }
}

void Supervisor::MaybeRebalance() {
  if (state_->pending_version() != 0) return;
  v1::RebalanceRequest request;
  request.set_min_gain(options_.rebalance_min_gain);
  absl::StatusOr<v1::RebalancePlan> plan = state_->Rebalance(request);
  if (!plan.ok()) {
    LOG(WARNING) << "periodic rebalance: " << plan.status();
    return;
  }
  if (plan->new_map_version() == 0) return;
  LOG(INFO) << "periodic rebalance: map version " << plan->new_map_version()
            << " pending, predicted balancedness " << plan->mean_balancedness_before() << " -> "
            << plan->mean_balancedness_after() << ", " << plan->moved_experts()
            << " experts to move";
}

}  // namespace moe
