#include "tests/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"

namespace moe::testing {
namespace {

// Poll period of the bounded waits below (port files, process exit, readiness).
constexpr absl::Duration kPollPeriod = absl::Milliseconds(10);

std::string EnvOrDie(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    std::cerr << "local_cluster: $" << name << " is not set; run this test with bazel test\n";
    std::abort();
  }
  return value;
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Whether to print the servers' logs: the running test failed or, when no test is running (a
// suite-wide fixture being torn down), any test did.
bool TestsFailed() {
  const ::testing::UnitTest* unit = ::testing::UnitTest::GetInstance();
  if (unit->current_test_info() != nullptr) return ::testing::Test::HasFailure();
  return unit->failed_test_count() > 0;
}

// A server that was serving must drain and exit 0 on SIGTERM; a crash on the way out (a thread
// outliving what it uses) fails the test.
void ExpectCleanExit(const ChildProcess& process, int wait_status) {
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)
      << process.name() << " did not exit cleanly on SIGTERM (wait status " << wait_status << ")";
}

// Status `code` with `what` and the tail of `process`'s log appended.
absl::Status WithLog(absl::StatusCode code, absl::string_view what, const ChildProcess& process) {
  return absl::Status(code, absl::StrCat(what, "\n--- last lines of ", process.name(), "'s log:\n",
                                         process.LogTail()));
}

}  // namespace

std::string RunfilePath(absl::string_view workspace_relative) {
  return absl::StrCat(EnvOrDie("TEST_SRCDIR"), "/moe_serve/", workspace_relative);
}

std::string FreshTestDir(absl::string_view prefix) {
  std::string templ = absl::StrCat(EnvOrDie("TEST_TMPDIR"), "/", prefix, "-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    std::cerr << "local_cluster: mkdtemp(" << templ << "): " << std::strerror(errno) << "\n";
    std::abort();
  }
  return templ;
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    std::string name, const std::string& binary, const std::vector<std::string>& args,
    std::string log_path) {
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<std::string> argv_storage = {binary};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("open ", log_path, ": ", std::strerror(errno)));
  }
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the test died before prctl took effect
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    static const char kExecFailed[] = "local_cluster: execv failed\n";
    (void)!write(STDERR_FILENO, kExecFailed, sizeof(kExecFailed) - 1);
    _exit(127);
  }
  const int fork_errno = errno;
  close(log_fd);
  if (null_fd >= 0) close(null_fd);
  if (pid < 0) {
    return absl::InternalError(absl::StrCat("fork for ", name, ": ", std::strerror(fork_errno)));
  }
  return std::unique_ptr<ChildProcess>(new ChildProcess(std::move(name), pid, std::move(log_path)));
}

ChildProcess::~ChildProcess() { Stop(); }

bool ChildProcess::Running() {
  if (reaped_) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return true;
  // r < 0 (ECHILD) means someone else reaped it; never signal that pid again.
  reaped_ = true;
  if (r == pid_) wait_status_ = status;
  return false;
}

int ChildProcess::Stop(absl::Duration grace) {
  if (!Running()) return wait_status_;
  kill(pid_, SIGTERM);
  const absl::Time give_up = absl::Now() + grace;
  while (Running() && absl::Now() < give_up) absl::SleepFor(kPollPeriod);
  if (!reaped_) {
    std::cerr << "local_cluster: " << name_ << " (pid " << pid_ << ") ignored SIGTERM for " << grace
              << "; sending SIGKILL\n";
    kill(pid_, SIGKILL);
    int status = 0;
    if (waitpid(pid_, &status, 0) == pid_) wait_status_ = status;
    reaped_ = true;
  }
  return wait_status_;
}

int ChildProcess::Kill() {
  if (!Running()) return wait_status_;
  kill(pid_, SIGKILL);
  int status = 0;
  if (waitpid(pid_, &status, 0) == pid_) wait_status_ = status;
  reaped_ = true;
  return wait_status_;
}

absl::StatusOr<int> ChildProcess::WaitForPortFile(const std::string& port_file,
                                                  absl::Time deadline) {
  while (true) {
    // A complete line: both servers write "PORT\n", so a partial write never parses.
    const std::string text = ReadWholeFile(port_file);
    int port = 0;
    if (!text.empty() && text.back() == '\n' &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
      return port;
    }
    if (!Running()) {
      return WithLog(absl::StatusCode::kUnavailable,
                     absl::StrCat(name_, " exited (wait status ", wait_status_, ") before writing ",
                                  port_file),
                     *this);
    }
    if (absl::Now() >= deadline) {
      return WithLog(absl::StatusCode::kDeadlineExceeded,
                     absl::StrCat(name_, " wrote no port to ", port_file, " in time"), *this);
    }
    absl::SleepFor(kPollPeriod);
  }
}

std::string ChildProcess::Log() const { return ReadWholeFile(log_path_); }

std::string ChildProcess::LogTail(int lines) const {
  std::vector<std::string> all = absl::StrSplit(Log(), '\n');
  const size_t first = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0;
  return absl::StrJoin(all.begin() + first, all.end(), "\n");
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(LocalClusterOptions options) {
  std::unique_ptr<LocalCluster> cluster(new LocalCluster(std::move(options)));
  if (absl::Status s = cluster->Launch(); !s.ok()) return s;  // the destructor reaps
  return cluster;
}

absl::Status LocalCluster::Launch() {
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  dir_ = FreshTestDir("cluster");
  std::vector<std::string> coord_args = {
      "--port=0", absl::StrCat("--port_file=", dir_, "/coordinator.port"),
      absl::StrCat("--num_shards=", options_.num_shards),
      absl::StrCat("--redundant_slots=", options_.redundant_slots)};
  if (options_.heartbeat_ms > 0) {
    coord_args.push_back(absl::StrCat("--heartbeat_ms=", options_.heartbeat_ms));
  }
  coord_args.insert(coord_args.end(), options_.coordinator_flags.begin(),
                    options_.coordinator_flags.end());
  coordinator_args_ = coord_args;
  absl::StatusOr<std::unique_ptr<ChildProcess>> coordinator =
      ChildProcess::Spawn("moe_coordinator", RunfilePath("server/coordinator/moe_coordinator"),
                          coord_args, dir_ + "/coordinator.log");
  if (!coordinator.ok()) return coordinator.status();
  coordinator_ = *std::move(coordinator);
  absl::StatusOr<int> port = coordinator_->WaitForPortFile(dir_ + "/coordinator.port", deadline);
  if (!port.ok()) return port.status();
  coordinator_address_ = absl::StrCat("127.0.0.1:", *port);

  for (int rank = 0; rank < options_.num_shards; ++rank) {
    std::vector<std::string> args = {absl::StrCat("--model=", options_.model_dir),
                                     absl::StrCat("--coordinator=", coordinator_address_),
                                     "--port=0",
                                     absl::StrCat("--port_file=", dir_, "/shard", rank, ".port"),
                                     absl::StrCat("--rank=", rank),
                                     absl::StrCat("--backend=", options_.backend)};
    args.insert(args.end(), options_.shard_flags.begin(), options_.shard_flags.end());
    if (rank < static_cast<int>(options_.shard_flags_by_rank.size())) {
      const std::vector<std::string>& own = options_.shard_flags_by_rank[rank];
      args.insert(args.end(), own.begin(), own.end());
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> shard = ChildProcess::Spawn(
        absl::StrCat("moe_shard rank ", rank), RunfilePath("server/shard/moe_shard"), args,
        absl::StrCat(dir_, "/shard", rank, ".log"));
    if (!shard.ok()) return shard.status();
    shards_.push_back(*std::move(shard));
  }
  for (int rank = 0; rank < options_.num_shards; ++rank) {
    absl::StatusOr<int> shard_port =
        shards_[rank]->WaitForPortFile(absl::StrCat(dir_, "/shard", rank, ".port"), deadline);
    if (!shard_port.ok()) return shard_port.status();
  }
  ClientOptions client_options;
  client_options.coordinator = coordinator_address_;
  client_options.default_deadline = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      MoeClient::Connect(client_options, deadline - absl::Now());
  if (!client.ok()) {
    return absl::Status(
        client.status().code(),
        absl::StrCat("cluster did not become ready: ", client.status().message(), "\n", Logs()));
  }
  client_ = *std::move(client);
  started_ = true;
  return absl::OkStatus();
}

LocalCluster::~LocalCluster() {
  const std::vector<int> statuses = Stop();
  if (started_) {
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (i < killed_.size() && killed_[i]) continue;
      ExpectCleanExit(i < shards_.size() ? *shards_[i] : *coordinator_, statuses[i]);
    }
  }
  if (TestsFailed()) std::cerr << "local_cluster logs:\n" << Logs();
}

std::vector<int> LocalCluster::Stop() {
  client_.reset();  // ends the map watch before the coordinator goes away
  std::vector<int> statuses;
  for (auto& shard : shards_) statuses.push_back(shard->Stop());
  if (coordinator_) statuses.push_back(coordinator_->Stop());
  return statuses;
}

void LocalCluster::KillShard(int rank) {
  killed_.resize(shards_.size(), false);
  killed_[rank] = true;
  shards_[rank]->Kill();
}

absl::Status LocalCluster::RestartCoordinator(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  coordinator_->Kill();
  crashed_coordinators_.push_back(std::move(coordinator_));
  std::vector<std::string> args = coordinator_args_;
  const std::string port = coordinator_address_.substr(coordinator_address_.rfind(':') + 1);
  for (std::string& arg : args) {
    if (arg == "--port=0") arg = absl::StrCat("--port=", port);
  }
  const std::string port_file = absl::StrCat(dir_, "/coordinator.port");
  std::remove(port_file.c_str());
  absl::StatusOr<std::unique_ptr<ChildProcess>> coordinator = ChildProcess::Spawn(
      absl::StrCat("moe_coordinator (restart ", crashed_coordinators_.size(), ")"),
      RunfilePath("server/coordinator/moe_coordinator"), args,
      absl::StrCat(dir_, "/coordinator", crashed_coordinators_.size(), ".log"));
  if (!coordinator.ok()) return coordinator.status();
  coordinator_ = *std::move(coordinator);
  absl::StatusOr<int> bound = coordinator_->WaitForPortFile(port_file, deadline);
  if (!bound.ok()) return bound.status();
  if (absl::StrCat(*bound) != port) {
    return absl::InternalError(absl::StrCat("restarted coordinator bound ", *bound, ", not ", port));
  }
  return absl::OkStatus();
}

std::string LocalCluster::shard_address(int rank) const {
  const v1::ClusterMap map = client_->cluster_map();
  return rank < map.shards_size() ? map.shards(rank).address() : "";
}

std::string LocalCluster::Logs() const {
  std::string out;
  for (const auto& crashed : crashed_coordinators_) {
    absl::StrAppend(&out, "=== ", crashed->name(), " (killed)\n", crashed->Log());
  }
  if (coordinator_) absl::StrAppend(&out, "=== ", coordinator_->name(), "\n", coordinator_->Log());
  for (const auto& shard : shards_)
    absl::StrAppend(&out, "=== ", shard->name(), "\n", shard->Log());
  return out;
}

absl::StatusOr<std::unique_ptr<StandaloneShard>> StandaloneShard::Start(
    const std::string& model_dir, const std::string& backend, absl::Duration start_timeout,
    std::vector<std::string> extra_flags) {
  const absl::Time deadline = absl::Now() + start_timeout;
  const std::string dir = FreshTestDir("standalone");
  std::unique_ptr<StandaloneShard> shard(new StandaloneShard());
  std::vector<std::string> flags = {absl::StrCat("--model=", model_dir), "--port=0",
                                    absl::StrCat("--port_file=", dir, "/shard.port"),
                                    absl::StrCat("--backend=", backend)};
  for (std::string& f : extra_flags) flags.push_back(std::move(f));
  absl::StatusOr<std::unique_ptr<ChildProcess>> process = ChildProcess::Spawn(
      "standalone moe_shard", RunfilePath("server/shard/moe_shard"), flags, dir + "/shard.log");
  if (!process.ok()) return process.status();
  shard->process_ = *std::move(process);
  absl::StatusOr<int> port = shard->process_->WaitForPortFile(dir + "/shard.port", deadline);
  if (!port.ok()) return port.status();
  shard->address_ = absl::StrCat("127.0.0.1:", *port);
  // The port is written before the weights are loaded; ready flips once they are active.
  auto stub = v1::ExpertShard::NewStub(MakeChannel(shard->address_));
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(2))));
    v1::ShardInfo info;
    if (stub->GetInfo(&ctx, v1::GetInfoRequest(), &info).ok() && info.ready()) {
      shard->started_ = true;
      return shard;
    }
    if (!shard->process_->Running()) {
      return WithLog(absl::StatusCode::kUnavailable, "standalone shard exited while loading",
                     *shard->process_);
    }
    if (absl::Now() >= deadline) {
      return WithLog(absl::StatusCode::kDeadlineExceeded, "standalone shard never became ready",
                     *shard->process_);
    }
    absl::SleepFor(kPollPeriod);
  }
}

StandaloneShard::~StandaloneShard() {
  if (process_) {
    const int status = process_->Stop();
    if (started_) ExpectCleanExit(*process_, status);
    if (TestsFailed()) {
      std::cerr << "standalone shard log:\n" << process_->Log();
    }
  }
}

}  // namespace moe::testing
