#include "server/coordinator/coordinator_server.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace moe {
namespace {

// IPv6 literals need brackets in a "host:port" address.
std::string JoinHostPort(const std::string& host, int port) {
  if (absl::StrContains(host, ':') && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::Status ValidateOptions(const CoordinatorOptions& options) {
  if (options.host.empty()) return absl::InvalidArgumentError("--host is empty");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port must be in [0, 65535], got ", options.port));
  }
  if (options.cluster.num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_shards must be >= 1, got ", options.cluster.num_shards));
  }
  if (options.cluster.redundant_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--redundant_slots must be >= 0, got ", options.cluster.redundant_slots));
  }
  if (options.cluster.heartbeat_interval < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_ms must be >= 1, got ",
                     absl::FormatDuration(options.cluster.heartbeat_interval)));
  }
  if (options.cluster.missed_heartbeats_until_dead < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--missed_heartbeats must be >= 1, got ",
                                                   options.cluster.missed_heartbeats_until_dead));
  }
  if (options.max_connection_age < absl::ZeroDuration() ||
      options.max_connection_age > absl::Milliseconds(INT_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_connection_age_seconds must be in [0, ",
                     absl::ToInt64Seconds(absl::Milliseconds(INT_MAX)), "], got ",
                     absl::FormatDuration(options.max_connection_age)));
  }
  if (options.cluster.load_window <= absl::ZeroDuration() ||
      options.cluster.switch_drain < absl::ZeroDuration() ||
      options.cluster.switch_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--load_window_seconds and --switch_timeout_seconds must be > 0, --switch_drain_ms >= 0");
  }
  if (options.cluster.eplb_nodes < 1 || options.cluster.eplb_groups < 1) {
    return absl::InvalidArgumentError("--eplb_nodes and --eplb_groups must be >= 1");
  }
  if (options.supervisor.rebalance_interval < absl::ZeroDuration() ||
      !(options.supervisor.rebalance_min_gain >= 0)) {
    return absl::InvalidArgumentError(
        "--rebalance_interval_seconds and --rebalance_min_gain must be >= 0");
  }
  if (options.collect_timeout <= absl::ZeroDuration() || options.max_message_bytes < 1) {
    return absl::InvalidArgumentError("collect timeout and message limit must be positive");
  }
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int port) {
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

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->state_ = std::make_unique<ClusterState>(options.cluster);
  if (options.restore != nullptr) {
    if (absl::Status s = server->state_->Restore(*options.restore); !s.ok()) return s;
  }
  server->service_ = std::make_unique<CoordinatorService>(
      server->state_.get(), options.collect_timeout, options.max_message_bytes);

  // Both are process-wide switches that take effect for servers built after the call.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      JoinHostPort(options.host, options.port),
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  // gRPC sets SO_REUSEPORT by default, which lets a second coordinator on the same port start
  // "successfully" and split the shards' connections with the first; fail the bind instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_AGE_MS,
        static_cast<int>(absl::ToInt64Milliseconds(options.max_connection_age)));
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", JoinHostPort(options.host, options.port)));
  }
  server->address_ = JoinHostPort(options.host, server->port_);
  SupervisorOptions supervisor = options.supervisor;
  supervisor.probe_interval = options.cluster.heartbeat_interval;
  supervisor.tick = std::max(options.cluster.heartbeat_interval / 5, absl::Milliseconds(10));
  server->supervisor_ = std::make_unique<Supervisor>(server->state_.get(), supervisor);
  server->supervisor_->Start();
  if (!options.port_file.empty()) {
    if (absl::Status s = WritePortFile(options.port_file, server->port_); !s.ok()) return s;
  }
  LOG(INFO) << "moe_coordinator listening on " << server->address_ << " (waiting for "
            << options.cluster.num_shards << " shards, " << options.cluster.redundant_slots
            << " redundant slots)";
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::ZeroDuration()); }

void CoordinatorServer::Shutdown(absl::Duration grace) {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  if (supervisor_ != nullptr) supervisor_->Stop();
  // Watch streams block on the state; they must end first or Shutdown would wait out the grace.
  state_->Shutdown();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  LOG(INFO) << "moe_coordinator on " << address_ << " stopped";
}

}  // namespace moe
