// The coordinator process minus flag parsing and signals: options, validation, a started gRPC
// server carrying the Coordinator service plus the standard health and reflection services, the
// port file for scripts, and graceful shutdown.
//
// Called by main.cc (moe_coordinator) and by the in-process tests.
// Thread-safety: Shutdown may be called from any thread, more than once; the accessors are
// immutable after Start.
// Ownership: owns the ClusterState, the service and the grpc::Server.
#ifndef MOE_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
#define MOE_SERVER_COORDINATOR_COORDINATOR_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/supervisor.h"

namespace moe {

struct CoordinatorOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // When set, the bound port is written there (decimal, newline) once the server listens.
  std::string port_file;
  ClusterOptions cluster;
  // Deadline of each CollectLoad call made by GetLoadStats(refresh).
  absl::Duration collect_timeout = absl::Seconds(2);
  // Send and receive limit on every channel (gRPC's default receive limit is 4 MiB).
  int max_message_bytes = 64 << 20;
  // Connections are closed (GOAWAY) after this age so that clients behind a DNS name re-resolve
  // and reach new pods; in-flight calls and watch streams keep their connection. Zero: never.
  absl::Duration max_connection_age = absl::Minutes(5);
  // Background upkeep: liveness, switch commits, health checks, periodic rebalancing. Start sets
  // its tick and probe interval from the heartbeat interval.
  SupervisorOptions supervisor;
  // Listening credentials (TLS/mTLS, token processor: server/common/tls.h); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // State replayed from cluster.journal (--state_dir), restored before the server listens;
  // null: start empty. Only read during Start.
  const JournalState* restore = nullptr;
};

// INVALID_ARGUMENT naming the first out-of-range option.
absl::Status ValidateOptions(const CoordinatorOptions& options);

// Writes "PORT\n" to `path` through a temporary file and a rename, so a script polling for the
// file never reads a partial number.
absl::Status WritePortFile(const std::string& path, int port);

class CoordinatorServer {
 public:
  // Validates the options, builds and starts the server and writes the port file.
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const CoordinatorOptions& options);

  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;
  // Shuts down with no grace period if Shutdown was not called.
  ~CoordinatorServer();

  int port() const { return port_; }
  // "host:port" as clients dial it.
  const std::string& address() const { return address_; }
  ClusterState& state() { return *state_; }

  // Ends the watch streams, then stops accepting calls and lets in-flight ones finish until
  // `grace` has passed (later ones are cancelled). Returns when the server has stopped.
  void Shutdown(absl::Duration grace);

 private:
  CoordinatorServer() = default;

  std::unique_ptr<ClusterState> state_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<Supervisor> supervisor_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
