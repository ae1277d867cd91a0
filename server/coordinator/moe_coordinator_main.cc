// moe_coordinator: shard registry, cluster map and expert-load aggregation for moe-serve.
// Runs until SIGTERM or SIGINT, then shuts down gracefully and exits 0.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/common/security_flags.h"
#include "server/coordinator/coordinator_server.h"
#include "server/coordinator/observability.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on (0.0.0.0 or :: for all).");
ABSL_FLAG(int, port, 0, "Port to listen on; 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written here after startup.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory of the durable state journal (map versions, shard registry, load totals); "
          "a restart with the same directory resumes from it. Empty: state is kept in memory.");
ABSL_FLAG(int, num_shards, 1, "Shards to wait for before publishing the first cluster map.");
ABSL_FLAG(int, redundant_slots, 0, "Redundant expert slots per layer (P = experts + this).");
ABSL_FLAG(int, heartbeat_ms, 500, "Heartbeat interval told to shards.");
ABSL_FLAG(int, missed_heartbeats, 3,
          "Heartbeat intervals without a heartbeat after which a shard is removed.");
ABSL_FLAG(double, load_window_seconds, 60,
          "Sliding load window per (layer, expert) and per shard that rebalancing plans with.");
ABSL_FLAG(int, rebalance_interval_seconds, 0,
          "Periodic EPLB policy: rebalance this often from the load window; 0 turns it off.");
ABSL_FLAG(double, rebalance_min_gain, 0.05,
          "Periodic policy: re-place a layer only when its balancedness gains this much.");
ABSL_FLAG(int, switch_drain_ms, 2000,
          "After a placement switch commits, shards keep accepting the old map version this long.");
ABSL_FLAG(int, switch_timeout_seconds, 60,
          "A placement switch whose shards are not all ready by then is abandoned.");
ABSL_FLAG(int, eplb_nodes, 1,
          "Hierarchical EPLB: nodes (ranks are node-major); 1 = global policy.");
ABSL_FLAG(int, eplb_groups, 1, "Hierarchical EPLB: expert groups (consecutive expert ids).");
ABSL_FLAG(bool, restore_after_failure, true,
          "Move a removed shard's slots to the survivors at once; off, its experts without another "
          "replica stay unavailable until a rebalance or drain moves them.");
ABSL_FLAG(bool, health_checks, true,
          "Health-check the shards every heartbeat interval and remove failing ones.");
ABSL_FLAG(int, max_connection_age_seconds, 300,
          "Close each client connection (GOAWAY) after this long so that clients re-resolve the "
          "address and see new pods; 0 keeps connections forever.");
ABSL_FLAG(std::string, http_host, "127.0.0.1",
          "Address the HTTP endpoints (metrics, dashboard) listen on.");
ABSL_FLAG(int, metrics_port, 0,
          "Prometheus /metrics HTTP port: 0 picks a free one (logged; see --metrics_port_file), "
          "-1 turns metrics off.");
ABSL_FLAG(std::string, metrics_port_file, "", "If set, the bound metrics port is written here.");
ABSL_FLAG(bool, metrics_per_expert, false,
          "Also export routes per (layer, expert): layers x experts series.");
ABSL_FLAG(int, dashboard_port, 0,
          "Dashboard HTTP port (/ page, /api/load JSON): 0 picks a free one (logged; see "
          "--dashboard_port_file), -1 turns it off.");
ABSL_FLAG(std::string, dashboard_port_file, "",
          "If set, the bound dashboard port is written here.");
ABSL_FLAG(int, dashboard_sample_ms, 1000,
          "How often the dashboard and metrics sample the load (their window and balancedness "
          "history).");
ABSL_FLAG(int, dashboard_window_samples, 10,
          "Samples per dashboard load window (it spans this many sampling intervals).");

namespace {

// In-flight calls get this long to finish after a termination signal.
constexpr absl::Duration kShutdownGrace = absl::Seconds(5);

moe::CoordinatorOptions OptionsFromFlags() {
  moe::CoordinatorOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.cluster.num_shards = absl::GetFlag(FLAGS_num_shards);
  options.cluster.redundant_slots = absl::GetFlag(FLAGS_redundant_slots);
  options.cluster.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  options.cluster.missed_heartbeats_until_dead = absl::GetFlag(FLAGS_missed_heartbeats);
  options.cluster.load_window = absl::Seconds(absl::GetFlag(FLAGS_load_window_seconds));
  options.cluster.switch_drain = absl::Milliseconds(absl::GetFlag(FLAGS_switch_drain_ms));
  options.cluster.switch_timeout = absl::Seconds(absl::GetFlag(FLAGS_switch_timeout_seconds));
  options.cluster.eplb_nodes = absl::GetFlag(FLAGS_eplb_nodes);
  options.cluster.eplb_groups = absl::GetFlag(FLAGS_eplb_groups);
  options.supervisor.health_checks = absl::GetFlag(FLAGS_health_checks);
  options.cluster.restore_after_failure = absl::GetFlag(FLAGS_restore_after_failure);
  options.supervisor.rebalance_interval =
      absl::Seconds(absl::GetFlag(FLAGS_rebalance_interval_seconds));
  options.supervisor.rebalance_min_gain = absl::GetFlag(FLAGS_rebalance_min_gain);
  options.max_connection_age = absl::Seconds(absl::GetFlag(FLAGS_max_connection_age_seconds));
  return options;
}

moe::ObservabilityOptions ObservabilityFromFlags(int num_shards) {
  moe::ObservabilityOptions o;
  const std::string host = absl::GetFlag(FLAGS_http_host);
  o.metrics = {host, absl::GetFlag(FLAGS_metrics_port), absl::GetFlag(FLAGS_metrics_port_file)};
  o.dashboard = {host, absl::GetFlag(FLAGS_dashboard_port),
                 absl::GetFlag(FLAGS_dashboard_port_file)};
  o.metrics_per_expert = absl::GetFlag(FLAGS_metrics_per_expert);
  o.sample_interval = absl::Milliseconds(absl::GetFlag(FLAGS_dashboard_sample_ms));
  o.history.window_samples = absl::GetFlag(FLAGS_dashboard_window_samples);
  o.expected_shards = num_shards;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "moe_coordinator --num_shards=N [--redundant_slots=R] [--port=P | --port_file=FILE]");
  moe::ListServerFlagsInHelp();
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // A crash prints its signal and stack to the log before the process dies.
  google::InstallFailureSignalHandler();

  // Blocked before gRPC starts its threads, so the signals reach only the sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  moe::CoordinatorOptions options = OptionsFromFlags();
  // TLS/mTLS and tokens for the server and for the coordinator's calls to shards.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      moe::ServerCredentialsFromFlags();
  absl::Status client_security = moe::InstallClientSecurityFromFlags();
  if (!credentials.ok() || !client_security.ok()) {
    const absl::Status& bad = credentials.ok() ? client_security : credentials.status();
    std::fprintf(stderr, "moe_coordinator: %s\n", bad.ToString().c_str());
    return 2;
  }
  options.credentials = *std::move(credentials);
  // Declared before the server so that it outlives the ClusterState that appends to it.
  std::unique_ptr<moe::Journal> journal;
  moe::JournalState recovered;
  if (const std::string dir = absl::GetFlag(FLAGS_state_dir); !dir.empty()) {
    absl::StatusOr<std::unique_ptr<moe::Journal>> opened = moe::Journal::Open(dir, &recovered);
    if (!opened.ok()) {
      std::fprintf(stderr, "moe_coordinator: %s\n", opened.status().ToString().c_str());
      return 2;
    }
    journal = *std::move(opened);
    options.cluster.journal = journal.get();
    options.restore = &recovered;
  }
  auto server = moe::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "moe_coordinator: %s\n", server.status().ToString().c_str());
    return 2;
  }
  auto observability = moe::CoordinatorObservability::Start(
      ObservabilityFromFlags(options.cluster.num_shards), &(*server)->state());
  if (!observability.ok()) {
    std::fprintf(stderr, "moe_coordinator: %s\n", observability.status().ToString().c_str());
    return 2;
  }
  int signal = 0;
  sigwait(&stop_signals, &signal);
  LOG(INFO) << "received signal " << signal << ", shutting down";
  observability->reset();  // its HTTP threads read the server's state
  (*server)->Shutdown(kShutdownGrace);
  return 0;
}
