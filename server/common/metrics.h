// Prometheus plumbing shared by moe_shard and moe_coordinator: the HTTP endpoint that serves
// /metrics in the text exposition format, the port convention of their --metrics_port flags, and
// small builders for metric families computed at scrape time (prometheus::Collectable).
//
// Label cardinality is the caller's contract: the binaries label by layer, shard rank or status
// code by default (bounded by the model and cluster shape), and by (layer, expert) only when the
// operator asks for it.
//
// Callers: server/shard/shard_metrics, server/coordinator/coordinator_metrics, the two mains.
// Thread-safety: MetricsEndpoint is immutable after Start; the exposer's HTTP threads call the
// registered collectables concurrently, so those must be thread-safe. The builders are pure.
// Ownership: the endpoint holds weak references to the collectables; their owners must keep them
// alive while they should be scraped, and anything a collectable borrows must outlive the
// endpoint (destroy the endpoint first).
#ifndef MOE_SERVER_COMMON_METRICS_H_
#define MOE_SERVER_COMMON_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

namespace moe {

// --metrics_port / --dashboard_port convention: kHttpPortOff disables the endpoint, 0 binds a
// free port (logged, and written to the port file when one is given), anything else binds that.
inline constexpr int kHttpPortOff = -1;

struct HttpEndpointOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  // When set, the bound port is written there ("PORT\n", atomically) once it listens.
  std::string port_file;
};

// INVALID_ARGUMENT unless port is kHttpPortOff or in [0, 65535] and host is non-empty.
absl::Status ValidateHttpEndpoint(const HttpEndpointOptions& options, absl::string_view flag);

// Writes "PORT\n" to `path` through a temporary file and a rename, so a poller never reads a
// partial number.
absl::Status WriteHttpPortFile(const std::string& path, int port);

// An HTTP server (prometheus-cpp's CivetWeb exposer, two threads) answering GET /metrics.
class MetricsEndpoint {
 public:
  // Binds host:port and serves the collectables' families, concatenated, at /metrics.
  // UNAVAILABLE when the address cannot be bound. REQUIRES: options.port != kHttpPortOff.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const HttpEndpointOptions& options,
      const std::vector<std::weak_ptr<prometheus::Collectable>>& collectables);

  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;
  // Stops the HTTP threads (within milliseconds); no collectable is called after this returns.
  ~MetricsEndpoint();

  int port() const { return port_; }

 private:
  MetricsEndpoint() = default;

  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  std::string wake_host_;  // where the destructor knocks to stop the exposer promptly
};

// Builders for scrape-time families. A family is created empty and samples are appended.
prometheus::MetricFamily GaugeFamily(std::string name, std::string help);
prometheus::MetricFamily CounterFamily(std::string name, std::string help);
// Appends one sample to `family` (its type decides whether `value` is a gauge or counter value).
// `labels` are (name, value) pairs.
void AddSample(prometheus::MetricFamily& family, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {});

// Histogram bucket bounds: `count` bounds, the first `start`, each `factor` times the previous.
// REQUIRES: start > 0, factor > 1, count >= 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_METRICS_H_
