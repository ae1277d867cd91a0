// The demo's client workload: routed forwards over every layer through a live cluster, each output
// checked against the in-process CPU reference of the same checkpoint, with latency percentiles,
// throughput and an exact check of the coordinator's load counts against the client's own.
//
// Called by `moectl workload` (and so by `./moe demo`) and by end-to-end tests.
// Thread-safety: RunWorkload is self-contained; it starts `clients` threads of its own.
#ifndef MOE_CLIENT_MOECTL_WORKLOAD_H_
#define MOE_CLIENT_MOECTL_WORKLOAD_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace moe {

struct WorkloadOptions {
  std::string coordinator;  // host:port
  std::string model_dir;    // the same checkpoint the shards serve (for routing and reference)
  int steps = 200;          // forwards in total, layers taken round-robin
  int tokens = 16;          // tokens per forward
  int clients = 2;          // concurrent client threads
  double skew = 1.2;        // Zipf-like exponent added to router logits (0: model's own routing)
  double padding_fraction = 0.05;  // share of tokens marked as padding
  uint64_t seed = 1;
  bool verify = true;  // compare each output with the CPU reference
  // How requests reach the shards (ForwardOptions): ForwardRaw frames, protobuf Forward, or
  // direct TCP channels where the shards serve them.
  bool raw_transport = true;
  TcpChannelUse tcp_channel = TcpChannelUse::kAuto;
  // Keep the map current with WatchClusterMap (ClientOptions::watch_map); false: refresh it only
  // on a stale-map answer.
  bool watch_map = true;
  absl::Duration connect_wait = absl::Seconds(60);
};

struct WorkloadReport {
  int64_t calls = 0;
  int64_t tokens = 0;
  double worst_relative_error = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
  struct SlowCall {
    double us = 0;          // latency
    double at_seconds = 0;  // when the call started, after the workload's start
  };
  std::vector<SlowCall> slowest;  // the three slowest calls, slowest first
  double wall_seconds = 0;
  bool load_counts_match = false;
};

// Runs the workload and writes a human-readable report to `out`. An error from any call, a
// relative error above 1e-2, or load counts that differ from the client's make it fail.
absl::StatusOr<WorkloadReport> RunWorkload(const WorkloadOptions& options, std::ostream& out);

}  // namespace moe

#endif  // MOE_CLIENT_MOECTL_WORKLOAD_H_
