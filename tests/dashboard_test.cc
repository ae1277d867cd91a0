// The coordinator's dashboard rendered by a real browser: a running cluster (coordinator + two
// shards) serves skewed traffic, then headless Chromium (Debian's `chromium`) loads the page.
// The DOM Chromium builds must hold one heatmap cell per (layer, expert) whose data attributes
// equal the coordinator's GetLoadStats answer, and the screenshot (saved to
// $TEST_UNDECLARED_OUTPUTS_DIR/dashboard.png) must show the heatmap's colors.
//
// Chromium is required: without it the test fails with a message naming the package (it is in
// ./moe deps), never skips. Every step has a deadline; Chromium runs in its own process group,
// killed whole when it overruns, with its profile under $TEST_TMPDIR.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/common/http_get.h"
#include "server/model/generator.h"
#include "tests/local_cluster.h"
#include "tests/png_pixels.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

constexpr char kChromium[] = "/usr/bin/chromium";
constexpr absl::Duration kChromiumTimeout = absl::Seconds(90);
constexpr absl::Duration kDeadline = absl::Seconds(30);
constexpr int kLayers = 3, kExperts = 16, kTopK = 2, kHidden = 64;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

absl::StatusOr<int> ReadPortFile(const std::string& path) {
  const absl::Time give_up = absl::Now() + kDeadline;
  while (absl::Now() < give_up) {
    const std::string text = ReadFile(path);
    int port = 0;
    if (absl::EndsWith(text, "\n") && absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port)) {
      return port;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port in ", path));
}

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs argv in a new process group with stdout/stderr captured in files; the whole group gets
// SIGKILL when `timeout` passes (DEADLINE_EXCEEDED then).
absl::StatusOr<CommandResult> RunWithTimeout(std::vector<std::string> argv,
                                             const std::vector<std::string>& env,
                                             const std::string& dir, absl::Duration timeout) {
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  std::vector<char*> args, envp;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  std::vector<std::string> env_storage = env;
  for (std::string& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (out_fd < 0 || err_fd < 0 || null_fd < 0) return absl::InternalError("cannot open files");
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(null_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(out_fd);
  close(err_fd);
  close(null_fd);
  if (pid < 0) return absl::InternalError("fork failed");
  const absl::Time give_up = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (absl::Now() >= give_up) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      return absl::DeadlineExceededError(absl::StrCat(
          argv[0], " ran past ", absl::FormatDuration(timeout), "; stderr:\n", ReadFile(err_path)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(-pid, SIGKILL);  // helpers it left behind (Chromium's zygotes) go with the group
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = ReadFile(out_path);
  result.err = ReadFile(err_path);
  return result;
}

// Runs headless Chromium on `url` with the given extra flags, its profile and caches in a fresh
// directory under $TEST_TMPDIR.
absl::StatusOr<CommandResult> Chromium(const std::string& url, std::vector<std::string> flags) {
  if (access(kChromium, X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(kChromium,
                     " is missing: this test needs Debian's `chromium` package "
                     "(`./moe deps` installs it)"));
  }
  const std::string dir = FreshTestDir("chromium");
  std::vector<std::string> argv = {kChromium,
                                   "--headless",
                                   "--no-sandbox",
                                   "--disable-gpu",
                                   "--disable-dev-shm-usage",
                                   "--no-first-run",
                                   "--no-default-browser-check",
                                   "--disable-extensions",
                                   "--disable-background-networking",
                                   "--disable-component-update",
                                   "--disable-sync",
                                   "--hide-scrollbars",
                                   absl::StrCat("--user-data-dir=", dir, "/profile")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(url);
  const std::vector<std::string> env = {
      absl::StrCat("HOME=", dir), absl::StrCat("XDG_CONFIG_HOME=", dir, "/config"),
      absl::StrCat("XDG_CACHE_HOME=", dir, "/cache"), "PATH=/usr/bin:/bin", "LANG=C.UTF-8"};
  return RunWithTimeout(std::move(argv), env, dir, kChromiumTimeout);
}

// Attributes of every <rect class="cell" ...> tag in `dom`.
std::vector<std::map<std::string, std::string>> HeatmapCells(const std::string& dom) {
  static const std::regex kCell(R"(<rect class="cell"[^>]*>)");
  static const std::regex kAttr(R"re(([a-z-]+)="([^"]*)")re");
  std::vector<std::map<std::string, std::string>> cells;
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), kCell); it != std::sregex_iterator();
       ++it) {
    const std::string tag = it->str();
    std::map<std::string, std::string> attrs;
    for (auto a = std::sregex_iterator(tag.begin(), tag.end(), kAttr); a != std::sregex_iterator();
         ++a) {
      attrs[(*a)[1]] = (*a)[2];
    }
    cells.push_back(std::move(attrs));
  }
  return cells;
}

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string model_dir = FreshTestDir("dashboard_model");
    model::GenerateOptions gen;
    gen.layers = kLayers;
    gen.experts = kExperts;
    gen.top_k = kTopK;
    gen.hidden = kHidden;
    gen.intermediate = 32;
    ASSERT_TRUE(model::GenerateModel(gen, model_dir).ok());
    const std::string ports = FreshTestDir("dashboard_ports");
    LocalClusterOptions options{.model_dir = model_dir, .num_shards = 2, .redundant_slots = 2};
    options.coordinator_flags = {absl::StrCat("--dashboard_port_file=", ports, "/dashboard"),
                                 "--dashboard_sample_ms=100"};
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    absl::StatusOr<int> port = ReadPortFile(ports + "/dashboard");
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
  }

  // Forwards with a skew that differs per layer: layer l sends most routes to expert 3 * l + 1.
  void SendSkewedTraffic() {
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int step = 0; step < 4; ++step) {
        const int64_t t_count = 12;
        std::vector<int32_t> ids(t_count * kTopK);
        for (int64_t t = 0; t < t_count; ++t) {
          ids[t * kTopK] = t % 3 == 2 ? static_cast<int32_t>((t + step) % kExperts) : 3 * layer + 1;
          ids[t * kTopK + 1] = static_cast<int32_t>((5 * t + layer + 7) % kExperts);
          if (ids[t * kTopK + 1] == ids[t * kTopK])
            ids[t * kTopK + 1] = (ids[t * kTopK] + 1) % kExperts;
        }
        const std::vector<float> x = Bf16RoundedNormals(t_count * kHidden, 100 + step);
        const std::vector<float> w(t_count * kTopK, 0.5f);
        ForwardOptions fo;
        fo.deadline = kDeadline;
        absl::StatusOr<ForwardResult> r =
            cluster_->client().Forward(layer, MakeView(DType::kF32, {t_count, kHidden}, x.data()),
                                       MakeView(DType::kI32, {t_count, kTopK}, ids.data()),
                                       MakeView(DType::kF32, {t_count, kTopK}, w.data()), fo);
        ASSERT_TRUE(r.ok()) << r.status();
      }
    }
  }

  // Waits (bounded) until the dashboard's sampler has recorded an interval with load, so the
  // balancedness chart has a point to draw.
  void WaitForBalancednessPoint() {
    const absl::Time give_up = absl::Now() + kDeadline;
    std::string last;
    while (absl::Now() < give_up) {
      absl::StatusOr<HttpResponse> r =
          HttpGet("127.0.0.1", port_, "/api/load", absl::Now() + absl::Seconds(5));
      ASSERT_TRUE(r.ok()) << r.status();
      last = r->body;
      const nlohmann::json j = nlohmann::json::parse(last);
      for (const auto& point : j["balancedness_history"]) {
        if (!point["mean"].is_null()) return;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    FAIL() << "the dashboard recorded no balancedness point within " << kDeadline
           << "; last /api/load: " << last;
  }

  std::unique_ptr<LocalCluster> cluster_;
  int port_ = 0;
};

TEST_F(DashboardTest, ChromiumRendersTheHeatmapOfTheRunningCluster) {
  ASSERT_NO_FATAL_FAILURE(SendSkewedTraffic());
  absl::StatusOr<v1::LoadStats> stats = cluster_->client().GetLoadStats(/*refresh=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->layers_size(), kLayers);
  ASSERT_NO_FATAL_FAILURE(WaitForBalancednessPoint());

  const std::string base = absl::StrCat("http://127.0.0.1:", port_);
  absl::StatusOr<CommandResult> dom =
      Chromium(base + "/?view=cumulative&refresh=0", {"--dump-dom"});
  ASSERT_TRUE(dom.ok()) << dom.status();
  ASSERT_EQ(dom->exit_code, 0) << dom->err;
  // Chromium's parser wraps table rows in <tbody>, which the server never writes: this DOM came
  // through a browser.
  ASSERT_TRUE(absl::StrContains(dom->out, "<tbody>")) << dom->out.substr(0, 2000);
  EXPECT_TRUE(absl::StrContains(dom->out, "<div id=\"heatmap\" data-view=\"cumulative\">"));

  const std::vector<std::map<std::string, std::string>> cells = HeatmapCells(dom->out);
  ASSERT_EQ(cells.size(), static_cast<size_t>(kLayers * kExperts));
  std::set<std::pair<int, int>> seen;
  int64_t hottest_load = -1;
  std::string hottest_fill;
  for (const auto& cell : cells) {
    int layer = -1, expert = -1;
    int64_t load = -1, cumulative = -1, window = -1;
    ASSERT_TRUE(absl::SimpleAtoi(cell.at("data-layer"), &layer));
    ASSERT_TRUE(absl::SimpleAtoi(cell.at("data-expert"), &expert));
    ASSERT_TRUE(absl::SimpleAtoi(cell.at("data-load"), &load));
    ASSERT_TRUE(absl::SimpleAtoi(cell.at("data-cumulative"), &cumulative));
    ASSERT_TRUE(absl::SimpleAtoi(cell.at("data-window"), &window));
    ASSERT_TRUE(layer >= 0 && layer < kLayers && expert >= 0 && expert < kExperts);
    seen.insert({layer, expert});
    const int64_t want = stats->layers(layer).expert_load(expert);
    EXPECT_EQ(load, want) << "layer " << layer << " expert " << expert;
    EXPECT_EQ(cumulative, want) << "layer " << layer << " expert " << expert;
    EXPECT_LE(window, cumulative);
    // Every layer's total is the same here (4 steps x 12 tokens x 2 routes), so the largest load
    // is also the largest share and must be drawn in the darkest color.
    if (load > hottest_load) {
      hottest_load = load;
      hottest_fill = cell.at("fill");
    }
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kLayers * kExperts));
  EXPECT_EQ(hottest_fill, "#7f0000");
  EXPECT_TRUE(absl::StrContains(dom->out, "class=\"balance-chart\""));
  EXPECT_TRUE(absl::StrContains(dom->out, "<circle class=\"mean\""));

  // The screenshot, for people and for a color check: the hottest color is on screen.
  const char* outputs = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  ASSERT_NE(outputs, nullptr) << "run under bazel test";
  const std::string png = absl::StrCat(outputs, "/dashboard.png");
  absl::StatusOr<CommandResult> shot = Chromium(
      base + "/?refresh=0", {absl::StrCat("--screenshot=", png), "--window-size=1200,900"});
  ASSERT_TRUE(shot.ok()) << shot.status();
  ASSERT_EQ(shot->exit_code, 0) << shot->err;
  absl::StatusOr<PngImage> image = DecodePng(ReadFile(png));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->width, 1200);
  EXPECT_EQ(image->height, 900);
  EXPECT_GT(image->CountPixels(0x7f, 0x00, 0x00), 50) << "no hottest-cell pixels in " << png;
  EXPECT_GT(image->CountPixels(0xff, 0xff, 0xff), 1200 * 900 / 4) << "mostly not a white page";
}

}  // namespace
}  // namespace moe::testing
