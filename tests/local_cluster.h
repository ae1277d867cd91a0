// Test harness for integration tests: real moe_coordinator and moe_shard processes started from
// the test's runfiles, on ports chosen by the kernel (--port 0 --port_file), with their stderr in
// log files under $TEST_TMPDIR.
//
// LocalCluster starts a coordinator and N shards (rank i requested by shard i) and returns once
// MoeClient::Connect sees a published map whose shards are all ready. StandaloneShard starts one
// shard without a coordinator (it hosts every expert under map version 1) and returns once its
// GetInfo reports ready. Waiting is bounded polling of port files and readiness with a deadline,
// never a fixed sleep. Destructors SIGTERM and reap the processes (SIGKILL after a bounded grace),
// fail the test unless every server that came up exited 0, and, when a test has failed, print the
// processes' logs.
//
// Callers: tests in //tests. Thread-safety: an object is used from one thread (the test body);
// the MoeClient it hands out is itself thread-safe. Ownership: each object owns its processes,
// their log files and its client.
#ifndef MOE_TESTS_LOCAL_CLUSTER_H_
#define MOE_TESTS_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace moe::testing {

// Absolute path of a file in the test's runfiles, e.g. "server/shard/moe_shard".
// REQUIRES: running under `bazel test` (TEST_SRCDIR set).
std::string RunfilePath(absl::string_view workspace_relative);

// A fresh, empty directory under $TEST_TMPDIR whose name starts with `prefix`.
std::string FreshTestDir(absl::string_view prefix);

// One child process; stdout and stderr go to `log_path`. The child gets SIGKILL if the test
// process dies first (PR_SET_PDEATHSIG), so a crashed test leaves no servers behind.
class ChildProcess {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      std::string name, const std::string& binary, const std::vector<std::string>& args,
      std::string log_path);
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // Stop() with the default grace.
  ~ChildProcess();

  // SIGTERM, then waits up to `grace` for the exit; SIGKILL after that. Returns the wait status
  // as waitpid reported it (-1 if unknown). Idempotent: later calls return the same status.
  int Stop(absl::Duration grace = absl::Seconds(15));
  // SIGKILL (a crash, as with `kill -9`) and reap; returns the wait status.
  int Kill();
  // True while the process has not exited (reaps it when it has).
  bool Running();
  // Polls `port_file` until it holds a complete "PORT\n" line, the process exits or `deadline`
  // passes (UNAVAILABLE / DEADLINE_EXCEEDED naming the process, with its log tail).
  [[nodiscard]] absl::StatusOr<int> WaitForPortFile(const std::string& port_file,
                                                    absl::Time deadline);

  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }
  std::string Log() const;
  // The last `lines` lines of the log.
  std::string LogTail(int lines = 40) const;

 private:
  ChildProcess(std::string name, pid_t pid, std::string log_path)
      : name_(std::move(name)), pid_(pid), log_path_(std::move(log_path)) {}

  std::string name_;
  pid_t pid_;
  std::string log_path_;
  bool reaped_ = false;
  int wait_status_ = -1;
};

struct LocalClusterOptions {
  std::string model_dir;  // checkpoint every shard serves
  int num_shards = 2;
  int redundant_slots = 0;
  std::string backend = "cpu";
  // Coordinator's --heartbeat_ms; 0 keeps its default.
  int heartbeat_ms = 0;
  // Extra flags for every shard (e.g. "--max_batch_wait_us=200").
  std::vector<std::string> shard_flags;
  // Extra flags for the shard of rank r only (index r; may be shorter than num_shards).
  std::vector<std::vector<std::string>> shard_flags_by_rank;
  // Extra flags for the coordinator (e.g. "--metrics_per_expert").
  std::vector<std::string> coordinator_flags;
  absl::Duration start_timeout = absl::Seconds(60);
};

class LocalCluster {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(
      LocalClusterOptions options);
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;
  ~LocalCluster();

  // "127.0.0.1:PORT" of the coordinator.
  const std::string& coordinator_address() const { return coordinator_address_; }
  // A connected client (map fetched, every shard ready, map watch on). REQUIRES: before Stop().
  MoeClient& client() { return *client_; }
  // The address shard `rank` registered, from the client's current map.
  std::string shard_address(int rank) const;
  int num_shards() const { return options_.num_shards; }
  // Every process's log, headed by its name.
  std::string Logs() const;
  // SIGKILLs shard `rank` (fault injection); its exit is not checked at teardown.
  void KillShard(int rank);
  // SIGKILLs the coordinator (a crash) and starts it again with the same flags on the same port;
  // returns once it listens. Shards and the client reconnect by themselves. The killed
  // incarnation's log stays in Logs().
  [[nodiscard]] absl::Status RestartCoordinator(absl::Duration timeout = absl::Seconds(30));
  // The coordinator's (current incarnation's) process.
  ChildProcess& coordinator_process() { return *coordinator_; }
  // The shard process of `rank` (e.g. for SIGSTOP/SIGCONT or /proc sampling).
  ChildProcess& shard_process(int rank) { return *shards_[rank]; }
  // Closes the client and stops the shards, then the coordinator; returns their wait statuses
  // in that order. Idempotent (the destructor calls it).
  std::vector<int> Stop();

 private:
  explicit LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}
  absl::Status Launch();

  LocalClusterOptions options_;
  std::string dir_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::string> coordinator_args_;  // as first launched (--port=0)
  std::vector<std::unique_ptr<ChildProcess>> crashed_coordinators_;  // by RestartCoordinator
  std::vector<std::unique_ptr<ChildProcess>> shards_;
  std::string coordinator_address_;
  std::unique_ptr<MoeClient> client_;
  bool started_ = false;      // every process came up: their exits are checked
  std::vector<bool> killed_;  // by rank: killed on purpose
};

// One shard with no coordinator, serving every expert of `model_dir` under map version 1.
class StandaloneShard {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<StandaloneShard>> Start(
      const std::string& model_dir, const std::string& backend = "cpu",
      absl::Duration start_timeout = absl::Seconds(60), std::vector<std::string> extra_flags = {});
  StandaloneShard(const StandaloneShard&) = delete;
  StandaloneShard& operator=(const StandaloneShard&) = delete;
  ~StandaloneShard();

  const std::string& address() const { return address_; }
  ChildProcess& process() { return *process_; }

 private:
  StandaloneShard() = default;

  std::unique_ptr<ChildProcess> process_;
  std::string address_;
  bool started_ = false;  // it served: its exit is checked
};

}  // namespace moe::testing

#endif  // MOE_TESTS_LOCAL_CLUSTER_H_
