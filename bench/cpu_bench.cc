// CPU benchmark of the optimized backend (`--backend cpu`) against the CPU reference, in one run.
//
// Reference problem D of shared/spec/performance.md: one MXFP4 expert matrix product as a MoE op
// (ggml's MUL_MAT_ID shape: E = 32 experts, top-4, a 2880 x 2880 weight per expert, fp32
// activations, output [tokens, 4, 2880] without combine). The timed region is what that op does:
// group the routes by expert, quantize the activations (ggml quantizes to q8_0, this backend to
// int16 per block) and run every route's product. Bytes are the active experts' packed MXFP4
// values and UE8M0 scales (4.41 MB per expert); FLOPs are 2 * tokens * 4 * 2880 * 2880.
// Two weight-residency modes: `cold` rotates the experts so that no iteration finds its weights
// in the 32 MB L3 (the DRAM floor applies), `warm` reuses the same routes every iteration as an op
// benchmark does (at 1 token the 17.6 MB then sits in L3).
//
// Also: the full expert MLP (w13 -> SWIGLUOAI -> w2 -> weighted combine) through CpuBackend::Run
// and RunExpertsReference on the gpt-oss-20b shape, and the gpt-oss-120b expert shape (E = 128,
// problem A of performance.md scaled down to this machine) on the optimized backend; the read
// bandwidth floor is measured in the same run. JSON goes to bench/results/cpu_bench_<date>.json.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/cpu_moe_op.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/random_layer.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/experts.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, threads, 0, "threads (0: all hardware threads)");
ABSL_FLAG(std::string, isa, "auto", "auto | avx2 | avx512 | avx512vnni");
ABSL_FLAG(int, runs, 31, "timed runs of each 1-token point");
ABSL_FLAG(int, runs_large, 7, "timed runs of each many-token point");
ABSL_FLAG(int, ref_runs, 3, "timed runs of the reference at 1 token (1 at many tokens)");
ABSL_FLAG(bool, large_reference, true, "also time the reference at 512 tokens (slow)");
ABSL_FLAG(std::string, sections, "problem_d,gpt_oss_20b,gpt_oss_120b",
          "what to time: problem_d, gpt_oss_20b (expert MLP, E=32), gpt_oss_120b (expert MLP, "
          "E=128, about 4 GB of weights)");
ABSL_FLAG(std::string, out_json, "", "results file (default bench/results/cpu_bench_<date>.json)");
ABSL_FLAG(std::string, commit, "", "commit the binary was built from (default: git rev-parse)");

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

json Summary(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const auto at = [&](double q) { return ms[static_cast<size_t>(q * (ms.size() - 1) + 0.5)]; };
  return json{{"median_ms", at(0.5)}, {"min_ms", ms.front()}, {"max_ms", ms.back()},
              {"p10_ms", at(0.1)},   {"p90_ms", at(0.9)},   {"runs", ms.size()}};
}

template <typename Fn>
json Time(int runs, Fn fn) {
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    fn(i);
    ms.push_back(Ms(Clock::now() - start));
  }
  return Summary(std::move(ms));
}

std::string ShellLine(const char* command) {
  std::string out;
  if (FILE* f = popen(command, "r")) {
    char buf[256];
    while (fgets(buf, sizeof(buf), f) != nullptr) out += buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

void Print(const std::string& what, const json& j) {
  std::printf("%-58s %s\n", what.c_str(), j.dump().c_str());
  std::fflush(stdout);
}

// Every thread sums its part of a 1 GiB buffer: the DRAM read bandwidth of this many threads.
double ReadBandwidthGBs(cpu::ThreadPool& pool) {
  const size_t floats = size_t{1} << 28;
  std::vector<float> buffer(floats, 1.f);
  std::vector<double> gbs;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> sums(pool.num_threads());
    const auto start = Clock::now();
    pool.ParallelFor(pool.num_threads(), [&](int i, int n) {
      sums[i] = SumFloats(buffer.data() + floats * i / n, floats / n);
    });
    gbs.push_back(floats * sizeof(float) / 1e6 / Ms(Clock::now() - start));
  }
  std::sort(gbs.begin(), gbs.end());
  return gbs[gbs.size() / 2];
}

// ---- Problem D ----------------------------------------------------------------------------------

constexpr int kExpertsD = 32;
constexpr int kTopK = 4;
constexpr int64_t kDim = 2880;

double ProblemDBytes(int experts) {
  return experts * (kDim * kDim / 2.0 + kDim * kDim / 32.0);
}

// Routes of `tokens` tokens: rotating (cold, distinct expert groups per iteration) or random.
std::vector<int32_t> ProblemDIds(int64_t tokens, int iteration, bool cold, std::mt19937_64& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> slots(kExpertsD);
  for (int64_t t = 0; t < tokens; ++t) {
    if (tokens == 1 && cold) {
      for (int k = 0; k < kTopK; ++k) ids.push_back((iteration * kTopK + k) % kExpertsD);
      continue;
    }
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    ids.insert(ids.end(), slots.begin(), slots.begin() + kTopK);
  }
  return ids;
}

json ProblemD(cpu::ThreadPool& pool, const cpu::CpuKernels& kernels, double bandwidth) {
  cpu::OwnedLayer owner;
  std::vector<WeightMatrix> matrices;
  for (int e = 0; e < kExpertsD; ++e) {
    matrices.push_back(cpu::RandomMatrix(WeightFormat::kMxfp4, kDim, kDim, 1000 + e, owner));
  }
  MoeMatmul op16(matrices, pool, kernels, false);
  MoeMatmul op8(matrices, pool, kernels, true);
  json out = json::array();
  std::mt19937_64 rng(5);
  for (int64_t tokens : {int64_t{1}, int64_t{512}}) {
    std::vector<float> x(tokens * kDim);
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(rng);
    const double flops = 2.0 * tokens * kTopK * kDim * kDim;
    for (bool cold : {true, false}) {
     for (bool int8 : {false, true}) {
      if (tokens == 1 && int8) continue;  // one route per expert: the int16 streaming path
      MoeMatmul& op = int8 ? op8 : op16;
      const int runs = tokens == 1 ? absl::GetFlag(FLAGS_runs) : absl::GetFlag(FLAGS_runs_large);
      std::vector<std::vector<int32_t>> ids;
      for (int i = 0; i < runs + 1; ++i) ids.push_back(ProblemDIds(tokens, cold ? i : 0, cold, rng));
      op.Run(x.data(), ids[0].data(), tokens, kTopK);  // warm-up (and workspace growth)
      json opt = Time(runs, [&](int i) { op.Run(x.data(), ids[i + 1].data(), tokens, kTopK); });
      const double active = tokens == 1 ? kTopK : kExpertsD;
      const double ms = opt["median_ms"];
      opt["gflops"] = flops / ms / 1e6;
      opt["gbs"] = ProblemDBytes(active) / ms / 1e6;
      opt["floor_ms"] = ProblemDBytes(active) / bandwidth / 1e6;
      json point{{"tokens", tokens},
                 {"weights", cold ? "cold" : "warm"},
                 {"kernels", int8 ? "int8" : "int16"},
                 {"optimized", opt}};
      if (cold) {
        const int ref_runs = tokens == 1 ? absl::GetFlag(FLAGS_ref_runs) : 1;
        if (!int8 && (tokens == 1 || absl::GetFlag(FLAGS_large_reference))) {
          json ref = Time(ref_runs, [&](int i) {
            ReferenceMoeMatmul(matrices, x.data(), ids[i + 1].data(), tokens, kTopK);
          });
          ref["gflops"] = flops / ref["median_ms"].get<double>() / 1e6;
          point["reference"] = ref;
          point["speedup_vs_reference"] = ref["median_ms"].get<double>() / ms;
        }
        point["max_rel_error_vs_reference"] =
            op.CheckAgainstReference(matrices, x.data(), ids[1].data(), tokens, kTopK);
      }
      Print(absl::StrCat("problem D, ", tokens, " token(s), ", cold ? "cold" : "warm",
                         int8 ? ", int8" : ", int16"),
            point);
      out.push_back(point);
     }
    }
  }
  return out;
}

// ---- Full expert MLP ----------------------------------------------------------------------------

cpu::RandomLayerSpec GptOssSpec(int experts) {
  cpu::RandomLayerSpec spec;
  spec.format = WeightFormat::kMxfp4;
  spec.layout = GateUpLayout::kInterleaved;
  spec.activation.kind = ActivationKind::kSwigluOai;
  spec.hidden = kDim;
  spec.inter = kDim;
  spec.experts = experts;
  spec.bias = true;
  spec.seed = 77;
  return spec;
}

// Rotates a one-token request's experts like problem D's cold mode.
void RotateRoutes(cpu::OwnedRequest& r, int iteration, int experts) {
  if (r.tokens != 1) return;
  for (int k = 0; k < r.top_k; ++k) r.ids[k] = (iteration * kTopK + k) % experts;
}

double RelativeError(const cpu::OwnedRequest& got, const cpu::OwnedRequest& want) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < want.out_f32.size(); ++i) {
    d2 += (got.out_f32[i] - want.out_f32[i]) * double(got.out_f32[i] - want.out_f32[i]);
    r2 += want.out_f32[i] * double(want.out_f32[i]);
  }
  return std::sqrt(d2 / r2);
}

json ExpertMlp(const char* name, int experts, const std::vector<int64_t>& token_counts,
               bool with_reference, CpuBackendOptions options) {
  auto owned = cpu::MakeRandomLayer(GptOssSpec(experts));
  const ExpertLayer& layer = owned->layer;
  const double expert_bytes = 3 * ProblemDBytes(1);
  json out = json::array();
  for (const char* activations : {"int16", "int8-w13"}) {
  options.activations = activations;
  auto backend = MakeCpuBackend(options);
  if (!backend.ok() || !(*backend)->PrepareLayer(0, layer).ok()) return json{{"error", "setup"}};
  for (int64_t tokens : token_counts) {
    if (tokens == 1 && options.activations != "int16") continue;  // the streaming path either way
    cpu::RandomRequestSpec spec;
    spec.tokens = tokens;
    spec.top_k = kTopK;
    spec.not_local = 0;
    spec.seed = 9 + tokens;
    cpu::OwnedRequest request = cpu::MakeRandomRequest(layer, spec);
    const int runs = tokens == 1 ? absl::GetFlag(FLAGS_runs) : absl::GetFlag(FLAGS_runs_large);
    (void)(*backend)->Run(0, layer, request.Request());
    json opt = Time(runs, [&](int i) {
      RotateRoutes(request, i + 1, experts);
      (void)(*backend)->Run(0, layer, request.Request());
    });
    std::vector<bool> active(experts, false);
    for (int32_t id : request.ids) active[id] = true;
    const double active_bytes = expert_bytes * std::count(active.begin(), active.end(), true);
    const double ms = opt["median_ms"];
    opt["gflops"] = 2.0 * tokens * kTopK * 3 * kDim * kDim / ms / 1e6;
    opt["gbs_active_experts"] = active_bytes / ms / 1e6;
    json point{{"shape", name},
               {"tokens", tokens},
               {"activations", options.activations},
               {"optimized", opt}};
    if (with_reference) {
      cpu::OwnedRequest want = request;
      const bool time_reference =
          options.activations == "int16" && (tokens == 1 || absl::GetFlag(FLAGS_large_reference));
      json ref = Time(time_reference ? (tokens == 1 ? absl::GetFlag(FLAGS_ref_runs) : 1) : 1,
                      [&](int) { (void)RunExpertsReference(layer, want.Request()); });
      if (time_reference) {
        point["reference"] = ref;
        point["speedup_vs_reference"] = ref["median_ms"].get<double>() / ms;
      }
      request.Poison();
      (void)(*backend)->Run(0, layer, request.Request());
      point["rel_error_vs_reference"] = RelativeError(request, want);
    }
    Print(absl::StrCat("expert MLP ", name, ", ", tokens, " token(s), ", options.activations),
          point);
    out.push_back(point);
  }
  }
  return out;
}

int Main() {
  const cpu::CpuFeatures features = cpu::DetectCpuFeatures();
  absl::StatusOr<cpu::CpuIsa> isa = cpu::ChooseIsa(absl::GetFlag(FLAGS_isa), features);
  if (!isa.ok()) {
    std::fprintf(stderr, "%s\n", isa.status().ToString().c_str());
    return 1;
  }
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  cpu::ThreadPool pool(threads);
  const cpu::CpuKernels kernels = cpu::KernelsFor(*isa);
  std::string commit = absl::GetFlag(FLAGS_commit);
  if (commit.empty()) commit = ShellLine("git rev-parse --short HEAD 2>/dev/null");
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y%m%d", std::localtime(&now));

  json result{{"benchmark", "cpu_bench"},
              {"date", date},
              {"commit", commit},
              {"machine", {{"cpu", CpuModel()},
                           {"features", cpu::FeatureString(features)},
                           {"isa", std::string(cpu::CpuIsaName(*isa))},
                           {"threads", threads},
                           {"load_average", ShellLine("cut -d' ' -f1-3 /proc/loadavg")}}},
              {"definitions", std::string(kDefinitions)}};
  const std::vector<std::string> sections = absl::StrSplit(absl::GetFlag(FLAGS_sections), ',');
  const auto wanted = [&](absl::string_view s) {
    return std::find(sections.begin(), sections.end(), s) != sections.end();
  };
  const double bandwidth = ReadBandwidthGBs(pool);
  result["read_bandwidth_gbs"] = bandwidth;
  std::printf("read bandwidth, %d threads: %.1f GB/s\n", threads, bandwidth);
  if (wanted("problem_d")) result["problem_d"] = ProblemD(pool, kernels, bandwidth);
  const CpuBackendOptions options{threads, absl::GetFlag(FLAGS_isa)};
  if (wanted("gpt_oss_20b")) {
    result["expert_mlp_gpt_oss_20b"] = ExpertMlp("gpt-oss-20b", 32, {1, 512}, true, options);
  }
  if (wanted("gpt_oss_120b")) {
    result["expert_mlp_gpt_oss_120b"] =
        ExpertMlp("gpt-oss-120b", 128, {1, 8, 64, 512}, false, options);
  }
  std::string path = absl::GetFlag(FLAGS_out_json);
  if (path.empty()) path = absl::StrCat("bench/results/cpu_bench_", date, ".json");
  std::ofstream(path) << result.dump(2) << "\n";
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::bench::Main();
}
