#include "server/common/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "prometheus/metric_type.h"

namespace moe {
namespace {

// IPv6 literals need brackets in CivetWeb's "host:port" listening option.
std::string BindAddress(const std::string& host, int port) {
  if (absl::StrContains(host, ':') && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

// The address a local client reaches a server bound to `host` at (wildcards mean loopback).
std::string LocalAddressFor(const std::string& host) {
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::" || host == "[::]") return "::1";
  return host;
}

// Opens and at once closes a TCP connection to host:port, without waiting for it to complete.
void KnockOnPort(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_str = absl::StrCat(port);
  if (getaddrinfo(host.c_str(), port_str.c_str(), &hints, &found) != 0) return;
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    (void)connect(fd, found->ai_addr, found->ai_addrlen);
    close(fd);
  }
  freeaddrinfo(found);
}

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

}  // namespace

absl::Status ValidateHttpEndpoint(const HttpEndpointOptions& options, absl::string_view flag) {
  if (options.port == kHttpPortOff) return absl::OkStatus();
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be -1 (off), 0 (any free port) or a port number, got ", options.port));
  }
  if (options.host.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty host"));
  return absl::OkStatus();
}

absl::Status WriteHttpPortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "w");
  if (file == nullptr) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  const bool written = std::fprintf(file, "%d\n", port) > 0;
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write port file ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const HttpEndpointOptions& options,
    const std::vector<std::weak_ptr<prometheus::Collectable>>& collectables) {
  CHECK_NE(options.port, kHttpPortOff) << "the caller decides whether metrics are on";
  if (absl::Status s = ValidateHttpEndpoint(options, "metrics port"); !s.ok()) return s;
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  const std::string address = BindAddress(options.host, options.port);
  // prometheus-cpp reports a failed bind by throwing (CivetException); this is the one place the
  // project meets that exception, and it becomes a Status here.
  try {
    endpoint->exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = endpoint->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint on ", address, " has no port"));
  }
  endpoint->port_ = ports[0];
  endpoint->wake_host_ = LocalAddressFor(options.host);
  for (const std::weak_ptr<prometheus::Collectable>& c : collectables) {
    endpoint->exposer_->RegisterCollectable(c);
  }
  if (!options.port_file.empty()) {
    if (absl::Status s = WriteHttpPortFile(options.port_file, endpoint->port_); !s.ok()) return s;
  }
  LOG(INFO) << "metrics on http://" << BindAddress(options.host, endpoint->port_) << "/metrics";
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (exposer_ == nullptr) return;
  // CivetWeb's accept loop polls the listening socket with a 2 s timeout, and stopping waits for
  // that loop to notice the stop flag: every server shutdown would take up to 2 s. A connection
  // attempt wakes the loop at once, so a helper keeps knocking until the exposer is gone.
  std::atomic<bool> stopped{false};
  std::thread knocker([this, &stopped] {
    while (!stopped.load()) {
      KnockOnPort(wake_host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  exposer_.reset();
  stopped.store(true);
  knocker.join();
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Gauge);
}

prometheus::MetricFamily CounterFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Counter);
}

void AddSample(prometheus::MetricFamily& family, double value,
               std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  CHECK(start > 0 && factor > 1 && count >= 1) << start << " " << factor << " " << count;
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

}  // namespace moe
