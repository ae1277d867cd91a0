// metrics_bench: what observability costs.
//
// - Shard hot path: the per-request work the metrics hooks add (two clock reads, OnForward and
//   OnBatch: counter increments and histogram observations), single-threaded and with two threads
//   updating the same series, in ns per request.
// - Coordinator scrape at DeepSeek-V3 scale (61 layers, 256 experts, 32 shards, 288 slots, loads
//   from random heartbeats): CoordinatorMetrics::Collect plus text serialization, with and without
//   per-expert series (series count, bytes, time), and the dashboard's HTML and JSON rendering
//   with a full balancedness history.
//
// Writes JSON to --out_json, by default bench/results/metrics_bench_<date>.json in the workspace
// (`bazel run -c opt //bench:metrics_bench`).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "prometheus/text_serializer.h"
#include "server/coordinator/cluster_state.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/dashboard_page.h"
#include "server/coordinator/load_history.h"
#include "server/shard/shard_metrics.h"

ABSL_FLAG(int, layers, 61, "MoE layers");
ABSL_FLAG(int, experts, 256, "logical experts per layer");
ABSL_FLAG(int, shards, 32, "shards");
ABSL_FLAG(int, redundant, 32, "redundant slots per layer");
ABSL_FLAG(int64_t, requests, 2'000'000, "hook calls timed per thread count");
ABSL_FLAG(int, scrapes, 20, "scrapes / renders timed (median reported)");
ABSL_FLAG(std::string, out_json, "",
          "JSON output (default bench/results/metrics_bench_<date>.json)");

namespace moe::bench {
namespace {

// One request's worth of what the service and executor add when metrics are on.
void OneRequest(ShardMetrics& m, int64_t i, int layers) {
  const absl::Time start = absl::Now();
  m.OnBatch(16, 1, absl::Microseconds(300));
  m.OnForward(i % layers, 16, absl::StatusCode::kOk, absl::Now() - start);
}

double HookNanos(int threads, int64_t per_thread, int layers) {
  ShardMetrics metrics(layers, "cpu", "bench");
  const absl::Time start = absl::Now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&metrics, per_thread, layers] {
      for (int64_t i = 0; i < per_thread; ++i) OneRequest(metrics, i, layers);
    });
  }
  for (std::thread& t : pool) t.join();
  // Wall time per request of one thread: what each caller pays, contention included.
  return absl::ToDoubleNanoseconds(absl::Now() - start) / static_cast<double>(per_thread);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A ClusterState of the requested shape whose shards have all reported random load.
std::unique_ptr<ClusterState> LoadedState(int layers, int experts, int shards, int redundant) {
  ClusterOptions options;
  options.num_shards = shards;
  options.redundant_slots = redundant;
  options.heartbeat_interval = absl::Hours(1);
  auto state = std::make_unique<ClusterState>(options);
  v1::ModelShape model;
  model.set_fingerprint("bench");
  model.set_num_layers(layers);
  model.set_num_experts(experts);
  model.set_top_k(8);
  model.set_hidden_size(7168);
  model.set_intermediate_size(2048);
  std::vector<std::string> ids;
  for (int r = 0; r < shards; ++r) {
    v1::RegisterShardRequest reg;
    reg.set_address(absl::StrCat("10.0.0.", r, ":50051"));
    reg.set_requested_rank(r);
    *reg.mutable_model() = model;
    ids.push_back(state->RegisterShard(reg)->shard_id());
  }
  const v1::ClusterMap map = *state->GetClusterMap();
  const int p = static_cast<int>(map.num_physical());
  std::mt19937_64 rng(7);
  for (int r = 0; r < shards; ++r) {
    v1::HeartbeatRequest beat;
    beat.set_shard_id(ids[r]);
    beat.set_ready_map_version(map.version());
    v1::LoadDelta* delta = beat.mutable_load();
    delta->set_num_layers(layers);
    delta->set_num_physical(p);
    for (int i = 0; i < layers * p; ++i) {
      delta->add_slot_counts(map.slot_to_rank(i % p) == static_cast<uint32_t>(r) ? rng() % 5000
                                                                                 : 0);
    }
    (void)state->Heartbeat(beat);
  }
  return state;
}

nlohmann::json ScrapeCost(const ClusterState& state, const LoadHistory& history, int shards,
                          bool per_expert, int repeats) {
  CoordinatorMetrics metrics(&state, &history, shards, per_expert);
  prometheus::TextSerializer serializer;
  std::vector<double> ms;
  size_t series = 0, bytes = 0;
  for (int i = 0; i < repeats; ++i) {
    const absl::Time start = absl::Now();
    const std::vector<prometheus::MetricFamily> families = metrics.Collect();
    const std::string text = serializer.Serialize(families);
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    series = 0;
    for (const auto& f : families) series += f.metric.size();
    bytes = text.size();
  }
  return {
      {"per_expert", per_expert}, {"series", series}, {"bytes", bytes}, {"median_ms", Median(ms)}};
}

nlohmann::json RenderCost(const ClusterState& state, LoadHistory& history, int shards,
                          int repeats) {
  // A full history: 300 one-second intervals of fresh load.
  v1::LoadStats stats = state.GetLoadStats();
  const absl::Time t0 = absl::Now() - absl::Seconds(300);
  for (int s = 0; s <= 300; ++s) {
    for (v1::LayerLoad& layer : *stats.mutable_layers()) {
      for (int64_t& v : *layer.mutable_expert_load()) v += s % 7;
      for (int64_t& v : *layer.mutable_shard_load()) v += 1 + s % 3;
    }
    history.Add(t0 + absl::Seconds(s), stats);
  }
  std::vector<double> html_ms, json_ms;
  size_t html_bytes = 0, json_bytes = 0;
  for (int i = 0; i < repeats; ++i) {
    DashboardSnapshot snap;
    snap.now = absl::Now();
    snap.stats = stats;
    snap.map = *state.GetClusterMap();
    snap.expected_shards = shards;
    snap.window = history.Window(snap.now, stats);
    snap.history = history.Balancedness();
    absl::Time start = absl::Now();
    html_bytes = RenderDashboardHtml(snap, {}).size();
    html_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    start = absl::Now();
    json_bytes = RenderLoadJson(snap).size();
    json_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  return {{"html_median_ms", Median(html_ms)},
          {"html_bytes", html_bytes},
          {"json_median_ms", Median(json_ms)},
          {"json_bytes", json_bytes}};
}

std::string DefaultOutPath() {
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y%m%d", std::gmtime(&now));
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  return absl::StrCat(workspace != nullptr ? workspace : ".", "/bench/results/metrics_bench_", date,
                      ".json");
}

int Main() {
  const int layers = absl::GetFlag(FLAGS_layers), experts = absl::GetFlag(FLAGS_experts);
  const int shards = absl::GetFlag(FLAGS_shards), redundant = absl::GetFlag(FLAGS_redundant);
  const int64_t requests = absl::GetFlag(FLAGS_requests);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_scrapes));
  nlohmann::json out;
  out["shape"] = {
      {"layers", layers}, {"experts", experts}, {"shards", shards}, {"slots", experts + redundant}};
  out["shard_hooks_ns_per_request"] = {{"threads_1", HookNanos(1, requests, layers)},
                                       {"threads_2", HookNanos(2, requests / 2, layers)}};
  std::unique_ptr<ClusterState> state = LoadedState(layers, experts, shards, redundant);
  LoadHistory history({.window_samples = 10, .history_points = 300});
  history.Add(absl::Now() - absl::Seconds(1), state->GetLoadStats());
  out["coordinator_scrape"] = {ScrapeCost(*state, history, shards, false, repeats),
                               ScrapeCost(*state, history, shards, true, repeats)};
  out["dashboard_render"] = RenderCost(*state, history, shards, repeats);
  const std::string text = out.dump(2);
  std::printf("%s\n", text.c_str());
  const std::string path =
      absl::GetFlag(FLAGS_out_json).empty() ? DefaultOutPath() : absl::GetFlag(FLAGS_out_json);
  std::ofstream(path) << text << "\n";
  std::fprintf(stderr, "wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::bench::Main();
}
