// Benchmark of the fused GPU staging kernel (kernels/cuda/staging_runner.h): BF16 hidden states
// -> MXFP8 or NVFP4 per token, with EPLB remap (E=256 logical experts on 288 slots, top-8) and
// load recording in the same launch. performance.md targets: at 4096 x 7168 >= 80% of the
// device-to-device copy bandwidth (bytes read + written), and <= 8 us at 1-64 tokens.
//
// Throughput: a CUDA graph of one launch per input set (4 sets of 58.7 MB, so L2 (60 MB) cannot
// hold the input), per-launch time = replay / 4, median of 50 replays. Latency: a graph of one
// launch, replay timed with events, median of 200 (what a serving step pays for the launch
// inside its own graph is less: the graph launch overhead is shared), plus back-to-back per-launch
// time from a graph of 32 launches. Writes JSON. --formats, --reps and --small narrow a run (for
// profiling one kernel under ncu); --hidden changes the width from 7168 (the sizes above are at
// 7168); --nvfp4_variants=default,registers,r56 adds rounds that alternate NVFP4 kernel variants.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu_bench_util.h"
#include "kernels/cuda/expert_runner.h"
#include "kernels/cuda/staging_runner.h"
#include "kernels/eplb.h"
#include "kernels/formats.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, out_json, "", "where to write the JSON results");
ABSL_FLAG(std::string, commit, "unknown", "commit the binary was built from");
ABSL_FLAG(std::vector<std::string>, formats, std::vector<std::string>({"mxfp8", "nvfp4"}),
          "formats to time");
ABSL_FLAG(int, reps, 50, "graph replays timed at 4096 tokens");
ABSL_FLAG(bool, small, true, "also time 1, 8 and 64 tokens");
ABSL_FLAG(int64_t, hidden, 7168,
          "hidden size, a multiple of 128 (the target is stated at 7168; below 1832 the four "
          "4096-token input sets fit in the 60 MB L2 together)");
ABSL_FLAG(bool, sweep, false, "also time MXFP8 blocks of 256, 512 and 1024 threads at 4096 tokens");
ABSL_FLAG(
    std::vector<std::string>, nvfp4_variants, {},
    "also time NVFP4 at 4096 tokens with these kernel variants, alternating in --rounds "
    "rounds: default (rows through shared memory); registers (StagingParams::"
    "nvfp4_shared_rows off); r56, r64, r72 (the same with nvfp4_one_tile_registers); "
    "shared4, shared7, shared14 (nvfp4_shared_lane_chunks); pipeline (shared rows, "
    "nvfp4_shared_pipeline: one wave of blocks looping over rows). Only rows of exactly one tile "
    "use them (H = 7168, 4096, 2048, ...)");
ABSL_FLAG(int, rounds, 3, "rounds of the --nvfp4_variants comparison");

namespace moe::bench {
namespace {

using cuda::DeviceBuffer;
using cuda::StagingFormat;
using cuda::StagingParams;

constexpr int kExperts = 256;
constexpr int kSlots = 288;
constexpr int kTopK = 8;
// --hidden (7168 unless set: the DeepSeek-V3 width of the performance target).
int64_t g_hidden = 7168;

// One input set with its outputs.
struct StagingSet {
  DeviceBuffer x, q, scales, token_scale, ids, phys;
  StagingParams params;
};

std::unique_ptr<StagingSet> MakeSet(StagingFormat format, int64_t tokens,
                                    const cuda::DevicePlacement& placement, DeviceBuffer& load,
                                    DeviceBuffer& hosted, std::mt19937_64& rng) {
  auto s = std::make_unique<StagingSet>();
  std::vector<uint16_t> x(tokens * g_hidden);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (uint16_t& v : x) v = FloatToBf16(normal(rng));
  std::vector<int32_t> ids(tokens * kTopK);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % kExperts);
  const bool mx = format == StagingFormat::kMxfp8;
  BENCH_CHECK_OK(s->x.Reserve(x.size() * 2));
  BENCH_CHECK_OK(s->q.Reserve(mx ? x.size() : x.size() / 2));
  BENCH_CHECK_OK(s->scales.Reserve(x.size() / (mx ? 128 : 64) * 4));
  BENCH_CHECK_OK(s->token_scale.Reserve(tokens * 4));
  BENCH_CHECK_OK(s->ids.Reserve(ids.size() * 4));
  BENCH_CHECK_OK(s->phys.Reserve(ids.size() * 4));
  CUDA_CHECK_OK(cudaMemcpy(s->x.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK_OK(cudaMemcpy(s->ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  StagingParams& p = s->params;
  p.format = format;
  p.x = s->x.as<const uint16_t>();
  p.tokens = static_cast<int32_t>(tokens);
  p.hidden_size = static_cast<int32_t>(g_hidden);
  p.q = s->q.as<uint8_t>();
  p.scales = s->scales.as<int32_t>();
  p.token_scale = s->token_scale.as<float>();
  p.topk_ids = s->ids.as<const int32_t>();
  p.top_k = kTopK;
  placement.Fill(p);
  p.physical_ids = s->phys.as<int32_t>();
  p.load = load.as<unsigned long long>();
  p.hosted = hosted.as<const uint8_t>();
  p.load_size = kSlots;
  p.num_unpadded = static_cast<int32_t>(tokens);
  return s;
}

// Median microseconds per launch: a graph of `copies` passes over `sets`, replayed `reps` times.
double TimeLaunches(const std::vector<std::unique_ptr<StagingSet>>& sets, int copies, int reps,
                    cudaStream_t stream) {
  const std::vector<double> us = TimeGraphReplays(
      stream,
      [&](cudaStream_t s) {
        for (int c = 0; c < copies; ++c) {
          for (const auto& set : sets) BENCH_CHECK_OK(cuda::EnqueueStaging(set->params, s));
        }
      },
      reps, static_cast<double>(copies) * sets.size());
  return Summarize(us).median;
}

// Sets the NVFP4 kernel variant `name` of --nvfp4_variants in *p (when not null); false for an
// unknown name.
bool SetNvfp4Variant(const std::string& name, StagingParams* p) {
  int registers = 0;
  bool shared = true;
  int lane_chunks = 0;
  bool pipeline = false;
  if (name == "pipeline") {
    pipeline = true;
  } else if (name == "registers") {
    shared = false;
  } else if (name == "r56" || name == "r64" || name == "r72") {
    shared = false;
    registers = std::stoi(name.substr(1));
  } else if (name == "shared4" || name == "shared7" || name == "shared14") {
    lane_chunks = std::stoi(name.substr(6));
  } else if (name != "default") {
    return false;
  }
  if (p != nullptr) {
    p->nvfp4_one_tile_registers = registers;
    p->nvfp4_shared_rows = shared;
    p->nvfp4_shared_lane_chunks = lane_chunks;
    p->nvfp4_shared_pipeline = pipeline;
  }
  return true;
}

// Bytes one launch reads and writes (load atomics not counted: 288 counters).
double LaunchBytes(StagingFormat format, int64_t tokens) {
  const double elements = static_cast<double>(tokens) * g_hidden;
  const double routes = static_cast<double>(tokens) * kTopK;
  const double written = format == StagingFormat::kMxfp8
                             ? elements + elements / 32
                             : elements / 2 + elements / 16 + 4.0 * tokens;
  return 2 * elements + written + 4 * routes /* ids */ + 4 * routes /* physical ids */;
}

int Main() {
  g_hidden = absl::GetFlag(FLAGS_hidden);
  if (g_hidden <= 0 || g_hidden % 128 != 0) {
    std::fprintf(stderr, "--hidden must be a positive multiple of 128\n");
    return 2;
  }
  cudaStream_t stream;
  CUDA_CHECK_OK(cudaSetDevice(0));
  CUDA_CHECK_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CUDA_CHECK_OK(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = CopyBandwidth(stream);
  std::printf("device: %s; copy bandwidth %.3f TB/s (read + write)\n", prop.name, copy_bw / 1e12);

  std::mt19937_64 rng(11);
  std::vector<int32_t> p2l(kSlots);
  for (int s = 0; s < kSlots; ++s) {
    p2l[s] = s < kExperts ? s : static_cast<int32_t>(rng() % kExperts);
  }
  absl::StatusOr<LayerPlacement> placement = LayerPlacement::Create(p2l, kExperts);
  BENCH_CHECK_OK(placement.status());
  absl::StatusOr<std::unique_ptr<cuda::DevicePlacement>> dp = cuda::UploadPlacement(*placement);
  BENCH_CHECK_OK(dp.status());
  DeviceBuffer load, hosted;
  BENCH_CHECK_OK(load.Reserve(kSlots * 8));
  BENCH_CHECK_OK(hosted.Reserve(kSlots));
  CUDA_CHECK_OK(cudaMemset(load.get(), 0, kSlots * 8));
  CUDA_CHECK_OK(cudaMemset(hosted.get(), 1, kSlots));

  const std::vector<std::string> formats = absl::GetFlag(FLAGS_formats);
  nlohmann::json points = nlohmann::json::array();
  for (StagingFormat format : {StagingFormat::kMxfp8, StagingFormat::kNvfp4}) {
    const char* name = format == StagingFormat::kMxfp8 ? "mxfp8" : "nvfp4";
    if (std::find(formats.begin(), formats.end(), name) == formats.end()) continue;
    std::vector<std::unique_ptr<StagingSet>> big;
    for (int i = 0; i < 4; ++i) big.push_back(MakeSet(format, 4096, **dp, load, hosted, rng));
    // The same launches without programmatic dependent launch (each waits for the previous
    // kernel to finish before it is scheduled), timed first.
    for (auto& set : big) set->params.programmatic = false;
    const double plain_us = TimeLaunches(big, 1, absl::GetFlag(FLAGS_reps), stream);
    for (auto& set : big) set->params.programmatic = true;
    const double us = TimeLaunches(big, 1, absl::GetFlag(FLAGS_reps), stream);
    const double bytes = LaunchBytes(format, 4096);
    nlohmann::json block_sweep = nlohmann::json::object();
    if (format == StagingFormat::kMxfp8 && absl::GetFlag(FLAGS_sweep)) {
      // programmatic: allowed (the launcher never uses it for 1024-thread blocks) or not.
      for (bool programmatic : {true, false}) {
        for (int threads : {256, 512, 1024}) {
          if (programmatic && threads == 1024) continue;
          for (auto& set : big) {
            set->params.mxfp8_block_threads = threads;
            set->params.programmatic = programmatic;
          }
          const double t = TimeLaunches(big, 1, absl::GetFlag(FLAGS_reps), stream);
          std::printf(
              "mxfp8 4096 x %lld, %d-thread blocks, programmatic %d: %8.2f us, %.1f%% of "
              "copy bandwidth\n",
              static_cast<long long>(g_hidden), threads, programmatic ? 1 : 0, t,
              100 * bytes / (t * 1e-6) / copy_bw);
          block_sweep[absl::StrCat(threads, programmatic ? "_pdl" : "_plain")] = t;
        }
      }
      for (auto& set : big) {
        set->params.mxfp8_block_threads = 0;
        set->params.programmatic = true;
      }
    }
    nlohmann::json variant_rounds = nlohmann::json::object();
    if (format == StagingFormat::kNvfp4) {
      const std::vector<std::string> variants = absl::GetFlag(FLAGS_nvfp4_variants);
      for (const std::string& v : variants) {
        if (!SetNvfp4Variant(v, nullptr)) {
          std::fprintf(stderr,
                       "--nvfp4_variants: %s is not default, registers, r56, r64, r72, "
                       "shared4, shared7, shared14 or pipeline\n",
                       v.c_str());
          return 2;
        }
      }
      // Rounds alternate the variants so that clock drift (the power cap) spreads over all.
      for (int round = 0; round < absl::GetFlag(FLAGS_rounds) && !variants.empty(); ++round) {
        for (const std::string& v : variants) {
          for (auto& set : big) SetNvfp4Variant(v, &set->params);
          const double t = TimeLaunches(big, 1, absl::GetFlag(FLAGS_reps), stream);
          std::printf(
              "nvfp4 4096 x %lld, variant %s, round %d: %8.2f us, %.1f%% of copy bandwidth\n",
              static_cast<long long>(g_hidden), v.c_str(), round + 1, t,
              100 * bytes / (t * 1e-6) / copy_bw);
          variant_rounds[v].push_back(t);
        }
      }
      for (auto& set : big) SetNvfp4Variant("default", &set->params);
    }
    const double rate = bytes / (us * 1e-6);
    std::printf(
        "%s 4096 x %lld + remap + load: %8.2f us, %.1f MB, %.3f TB/s = %.1f%% of copy "
        "bandwidth (target >= 80%%) %s\n",
        name, static_cast<long long>(g_hidden), us, bytes / 1e6, rate / 1e12, 100 * rate / copy_bw,
        rate >= 0.8 * copy_bw ? "MET" : "missed");
    std::printf("%s 4096 x %lld without programmatic launch: %8.2f us, %.1f%% of copy bandwidth\n",
                name, static_cast<long long>(g_hidden), plain_us,
                100 * bytes / (plain_us * 1e-6) / copy_bw);
    points.push_back({{"format", name},
                      {"tokens", 4096},
                      {"hidden", g_hidden},
                      {"median_us_per_launch", us},
                      {"median_us_per_launch_no_pdl", plain_us},
                      {"mxfp8_block_threads_sweep_us", block_sweep},
                      {"nvfp4_variant_rounds_us", variant_rounds},
                      {"bytes", bytes},
                      {"TBps", rate / 1e12},
                      {"fraction_of_copy_bw", rate / copy_bw},
                      {"target_fraction", 0.8}});
    big.clear();
    if (!absl::GetFlag(FLAGS_small)) continue;
    for (int64_t tokens : {1, 8, 64}) {
      std::vector<std::unique_ptr<StagingSet>> one;
      one.push_back(MakeSet(format, tokens, **dp, load, hosted, rng));
      const double single = TimeLaunches(one, 1, 200, stream);
      const double chained = TimeLaunches(one, 32, 50, stream);
      std::printf(
          "%s T=%2lld: graph of one launch %.2f us (target <= 8 us) %s; back-to-back "
          "%.2f us per launch\n",
          name, static_cast<long long>(tokens), single, single <= 8 ? "MET" : "missed", chained);
      if (format == StagingFormat::kMxfp8 && absl::GetFlag(FLAGS_sweep)) {
        for (int threads : {256, 1024}) {
          one[0]->params.mxfp8_block_threads = threads;
          std::printf(
              "mxfp8 T=%2lld, %d-thread blocks: graph of one launch %.2f us; back-to-back "
              "%.2f us per launch\n",
              static_cast<long long>(tokens), threads, TimeLaunches(one, 1, 200, stream),
              TimeLaunches(one, 32, 50, stream));
        }
        one[0]->params.mxfp8_block_threads = 0;
      }
      points.push_back({{"format", name},
                        {"tokens", tokens},
                        {"hidden", g_hidden},
                        {"graph_of_one_launch_median_us", single},
                        {"back_to_back_us_per_launch", chained},
                        {"target_us", 8}});
    }
  }
  nlohmann::json out = {
      {"benchmark", "staging_bench: fused GPU staging (quantize + EPLB remap + load recording)"},
      {"device", prop.name},
      {"commit", absl::GetFlag(FLAGS_commit)},
      {"date_unix", static_cast<int64_t>(std::time(nullptr))},
      {"copy_bandwidth_TBps", copy_bw / 1e12},
      {"placement", {{"logical", kExperts}, {"slots", kSlots}, {"top_k", kTopK}}},
      {"points", points}};
  WriteJson(absl::GetFlag(FLAGS_out_json), out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::bench::Main();
}
