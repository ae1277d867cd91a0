#include "server/coordinator/observability.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {

absl::Status ValidateObservabilityOptions(const ObservabilityOptions& options) {
  if (absl::Status s = ValidateHttpEndpoint(options.metrics, "--metrics_port"); !s.ok()) return s;
  if (absl::Status s = ValidateHttpEndpoint(options.dashboard, "--dashboard_port"); !s.ok()) {
    return s;
  }
  if (options.sample_interval < absl::Milliseconds(10)) {
    return absl::InvalidArgumentError(absl::StrCat("load sample interval must be >= 10ms, got ",
                                                   absl::FormatDuration(options.sample_interval)));
  }
  if (options.history.window_samples < 1 || options.history.history_points < 1) {
    return absl::InvalidArgumentError("the load window and history need at least one sample");
  }
  return absl::OkStatus();
}

CoordinatorObservability::CoordinatorObservability(const ObservabilityOptions& options,
                                                   const ClusterState* state)
    : options_(options), state_(state), history_(options.history) {}

absl::StatusOr<std::unique_ptr<CoordinatorObservability>> CoordinatorObservability::Start(
    const ObservabilityOptions& options, const ClusterState* state) {
  if (absl::Status s = ValidateObservabilityOptions(options); !s.ok()) return s;
  std::unique_ptr<CoordinatorObservability> o(new CoordinatorObservability(options, state));
  const bool metrics_on = options.metrics.port != kHttpPortOff;
  const bool dashboard_on = options.dashboard.port != kHttpPortOff;
  if (!metrics_on && !dashboard_on) return o;
  o->sampler_ = std::thread([p = o.get()] { p->SampleLoop(); });
  if (metrics_on) {
    o->metrics_ = std::make_shared<CoordinatorMetrics>(state, &o->history_, options.expected_shards,
                                                       options.metrics_per_expert);
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
        MetricsEndpoint::Start(options.metrics, {o->metrics_});
    if (!endpoint.ok()) return endpoint.status();
    o->metrics_endpoint_ = *std::move(endpoint);
  }
  if (dashboard_on) {
    absl::StatusOr<std::unique_ptr<DashboardHttpServer>> dashboard = DashboardHttpServer::Start(
        options.dashboard, [p = o.get()](absl::string_view path, absl::string_view query) {
          return p->Handle(path, query);
        });
    if (!dashboard.ok()) return dashboard.status();
    o->dashboard_ = *std::move(dashboard);
  }
  return o;
}

CoordinatorObservability::~CoordinatorObservability() {
  dashboard_.reset();
  metrics_endpoint_.reset();
  stop_sampling_.Notify();
  if (sampler_.joinable()) sampler_.join();
}

int CoordinatorObservability::metrics_port() const {
  return metrics_endpoint_ ? metrics_endpoint_->port() : 0;
}

int CoordinatorObservability::dashboard_port() const { return dashboard_ ? dashboard_->port() : 0; }

void CoordinatorObservability::SampleLoop() {
  do {
    history_.Add(absl::Now(), state_->GetLoadStats());
  } while (!stop_sampling_.WaitForNotificationWithTimeout(options_.sample_interval));
}

DashboardSnapshot CoordinatorObservability::Snapshot() const {
  DashboardSnapshot s;
  s.now = absl::Now();
  s.stats = state_->GetLoadStats();
  absl::StatusOr<v1::ClusterMap> map = state_->GetClusterMap();
  if (map.ok()) s.map = *std::move(map);
  s.expected_shards = options_.expected_shards;
  s.window = history_.Window(s.now, s.stats);
  s.history = history_.Balancedness();
  return s;
}

HttpReply CoordinatorObservability::Handle(absl::string_view path, absl::string_view query) const {
  if (path == "/" || path == "/index.html") {
    return {200, "text/html; charset=utf-8",
            RenderDashboardHtml(Snapshot(), ParseDashboardQuery(query))};
  }
  if (path == "/api/load") return {200, "application/json", RenderLoadJson(Snapshot())};
  return {404, "text/plain; charset=utf-8", "not found: try / or /api/load\n"};
}

}  // namespace moe
