// eplb_bench: the EPLB planner on the skewed synthetic trace of performance.md "EPLB" (Zipf 1.2
// over experts, independent per layer; 61 layers, 256 experts, 32 shards, 288 slots).
//
// Reports, against the plain DeepSeek implementation (server/coordinator/eplb_reference.h) on the
// same trace: predicted balancedness per layer (mean and min), planning time (median and spread
// over --repeats runs) for a first plan, a plan from the coordinator's initial placement and a
// steady-state re-plan on a drifted window (with the experts it moves), and the hierarchical
// policy (--nodes, --groups). Writes JSON to --out_json, by default
// bench/results/eplb_bench_<date>.json in the workspace (`bazel run` sets the workspace path).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "server/coordinator/eplb_planner.h"
#include "server/coordinator/eplb_reference.h"
#include "server/coordinator/eplb_trace.h"

ABSL_FLAG(int, layers, 61, "MoE layers");
ABSL_FLAG(int, experts, 256, "logical experts per layer");
ABSL_FLAG(int, shards, 32, "shards (GPUs)");
ABSL_FLAG(int, slots, 288, "physical slots per layer");
ABSL_FLAG(double, zipf, 1.2, "Zipf exponent of expert popularity");
ABSL_FLAG(int64_t, routes, 100000, "routes per layer in the load window");
ABSL_FLAG(uint64_t, seed, 2024, "trace seed");
ABSL_FLAG(int, nodes, 4, "nodes for the hierarchical run");
ABSL_FLAG(int, groups, 8, "expert groups for the hierarchical run");
ABSL_FLAG(int, repeats, 21, "planning runs per case (median reported)");
ABSL_FLAG(std::string, out_json, "", "JSON output (default bench/results/eplb_bench_<date>.json)");
ABSL_FLAG(std::string, commit, "unknown", "commit the binary was built from");

namespace moe::bench {
namespace {

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

struct CaseResult {
  std::string name;
  EplbPlan plan;
  Timing timing;
};

double Mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

std::vector<double> After(const EplbPlan& plan) {
  std::vector<double> out;
  for (const EplbLayerPlan& l : plan.layers) out.push_back(l.balancedness_after);
  return out;
}

std::vector<double> Before(const EplbPlan& plan) {
  std::vector<double> out;
  for (const EplbLayerPlan& l : plan.layers) out.push_back(l.balancedness_before);
  return out;
}

CaseResult Run(const std::string& name, const EplbProblem& problem, int repeats) {
  CaseResult result{name, {}, {}};
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    const absl::Time start = absl::Now();
    absl::StatusOr<EplbPlan> plan = PlanEplb(problem);
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    if (!plan.ok()) {
      std::fprintf(stderr, "eplb_bench: %s: %s\n", name.c_str(),
                   std::string(plan.status().message()).c_str());
      std::exit(1);
    }
    result.plan = *std::move(plan);
  }
  std::sort(ms.begin(), ms.end());
  result.timing = {ms[ms.size() / 2], ms.front(), ms.back()};
  return result;
}

nlohmann::json ToJson(const CaseResult& c, const std::vector<double>& plain) {
  const std::vector<double> after = After(c.plan);
  int not_worse = 0;
  for (size_t l = 0; l < after.size(); ++l) not_worse += after[l] >= plain[l] - 1e-12 ? 1 : 0;
  int changed = 0;
  for (const EplbLayerPlan& l : c.plan.layers) changed += l.changed ? 1 : 0;
  return {{"case", c.name},
          {"hierarchical", c.plan.hierarchical},
          {"mean_balancedness", Mean(after)},
          {"min_balancedness", *std::min_element(after.begin(), after.end())},
          {"mean_balancedness_before", Mean(Before(c.plan))},
          {"layers_not_worse_than_plain", not_worse},
          {"layers_changed", changed},
          {"moved_experts", c.plan.moved_experts},
          {"planning_ms",
           {{"median", c.timing.median_ms}, {"min", c.timing.min_ms}, {"max", c.timing.max_ms}}}};
}

void Print(const CaseResult& c, const std::vector<double>& plain) {
  const std::vector<double> after = After(c.plan);
  std::printf(
      "%-34s balancedness mean %.4f min %.4f (plain DeepSeek %.4f), moved %6lld, "
      "planning median %.2f ms [%.2f, %.2f]\n",
      c.name.c_str(), Mean(after), *std::min_element(after.begin(), after.end()), Mean(plain),
      static_cast<long long>(c.plan.moved_experts), c.timing.median_ms, c.timing.min_ms,
      c.timing.max_ms);
}

std::string DefaultOutPath() {
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y%m%d", std::gmtime(&now));
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  return absl::StrCat(workspace != nullptr ? workspace : ".", "/bench/results/eplb_bench_", date,
                      ".json");
}

int Main() {
  const int layers = absl::GetFlag(FLAGS_layers), experts = absl::GetFlag(FLAGS_experts);
  const int shards = absl::GetFlag(FLAGS_shards), slots = absl::GetFlag(FLAGS_slots);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  if (slots % shards != 0 || slots < experts) {
    std::fprintf(stderr, "eplb_bench: --slots must be a multiple of --shards and >= --experts\n");
    return 2;
  }
  const std::vector<double> load =
      ZipfLoadTrace(layers, experts, absl::GetFlag(FLAGS_zipf), absl::GetFlag(FLAGS_routes),
                    absl::GetFlag(FLAGS_seed));
  const std::vector<double> plain = PlainDeepSeekBalancedness(load, layers, experts, slots, shards);
  std::vector<int32_t> gpu(slots), initial;
  for (int s = 0; s < slots; ++s) gpu[s] = s / (slots / shards);
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < slots; ++s) {
      initial.push_back(s < experts ? s : (s - experts) * experts / (slots - experts));
    }
  }
  EplbProblem problem;
  problem.num_layers = layers;
  problem.num_logical = experts;
  problem.load = load;
  problem.slot_to_gpu = gpu;
  problem.num_gpus = shards;
  std::vector<CaseResult> cases;
  cases.push_back(Run("global, first plan", problem, repeats));
  EplbProblem from_initial = problem;
  from_initial.current = initial;
  cases.push_back(Run("global, from initial placement", from_initial, repeats));
  // Steady state: the next window drifts each count by up to +-3% (fixed pattern).
  std::vector<double> drifted = load;
  for (size_t i = 0; i < drifted.size(); ++i) {
    drifted[i] =
        std::round(drifted[i] * (1.0 + 0.03 * (static_cast<double>(i * 7919 % 101) / 50 - 1)));
  }
  EplbProblem steady = problem;
  steady.load = drifted;
  steady.current = cases[0].plan.physical_to_logical;
  cases.push_back(Run("global, re-plan of drifted window", steady, repeats));
  steady.min_gain = 0.01;
  cases.push_back(Run("same, min_gain 0.01", steady, repeats));
  EplbProblem hierarchical = problem;
  hierarchical.num_nodes = absl::GetFlag(FLAGS_nodes);
  hierarchical.num_groups = absl::GetFlag(FLAGS_groups);
  cases.push_back(Run("hierarchical, first plan", hierarchical, repeats));

  const std::vector<double> plain_drifted =
      PlainDeepSeekBalancedness(drifted, layers, experts, slots, shards);
  nlohmann::json results = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<double>& yardstick = (i == 2 || i == 3) ? plain_drifted : plain;
    Print(cases[i], yardstick);
    nlohmann::json result = ToJson(cases[i], yardstick);
    // The plain implementation is the global policy: no yardstick for the hierarchical one (on
    // this trace its node-local replication cannot follow a hot expert's group; see notes).
    if (cases[i].plan.hierarchical) result.erase("layers_not_worse_than_plain");
    results.push_back(std::move(result));
  }
  nlohmann::json out = {
      {"benchmark", "eplb_bench: EPLB planner on the Zipf trace of performance.md"},
      {"machine", {{"hardware_threads", std::thread::hardware_concurrency()}}},
      {"commit", absl::GetFlag(FLAGS_commit)},
      {"date_unix", static_cast<int64_t>(std::time(nullptr))},
      {"trace",
       {{"layers", layers},
        {"experts", experts},
        {"shards", shards},
        {"slots", slots},
        {"zipf", absl::GetFlag(FLAGS_zipf)},
        {"routes_per_layer", absl::GetFlag(FLAGS_routes)},
        {"seed", absl::GetFlag(FLAGS_seed)}}},
      {"plain_deepseek",
       {{"mean_balancedness", Mean(plain)},
        {"min_balancedness", *std::min_element(plain.begin(), plain.end())},
        {"drifted_mean_balancedness", Mean(plain_drifted)}}},
      {"targets", {{"mean_balancedness_min", 0.90}, {"planning_ms_max", 50}}},
      {"notes",
       "plain_deepseek is the global policy on the same trace; the targets apply to the first "
       "global plan. The hierarchical case keeps replicas inside each node (groups of "
       "consecutive expert ids packed onto nodes), which Zipf popularity independent of the "
       "groups defeats: the hot expert's node cannot spread its load."},
      {"cases", results}};
  const std::string path =
      absl::GetFlag(FLAGS_out_json).empty() ? DefaultOutPath() : absl::GetFlag(FLAGS_out_json);
  std::ofstream file(path);
  file << out.dump(2) << "\n";
  if (!file) {
    std::fprintf(stderr, "eplb_bench: cannot write %s\n", path.c_str());
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  const bool met = Mean(After(cases[0].plan)) >= 0.90 && cases[0].timing.median_ms <= 50;
  std::printf("targets (mean >= 0.90, median planning <= 50 ms): %s\n", met ? "met" : "NOT met");
  return met ? 0 : 1;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "eplb_bench [--layers --experts --shards --slots --zipf --routes --seed --nodes --groups "
      "--repeats --out_json]");
  absl::ParseCommandLine(argc, argv);
  return moe::bench::Main();
}
