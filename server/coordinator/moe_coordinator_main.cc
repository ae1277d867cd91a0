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
#include "server/coordinator/coordinator_server.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on (0.0.0.0 or :: for all).");
ABSL_FLAG(int, port, 0, "Port to listen on; 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written here after startup.");
ABSL_FLAG(int, num_shards, 1, "Shards to wait for before publishing the first cluster map.");
ABSL_FLAG(int, redundant_slots, 0, "Redundant expert slots per layer (P = experts + this).");
ABSL_FLAG(int, heartbeat_ms, 500, "Heartbeat interval told to shards; 3 missed = not alive.");

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
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "moe_coordinator --num_shards=N [--redundant_slots=R] [--port=P | --port_file=FILE]");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);

  // Blocked before gRPC starts its threads, so the signals reach only the sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto server = moe::CoordinatorServer::Start(OptionsFromFlags());
  if (!server.ok()) {
    std::fprintf(stderr, "moe_coordinator: %s\n", server.status().ToString().c_str());
    return 2;
  }
  int signal = 0;
  sigwait(&stop_signals, &signal);
  LOG(INFO) << "received signal " << signal << ", shutting down";
  (*server)->Shutdown(kShutdownGrace);
  return 0;
}
