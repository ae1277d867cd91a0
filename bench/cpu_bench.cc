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
#include <time.h>

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

// CPU time of the whole process (all threads), in ms: on a shared machine, wall time also counts
// the time other processes hold the cores.
double ProcessCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

struct Samples {
  std::vector<double> wall_ms;
  std::vector<double> cpu_ms;
};

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
}

json Summary(const Samples& s) {
  return json{{"median_ms", Quantile(s.wall_ms, 0.5)},
              {"min_ms", Quantile(s.wall_ms, 0)},
              {"max_ms", Quantile(s.wall_ms, 1)},
              {"p10_ms", Quantile(s.wall_ms, 0.1)},
              {"p90_ms", Quantile(s.wall_ms, 0.9)},
              {"cpu_median_ms", Quantile(s.cpu_ms, 0.5)},
              {"runs", s.wall_ms.size()}};
}

template <typename Fn>
void Sample(Samples& s, Fn fn) {
  const double cpu = ProcessCpuMs();
  const auto start = Clock::now();
  fn();
  s.wall_ms.push_back(Ms(Clock::now() - start));
  s.cpu_ms.push_back(ProcessCpuMs() - cpu);
}

template <typename Fn>
json Time(int runs, Fn fn) {
  Samples s;
  for (int i = 0; i < runs; ++i) Sample(s, [&] { fn(i); });
  return Summary(s);
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

// The DRAM read floor at this moment: all pool threads sum a slice of a 512 MB buffer, moving
// through it so that no read finds its data in the 32 MB L3.
class FloorProbe {
 public:
  explicit FloorProbe(cpu::ThreadPool& pool) : pool_(pool), buffer_(kFloats, 1.f) {}

  // Milliseconds to read `bytes` (rounded to whole vectors per thread).
  double ReadMs(double bytes) {
    const size_t floats = static_cast<size_t>(bytes / sizeof(float));
    if (next_ + floats > kFloats) next_ = 0;
    const float* base = buffer_.data() + next_;
    next_ += floats;
    std::vector<float> sums(pool_.num_threads());
    const auto start = Clock::now();
    pool_.ParallelFor(pool_.num_threads(), [&](int i, int n) {
      const cpu::Range r = cpu::EvenSplit(static_cast<int64_t>(floats / 32), i, n);
      sums[i] = SumFloats(base + r.begin * 32, (r.end - r.begin) * 32);
    });
    return Ms(Clock::now() - start);
  }

  // Median GB/s of five 256 MB reads.
  double BandwidthGBs() {
    std::vector<double> gbs;
    for (int i = 0; i < 5; ++i) gbs.push_back(256e6 / 1e6 / ReadMs(256e6));
    return Quantile(gbs, 0.5);
  }

 private:
  static constexpr size_t kFloats = size_t{128} << 20;
  cpu::ThreadPool& pool_;
  std::vector<float> buffer_;
  size_t next_ = 0;
};

// ---- Problem D ----------------------------------------------------------------------------------

constexpr int kExpertsD = 32;
constexpr int kTopK = 4;
constexpr int64_t kDim = 2880;

double ProblemDBytes(int experts) { return experts * (kDim * kDim / 2.0 + kDim * kDim / 32.0); }

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

// One token, four rotating experts: every round times the op and then a read of as many bytes
// from DRAM, so each op time has a floor measured next to it.
json ProblemDOneToken(MoeMatmul& op, const std::vector<WeightMatrix>& matrices, FloorProbe& floor,
                      std::mt19937_64& rng) {
  std::vector<float> x(kDim);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  const double bytes = ProblemDBytes(kTopK), flops = 2.0 * kTopK * kDim * kDim;
  json out = json::array();
  for (bool cold : {true, false}) {
    const int runs = absl::GetFlag(FLAGS_runs);
    std::vector<std::vector<int32_t>> ids;
    for (int i = 0; i <= runs; ++i) ids.push_back(ProblemDIds(1, cold ? i : 0, cold, rng));
    op.Run(x.data(), ids[0].data(), 1, kTopK);
    Samples s;
    std::vector<double> floor_ms, efficiency;
    for (int i = 0; i < runs; ++i) {
      Sample(s, [&] { op.Run(x.data(), ids[i + 1].data(), 1, kTopK); });
      floor_ms.push_back(floor.ReadMs(bytes));
      efficiency.push_back(floor_ms.back() / s.wall_ms.back());
    }
    json opt = Summary(s);
    const double ms = opt["median_ms"];
    opt["gflops"] = flops / ms / 1e6;
    opt["gbs"] = bytes / ms / 1e6;
    opt["floor_ms"] = Quantile(floor_ms, 0.5);
    opt["floor_over_time"] = Quantile(efficiency, 0.5);
    json point{{"tokens", 1}, {"weights", cold ? "cold" : "warm"}, {"optimized", opt}};
    if (cold) {
      json ref = Time(absl::GetFlag(FLAGS_ref_runs), [&](int i) {
        ReferenceMoeMatmul(matrices, x.data(), ids[i + 1].data(), 1, kTopK);
      });
      point["reference"] = ref;
      point["speedup_vs_reference"] = ref["median_ms"].get<double>() / ms;
      point["rel_error_vs_reference"] =
          op.CheckAgainstReference(matrices, x.data(), ids[1].data(), 1, kTopK);
    }
    Print(absl::StrCat("problem D, 1 token, ", cold ? "cold" : "warm"), point);
    out.push_back(point);
  }
  return out;
}

// 512 tokens, random distinct top-4 (all 32 experts active): int16 and int8 rounds alternate so
// that a busy stretch of the shared machine hits both alike.
json ProblemDManyTokens(MoeMatmul& op16, MoeMatmul& op8, const std::vector<WeightMatrix>& matrices,
                        std::mt19937_64& rng) {
  constexpr int64_t kTokens = 512;
  std::vector<float> x(kTokens * kDim);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  const std::vector<int32_t> ids = ProblemDIds(kTokens, 0, false, rng);
  const double flops = 2.0 * kTokens * kTopK * kDim * kDim;
  op16.Run(x.data(), ids.data(), kTokens, kTopK);
  op8.Run(x.data(), ids.data(), kTokens, kTopK);
  Samples s16, s8;
  for (int i = 0; i < absl::GetFlag(FLAGS_runs_large); ++i) {
    Sample(s16, [&] { op16.Run(x.data(), ids.data(), kTokens, kTopK); });
    Sample(s8, [&] { op8.Run(x.data(), ids.data(), kTokens, kTopK); });
  }
  json ref;
  if (absl::GetFlag(FLAGS_large_reference)) {
    ref = Time(1, [&](int) { ReferenceMoeMatmul(matrices, x.data(), ids.data(), kTokens, kTopK); });
    ref["gflops"] = flops / ref["median_ms"].get<double>() / 1e6;
  }
  json out = json::array();
  for (bool int8 : {false, true}) {
    MoeMatmul& op = int8 ? op8 : op16;
    json opt = Summary(int8 ? s8 : s16);
    opt["gflops"] = flops / opt["median_ms"].get<double>() / 1e6;
    opt["gflops_per_cpu_second"] = flops / opt["cpu_median_ms"].get<double>() / 1e6;
    json point{{"tokens", kTokens}, {"kernels", int8 ? "int8" : "int16"}, {"optimized", opt}};
    if (!ref.is_null()) {
      point["reference"] = ref;
      point["speedup_vs_reference"] =
          ref["median_ms"].get<double>() / opt["median_ms"].get<double>();
    }
    point["rel_error_vs_reference"] =
        op.CheckAgainstReference(matrices, x.data(), ids.data(), kTokens, kTopK);
    Print(absl::StrCat("problem D, 512 tokens, ", int8 ? "int8" : "int16"), point);
    out.push_back(point);
  }
  return out;
}

json ProblemD(cpu::ThreadPool& pool, const cpu::CpuKernels& kernels, FloorProbe& floor) {
  cpu::OwnedLayer owner;
  std::vector<WeightMatrix> matrices;
  for (int e = 0; e < kExpertsD; ++e) {
    matrices.push_back(cpu::RandomMatrix(WeightFormat::kMxfp4, kDim, kDim, 1000 + e, owner));
  }
  MoeMatmul op16(matrices, pool, kernels, false);
  MoeMatmul op8(matrices, pool, kernels, true);
  std::mt19937_64 rng(5);
  json out = ProblemDOneToken(op16, matrices, floor, rng);
  for (json& point : ProblemDManyTokens(op16, op8, matrices, rng)) out.push_back(point);
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

// The expert MLP through CpuBackend::Run: int16 and int8-w13 backends alternate round by round.
json ExpertMlp(const char* name, int experts, const std::vector<int64_t>& token_counts,
               bool with_reference, CpuBackendOptions options) {
  auto owned = cpu::MakeRandomLayer(GptOssSpec(experts));
  const ExpertLayer& layer = owned->layer;
  const std::vector<std::string> modes = {"int16", "int8-w13"};
  std::vector<std::unique_ptr<ExpertBackend>> backends;
  for (const std::string& mode : modes) {
    options.activations = mode;
    auto backend = MakeCpuBackend(options);
    if (!backend.ok() || !(*backend)->PrepareLayer(0, layer).ok()) return json{{"error", "setup"}};
    backends.push_back(*std::move(backend));
  }
  const double expert_bytes = 3 * ProblemDBytes(1);
  json out = json::array();
  for (int64_t tokens : token_counts) {
    cpu::RandomRequestSpec spec;
    spec.tokens = tokens;
    spec.top_k = kTopK;
    spec.not_local = 0;
    spec.seed = 9 + tokens;
    cpu::OwnedRequest request = cpu::MakeRandomRequest(layer, spec);
    // One token has one route per expert: the int16 streaming path in either mode.
    const size_t used_modes = tokens == 1 ? 1 : modes.size();
    std::vector<Samples> samples(used_modes);
    for (size_t m = 0; m < used_modes; ++m) (void)backends[m]->Run(0, layer, request.Request());
    const int runs = tokens == 1 ? absl::GetFlag(FLAGS_runs) : absl::GetFlag(FLAGS_runs_large);
    for (int i = 0; i < runs; ++i) {
      RotateRoutes(request, i + 1, experts);
      for (size_t m = 0; m < used_modes; ++m) {
        Sample(samples[m], [&] { (void)backends[m]->Run(0, layer, request.Request()); });
      }
    }
    std::vector<bool> active(experts, false);
    for (int32_t id : request.ids) active[id] = true;
    const double active_bytes = expert_bytes * std::count(active.begin(), active.end(), true);
    const double flops = 2.0 * tokens * kTopK * 3 * kDim * kDim;
    cpu::OwnedRequest want = request;
    json ref;
    if (with_reference) {
      const bool timed = tokens == 1 || absl::GetFlag(FLAGS_large_reference);
      const int ref_runs = tokens == 1 ? absl::GetFlag(FLAGS_ref_runs) : 1;
      json r = Time(timed ? ref_runs : 1,
                    [&](int) { (void)RunExpertsReference(layer, want.Request()); });
      if (timed) ref = r;
    }
    for (size_t m = 0; m < used_modes; ++m) {
      json opt = Summary(samples[m]);
      const double ms = opt["median_ms"];
      opt["gflops"] = flops / ms / 1e6;
      opt["gflops_per_cpu_second"] = flops / opt["cpu_median_ms"].get<double>() / 1e6;
      opt["gbs_active_experts"] = active_bytes / ms / 1e6;
      json point{
          {"shape", name}, {"tokens", tokens}, {"activations", modes[m]}, {"optimized", opt}};
      if (!ref.is_null()) {
        point["reference"] = ref;
        point["speedup_vs_reference"] = ref["median_ms"].get<double>() / ms;
      }
      if (with_reference) {
        request.Poison();
        (void)backends[m]->Run(0, layer, request.Request());
        point["rel_error_vs_reference"] = RelativeError(request, want);
      }
      Print(absl::StrCat("expert MLP ", name, ", ", tokens, " token(s), ", modes[m]), point);
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
              {"machine",
               {{"cpu", CpuModel()},
                {"features", cpu::FeatureString(features)},
                {"isa", std::string(cpu::CpuIsaName(*isa))},
                {"threads", threads},
                {"load_average", ShellLine("cut -d' ' -f1-3 /proc/loadavg")}}},
              {"definitions", std::string(kDefinitions)}};
  const std::vector<std::string> sections = absl::StrSplit(absl::GetFlag(FLAGS_sections), ',');
  const auto wanted = [&](absl::string_view s) {
    return std::find(sections.begin(), sections.end(), s) != sections.end();
  };
  FloorProbe floor(pool);
  const double bandwidth = floor.BandwidthGBs();
  result["read_bandwidth_gbs_at_start"] = bandwidth;
  std::printf("read bandwidth, %d threads: %.1f GB/s\n", threads, bandwidth);
  if (wanted("problem_d")) result["problem_d"] = ProblemD(pool, kernels, floor);
  const CpuBackendOptions options{threads, absl::GetFlag(FLAGS_isa)};
  if (wanted("gpt_oss_20b")) {
    result["expert_mlp_gpt_oss_20b"] = ExpertMlp("gpt-oss-20b", 32, {1, 512}, true, options);
  }
  if (wanted("gpt_oss_120b")) {
    result["expert_mlp_gpt_oss_120b"] =
        ExpertMlp("gpt-oss-120b", 128, {1, 8, 64, 512}, false, options);
  }
  result["read_bandwidth_gbs_at_end"] = floor.BandwidthGBs();
  result["load_average_at_end"] = ShellLine("cut -d' ' -f1-3 /proc/loadavg");
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
