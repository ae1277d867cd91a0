// Kernel benchmark of the CUDA expert path on reference problem A (gpt-oss-120b MoE layer:
// E=128, top-4, H=I=2880, MXFP4, BF16 activations, SWIGLUOAI with biases, interleaved gate/up,
// uniform routes), or with --problem=B / C on the DeepSeek-V3- and Qwen3-30B-A3B-shaped layers
// (bench_problem.h). Per token count it times CUDA-graph replays of the device pipeline (prologue:
// grouping + staging, GEMM1 + activation, GEMM2, combine; inputs already on the device), rotating
// over several routing sets so consecutive passes read different experts and L2 (60 MB) cannot
// hold the weights (1.7 GB in all), and reports the median against the memory floor (active
// experts x bytes per expert / copy bandwidth) and the performance.md target. Also measured:
// device-to-device copy bandwidth (the ceiling, same run), the same graphs with the H2D/D2H
// copies from pinned memory, a per-stage split, and the relative error against the CPU
// reference at one small size. Writes JSON (machine, commit, shapes, median and spread).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_problem.h"
#include "bench/gpu_bench_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/cuda/expert_runner.h"
#include "kernels/experts.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, problem, "A", "reference problem: A, B or C (performance.md)");
ABSL_FLAG(std::string, tokens, "1,8,64,512,4096,8192", "token counts to time");
ABSL_FLAG(int, reps, 0, "timed graph replays per point (0: by size)");
ABSL_FLAG(std::string, out_json, "", "where to write the JSON results");
ABSL_FLAG(std::string, commit, "unknown", "commit the binary was built from");
ABSL_FLAG(int, check_tokens, 8, "token count checked against the CPU reference (0: none)");
ABSL_FLAG(int, variant, -1,
          "GEMM variant of the main measurement (-1: the runner's per-batch choice)");
ABSL_FLAG(int, wgmma_persistent, -1,
          "persistent wgmma CTAs for the main measurement (ExpertRunner::set_wgmma_persistent: "
          "-1 the runner's default, 1 on, 0 off)");
ABSL_FLAG(int, even_items, -1,
          "even item cut for the main measurement (ExpertRunner::set_even_items: -1 the "
          "runner's default, 1 every wgmma batch, 0 none)");
ABSL_FLAG(std::string, extras, "",
          "comma-separated names of the extra configurations to time (empty: all), the wgmma "
          "points' ones included (mma_sync_no_wgmma, wgmma_variant1, wgmma_variant2, "
          "wgmma_hidden_staged, wgmma_y_f32, wgmma_l2_ahead, wgmma_persistent, "
          "wgmma_not_persistent, wgmma_even_items, default_again, wgmma_staged_y_f32); a name "
          "that matches none (e.g. none) times none");
ABSL_FLAG(std::string, backend_tokens, "",
          "comma-separated token counts at which to also time CudaExpertBackend::Run from host "
          "inputs to host output (what a shard's executor waits for), the graph and pinned "
          "staging defaults against kernels launched one by one with pageable copies");
ABSL_FLAG(int, backend_mixed, 0,
          "mixed-size backend workload: Runs of every token count 1..N (4 routings each) in a "
          "new shuffled order per round, per graph limit (0: not timed)");
ABSL_FLAG(int, backend_rounds, 3, "alternating rounds of the two backend configurations");
ABSL_FLAG(int, backend_runs, 60, "timed Runs per backend configuration and round");
ABSL_FLAG(bool, direct_batches, false,
          "draw every batch again until no expert slot has two routes (direct routes: what the "
          "fused layer kernel takes), to time that kernel at several tokens per batch");
ABSL_FLAG(bool, layer_trace, false,
          "at batches that run the fused layer kernel, print when its CTAs pass each of its "
          "phases (global timer, us after the first CTA started: min / median / max)");
ABSL_FLAG(bool, wgmma_trace, false,
          "at points that run the wgmma kernel, run each routing set once with the kernel's "
          "per-CTA trace (ExpertGemmParams::wg_trace) and print, per GEMM, where a CTA's time "
          "goes (start to inputs ready, to first chunk ready, main loop, epilogue), how busy the "
          "SMs are and the gap between one CTA's end and the next CTA's start on an SM");
ABSL_FLAG(std::string, samples_csv, "",
          "if set, every timed replay of each point's default line goes to this CSV (tokens, "
          "replay, wall-clock ms at its end, us per pass), in order: to line the replay times "
          "up with the clock and power an `nvidia-smi --query-gpu=timestamp,... -lms` log shows");
ABSL_FLAG(int, extras_max_tokens, 1 << 30,
          "up to this token count also time GEMM variants 1..3 (and launches without PDL up to "
          "64 tokens)");

namespace moe::bench {
namespace {

using cuda::CudaStatus;



// Device copies of one routing set.
struct DeviceInputs {
  HostBatch host;
  cuda::RoutePlan plan;
  cuda::DeviceBuffer hidden, ids, weights, out;
  uint8_t* pinned = nullptr;  // hidden | ids | weights | out, for the with-copies graph
  size_t in_bytes[3] = {};
  size_t out_bytes = 0;

  ~DeviceInputs() {
    if (pinned != nullptr) cudaFreeHost(pinned);
  }
  cuda::DeviceBatch Batch() const {
    cuda::DeviceBatch b;
    b.hidden = hidden.get();
    b.hidden_bf16 = true;
    b.ids = ids.as<int32_t>();
    b.weights = weights.as<float>();
    b.out = out.get();
    b.out_bf16 = true;
    return b;
  }
};

std::unique_ptr<DeviceInputs> Upload(HostBatch host, int num_experts, cudaStream_t stream) {
  auto d = std::make_unique<DeviceInputs>();
  d->host = std::move(host);
  const int64_t tokens = d->host.tokens;
  d->plan = cuda::PlanRoutes(d->host.ids.data(), tokens, d->host.top_k, nullptr, num_experts, 0);
  d->in_bytes[0] = d->host.hidden.size() * 2;
  d->in_bytes[1] = d->host.ids.size() * 4;
  d->in_bytes[2] = d->host.weights.size() * 4;
  d->out_bytes = d->in_bytes[0];
  const void* src[3] = {d->host.hidden.data(), d->host.ids.data(), d->host.weights.data()};
  cuda::DeviceBuffer* dst[3] = {&d->hidden, &d->ids, &d->weights};
  const size_t total = d->in_bytes[0] + d->in_bytes[1] + d->in_bytes[2] + d->out_bytes;
  CUDA_CHECK_OK(cudaMallocHost(reinterpret_cast<void**>(&d->pinned), total));
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    BENCH_CHECK_OK(dst[i]->Reserve(d->in_bytes[i]));
    std::memcpy(d->pinned + at, src[i], d->in_bytes[i]);
    CUDA_CHECK_OK(cudaMemcpyAsync(dst[i]->get(), src[i], d->in_bytes[i], cudaMemcpyHostToDevice,
                                  stream));
    at += d->in_bytes[i];
  }
  BENCH_CHECK_OK(d->out.Reserve(d->out_bytes));
  CUDA_CHECK_OK(cudaStreamSynchronize(stream));
  return d;
}

// Enqueues one pass per routing set, optionally with the host copies around each.
void EnqueuePasses(const cuda::DeviceExpertLayer& layer, cuda::ExpertRunner& runner,
                   const std::vector<std::unique_ptr<DeviceInputs>>& sets, bool with_copies,
                   cudaStream_t stream) {
  for (const auto& s : sets) {
    if (with_copies) {
      size_t at = 0;
      const cuda::DeviceBuffer* dst[3] = {&s->hidden, &s->ids, &s->weights};
      for (int i = 0; i < 3; ++i) {
        CUDA_CHECK_OK(cudaMemcpyAsync(dst[i]->get(), s->pinned + at, s->in_bytes[i],
                                      cudaMemcpyHostToDevice, stream));
        at += s->in_bytes[i];
      }
    }
    BENCH_CHECK_OK(runner.Enqueue(layer, s->Batch(), s->plan, stream));
    if (with_copies) {
      const size_t at = s->in_bytes[0] + s->in_bytes[1] + s->in_bytes[2];
      CUDA_CHECK_OK(cudaMemcpyAsync(s->pinned + at, s->out.get(), s->out_bytes,
                                    cudaMemcpyDeviceToHost, stream));
    }
  }
}

// Captures the passes into a graph and times `reps` replays; returns microseconds per pass.
std::vector<double> TimeGraph(const cuda::DeviceExpertLayer& layer, cuda::ExpertRunner& runner,
                              const std::vector<std::unique_ptr<DeviceInputs>>& sets,
                              bool with_copies, int reps, cudaStream_t stream,
                              std::vector<double>* end_wall_ms = nullptr) {
  return TimeGraphReplays(
      stream, [&](cudaStream_t s) { EnqueuePasses(layer, runner, sets, with_copies, s); }, reps,
      static_cast<double>(sets.size()),
      [end_wall_ms] {
        if (end_wall_ms == nullptr) return;
        end_wall_ms->push_back(std::chrono::duration<double, std::milli>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
      });
}

// Median time of each stage (prologue, GEMM1, GEMM2, combine) over plain launches.
std::vector<double> StageSplit(const cuda::DeviceExpertLayer& layer, cuda::ExpertRunner& runner,
                               const std::vector<std::unique_ptr<DeviceInputs>>& sets,
                               cudaStream_t stream) {
  cudaEvent_t ev[5];
  for (cudaEvent_t& e : ev) CUDA_CHECK_OK(cudaEventCreate(&e));
  runner.set_stage_events(ev);
  std::vector<std::vector<double>> per_stage(4);
  for (int rep = 0; rep < 5; ++rep) {
    for (const auto& s : sets) {
      BENCH_CHECK_OK(runner.Enqueue(layer, s->Batch(), s->plan, stream));
      CUDA_CHECK_OK(cudaEventSynchronize(ev[4]));
      for (int i = 0; i < 4; ++i) {
        float ms = 0;
        CUDA_CHECK_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        per_stage[i].push_back(ms * 1e3);
      }
    }
  }
  runner.set_stage_events(nullptr);
  for (cudaEvent_t& e : ev) cudaEventDestroy(e);
  std::vector<double> medians;
  for (auto& v : per_stage) medians.push_back(Summarize(v).median);
  return medians;
}

// The fused layer kernel's phase times (ExpertLayerParams::trace) over the CTAs of one eager
// pass of each set.
void PrintLayerTrace(const cuda::DeviceExpertLayer& layer, cuda::ExpertRunner& runner,
                     const std::vector<std::unique_ptr<DeviceInputs>>& sets, cudaStream_t stream) {
  int sms = 0;
  CUDA_CHECK_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cuda::DeviceBuffer trace;
  BENCH_CHECK_OK(trace.Reserve(static_cast<size_t>(sms) * 8 * 8));
  const char* names[] = {"prologue done", "hidden staged", "own GEMM1 done", "all routes ready",
                         "act staged", "end"};
  for (const auto& set : sets) {
    CUDA_CHECK_OK(cudaMemsetAsync(trace.get(), 0, trace.size(), stream));
    runner.set_layer_trace(trace.as<unsigned long long>());
    BENCH_CHECK_OK(runner.Enqueue(layer, set->Batch(), set->plan, stream));
    runner.set_layer_trace(nullptr);
    std::vector<unsigned long long> t(static_cast<size_t>(sms) * 8);
    CUDA_CHECK_OK(cudaMemcpyAsync(t.data(), trace.get(), t.size() * 8, cudaMemcpyDeviceToHost,
                                  stream));
    CUDA_CHECK_OK(cudaStreamSynchronize(stream));
    unsigned long long first = ~0ull;
    for (int c = 0; c < sms; ++c) {
      if (t[c * 8] != 0) first = std::min(first, t[c * 8]);
    }
    if (first == ~0ull) {
      std::printf("      layer trace: the fused layer kernel did not run\n");
      return;
    }
    std::printf(
        "      layer trace (us after the first CTA passed the prologue wait, min / median / max "
        "over CTAs):");
    for (int i = 0; i < 6; ++i) {
      std::vector<double> v;
      for (int c = 0; c < sms; ++c) {
        if (t[c * 8 + i] != 0) v.push_back((t[c * 8 + i] - first) * 1e-3);
      }
      std::sort(v.begin(), v.end());
      if (v.empty()) continue;
      std::printf(" | %s %.1f/%.1f/%.1f", names[i], v.front(), v[v.size() / 2], v.back());
    }
    std::printf("\n");
  }
}

// --wgmma_trace: one eager pass per routing set with ExpertGemmParams::wg_trace on both GEMMs.
void PrintWgmmaTrace(const cuda::DeviceExpertLayer& layer, cuda::ExpertRunner& runner,
                     const std::vector<std::unique_ptr<DeviceInputs>>& sets, cudaStream_t stream) {
  constexpr int64_t kMaxCtas = int64_t{1} << 17;  // per GEMM
  constexpr int W = cuda::kWgTraceWords;
  // The kernel writes one record per tile (items x 256-row blocks; the wgmma plan has no more
  // items than the given one, whose grid the runner may round up by 1/8): per CTA, or with
  // persistent CTAs per tile, its start being where the CTA's loop reaches it.
  const int64_t row_blocks =
      std::max((2 * layer.inter_padded + 255) / 256, (layer.hidden + 255) / 256);
  for (const auto& set : sets) {
    if ((set->plan.num_items + set->plan.num_items / 8 + 1) * row_blocks > kMaxCtas) {
      std::printf("      wgmma trace: a grid may exceed the trace buffer (%lld CTAs); skipped\n",
                  static_cast<long long>(kMaxCtas));
      return;
    }
  }
  int sms = 0;
  CUDA_CHECK_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cuda::DeviceBuffer trace;
  BENCH_CHECK_OK(trace.Reserve(static_cast<size_t>(2 * kMaxCtas * W * 8)));
  for (size_t si = 0; si < sets.size() && si < 2; ++si) {
    CUDA_CHECK_OK(cudaMemsetAsync(trace.get(), 0, trace.size(), stream));
    runner.set_wgmma_trace(trace.as<unsigned long long>(), kMaxCtas * W);
    BENCH_CHECK_OK(runner.Enqueue(layer, sets[si]->Batch(), sets[si]->plan, stream));
    runner.set_wgmma_trace(nullptr, 0);
    std::vector<unsigned long long> t(static_cast<size_t>(2 * kMaxCtas * W));
    CUDA_CHECK_OK(cudaMemcpyAsync(t.data(), trace.get(), t.size() * 8, cudaMemcpyDeviceToHost,
                                  stream));
    CUDA_CHECK_OK(cudaStreamSynchronize(stream));
    for (int gemm = 0; gemm < 2; ++gemm) {
      const unsigned long long* g = t.data() + gemm * kMaxCtas * W;
      // Per CTA: 0 SM, 1 start, 2 inputs ready, 3 first chunk ready, 4 loop done, 5 end,
      // 6 wgmma groups drained, 7 tile staged in shared memory.
      unsigned long long first = ~0ull, last = 0;
      double phase[4] = {0, 0, 0, 0}, epi[3] = {0, 0, 0}, busy = 0;
      int64_t ctas = 0;
      std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm(sms);
      for (int64_t c = 0; c < kMaxCtas; ++c) {
        const unsigned long long* r = g + c * W;
        if (r[1] == 0 || r[5] == 0) continue;
        ++ctas;
        first = std::min(first, r[1]);
        last = std::max(last, r[5]);
        for (int k = 0; k < 4; ++k) phase[k] += (r[k + 2] - r[k + 1]) * 1e-3;
        if (r[6] != 0 && r[7] != 0) {
          epi[0] += (r[6] - r[4]) * 1e-3;
          epi[1] += (r[7] - r[6]) * 1e-3;
          epi[2] += (r[5] - r[7]) * 1e-3;
        }
        busy += (r[5] - r[1]) * 1e-3;
        if (r[0] < static_cast<unsigned long long>(sms)) per_sm[r[0]].push_back({r[1], r[5]});
      }
      if (ctas == 0) {
        std::printf("      wgmma trace GEMM%d: no traced CTA (not the wgmma kernel's variant 0)\n",
                    gemm + 1);
        continue;
      }
      double gaps = 0;
      int64_t gap_count = 0;
      for (auto& v : per_sm) {
        std::sort(v.begin(), v.end());
        for (size_t i = 1; i < v.size(); ++i) {
          if (v[i].first > v[i - 1].second) gaps += (v[i].first - v[i - 1].second) * 1e-3;
          ++gap_count;
        }
      }
      const double span = (last - first) * 1e-3;
      std::printf(
          "      wgmma trace GEMM%d (set %zu): %lld CTAs over %.1f us; per CTA (mean us) "
          "start->inputs %.2f, ->first chunk %.2f, main loop %.2f, epilogue %.2f (drain %.2f, "
          "stage %.2f, "
          "store %.2f); SMs holding a CTA %.1f%% of the span; gap between CTAs on an SM %.2f us "
          "(mean)\n",
          gemm + 1, si, static_cast<long long>(ctas), span, phase[0] / ctas, phase[1] / ctas,
          phase[2] / ctas, phase[3] / ctas, epi[0] / ctas, epi[1] / ctas, epi[2] / ctas,
          100.0 * busy / (sms * span), gap_count > 0 ? gaps / gap_count : 0.0);
    }
  }
}

// Relative error of one pass against the CPU reference.
double CheckAgainstReference(const ProblemLayer& problem, const cuda::DeviceExpertLayer& layer,
                             cuda::ExpertRunner& runner, const DeviceInputs& set,
                             cudaStream_t stream) {
  BENCH_CHECK_OK(runner.Enqueue(layer, set.Batch(), set.plan, stream));
  std::vector<uint16_t> got(set.host.hidden.size()), ref(set.host.hidden.size());
  CUDA_CHECK_OK(cudaMemcpyAsync(got.data(), set.out.get(), got.size() * 2, cudaMemcpyDeviceToHost,
                                stream));
  CUDA_CHECK_OK(cudaStreamSynchronize(stream));
  ExpertsRequest request = set.host.Request(ref.data());
  BENCH_CHECK_OK(RunExpertsReference(problem.layer, request));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = Bf16ToFloat(got[i]), r = Bf16ToFloat(ref[i]);
    diff += (g - r) * (g - r);
    norm += r * r;
  }
  return std::isnan(diff) ? NAN : std::sqrt(diff) / std::sqrt(norm);
}

struct Target {
  char problem;
  int64_t tokens;
  double target_us;
};
constexpr Target kTargets[] = {{'A', 1, 25},     {'A', 8, 110},     {'A', 64, 400},
                               {'A', 512, 600},  {'A', 4096, 1600}, {'A', 8192, 3000},
                               {'B', 64, 1500},  {'B', 4096, 5500}, {'C', 64, 120}};

double TargetFor(char problem, int64_t tokens) {
  for (const Target& t : kTargets) {
    if (t.problem == problem && t.tokens == tokens) return t.target_us;
  }
  return 0;
}

// CudaExpertBackend::Run wall time (host inputs in, host output back) at each of
// --backend_tokens: the defaults (CUDA graphs for repeated shapes, one pinned staging buffer
// filled and emptied by several threads, moved by copy kernels up to kernel_copy_max_bytes)
// against the defaults with the hidden states and output in device memory (device_tensors: a
// same-host frontend's ForwardCuda), the copy engine for every pinned batch, launches one by one
// with pageable per-tensor copies, the defaults with one copy thread and the defaults without
// graphs, in alternating
// rounds over 8 routings per token count (so the graphs see several item counts), with each
// configuration's mean host time per Run step (CudaBackendCounters). Returns the JSON rows.
nlohmann::json TimeBackend(const ProblemLayer& problem) {
  nlohmann::json rows = nlohmann::json::array();
  const std::string list = absl::GetFlag(FLAGS_backend_tokens);
  if (list.empty()) return rows;
  CudaBackendOptions plain_options;
  plain_options.graph_max_tokens = 0;
  plain_options.pinned_staging_bytes = 0;
  CudaBackendOptions one_thread_options;
  one_thread_options.copy_threads = 1;
  CudaBackendOptions no_graph_options;
  no_graph_options.graph_max_tokens = 0;
  CudaBackendOptions dma_options;  // the copy engine for every pinned batch
  dma_options.kernel_copy_max_bytes = 0;
  CudaBackendOptions copy_out_options;  // graphed batches: the output moved by a copy kernel
  copy_out_options.pinned_direct_output = false;
  CudaBackendOptions pdl_graph_options;
  pdl_graph_options.graph_max_tokens = 512;
  pdl_graph_options.graph_programmatic_launch = true;
  // device_tensors: the default backend given the hidden states and output in device memory
  // (what a shard passes for a same-host frontend's ForwardCuda), copied there outside the timing.
  const struct {
    const char* name;
    CudaBackendOptions options;
    bool device = false;
  } configs[] = {{"default", CudaBackendOptions{}},
                 {"device_tensors", CudaBackendOptions{}, true},
                 {"dma_copies", dma_options},
                 {"copy_out_kernel", copy_out_options},
                 {"eager_pageable", plain_options},
                 {"pinned_one_copy_thread", one_thread_options},
                 {"pinned_eager", no_graph_options},
                 {"graphs_pdl_512", pdl_graph_options}};
  std::vector<std::unique_ptr<ExpertBackend>> backends;
  for (const auto& c : configs) {
    absl::StatusOr<std::unique_ptr<ExpertBackend>> b = MakeCudaExpertBackend(c.options);
    BENCH_CHECK_OK(b.status());
    BENCH_CHECK_OK((*b)->PrepareLayer(0, problem.layer));
    backends.push_back(*std::move(b));
  }
  for (absl::string_view field : absl::StrSplit(list, ',')) {
    const int64_t tokens = std::stoll(std::string(field));
    std::mt19937_64 rng(99 + static_cast<uint64_t>(tokens));
    std::vector<HostBatch> batches;
    for (int i = 0; i < 8; ++i) batches.push_back(RandomBatch(problem, tokens, rng));
    std::vector<uint16_t> out(static_cast<size_t>(tokens * problem.layer.hidden));
    // Device copies of every batch's hidden states and one device output (device_tensors).
    const size_t row_bytes = static_cast<size_t>(tokens * problem.layer.hidden) * 2;
    std::vector<cuda::DeviceBuffer> device_hidden(batches.size());
    cuda::DeviceBuffer device_out;
    BENCH_CHECK_OK(device_out.Reserve(row_bytes));
    for (size_t i = 0; i < batches.size(); ++i) {
      BENCH_CHECK_OK(device_hidden[i].Reserve(row_bytes));
      CUDA_CHECK_OK(cudaMemcpy(device_hidden[i].get(), batches[i].hidden.data(), row_bytes,
                               cudaMemcpyHostToDevice));
    }
    const auto request_for = [&](size_t config, size_t i) {
      ExpertsRequest r = batches[i].Request(out.data());
      if (configs[config].device) {
        r.hidden_states.data = device_hidden[i].get();
        r.hidden_on_device = true;
        r.out.data = device_out.get();
        r.out_on_device = true;
      }
      return r;
    };
    std::vector<std::vector<double>> us(backends.size());
    std::vector<uint16_t> first_out;
    for (size_t b = 0; b < backends.size(); ++b) {  // warm-up: every shape captured
      for (int pass = 0; pass < 2; ++pass) {
        for (size_t i = 0; i < batches.size(); ++i) {
          BENCH_CHECK_OK(backends[b]->Run(0, problem.layer, request_for(b, i)));
        }
      }
      if (configs[b].device) {
        CUDA_CHECK_OK(cudaMemcpy(out.data(), device_out.get(), row_bytes, cudaMemcpyDeviceToHost));
      }
      if (b == 0) {
        first_out = out;
      } else {
        // Both configurations give the same bits for the last batch.
        if (out != first_out) BENCH_CHECK_OK(absl::InternalError("backend outputs differ"));
      }
    }
    std::vector<CudaBackendCounters> before;
    for (const auto& backend : backends) before.push_back(GetCudaBackendCounters(*backend));
    for (int round = 0; round < absl::GetFlag(FLAGS_backend_rounds); ++round) {
      for (size_t b = 0; b < backends.size(); ++b) {
        for (int i = 0; i < absl::GetFlag(FLAGS_backend_runs); ++i) {
          const ExpertsRequest request = request_for(b, i % batches.size());
          const auto t0 = std::chrono::steady_clock::now();
          BENCH_CHECK_OK(backends[b]->Run(0, problem.layer, request));
          us[b].push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                  .count());
        }
      }
    }
    nlohmann::json row = {{"tokens", tokens}};
    std::printf("backend Run T=%5lld:", static_cast<long long>(tokens));
    for (size_t b = 0; b < backends.size(); ++b) {
      const Stats st = Summarize(us[b]);
      const CudaBackendCounters n = GetCudaBackendCounters(*backends[b]);
      std::printf(" %s median %8.1f us (p10 %8.1f p90 %8.1f) [eager %lld, captures %lld, replays "
                  "%lld, pinned %lld, kernel copies %lld];",
                  configs[b].name, st.median, st.p10, st.p90, static_cast<long long>(n.eager_runs),
                  static_cast<long long>(n.graph_captures), static_cast<long long>(n.graph_replays),
                  static_cast<long long>(n.pinned_runs), static_cast<long long>(n.kernel_copy_runs));
      // Mean host time per timed Run in each step (CudaBackendCounters).
      const double runs = static_cast<double>(us[b].size());
      const auto mean_us = [&](int64_t after, int64_t start) {
        return runs > 0 ? static_cast<double>(after - start) / runs / 1e3 : 0.0;
      };
      const CudaBackendCounters& n0 = before[b];
      const nlohmann::json steps = {
          {"prepare", mean_us(n.prepare_ns, n0.prepare_ns)},
          {"copy_in", mean_us(n.copy_in_ns, n0.copy_in_ns)},
          {"enqueue", mean_us(n.enqueue_ns, n0.enqueue_ns)},
          {"copy_out_submit", mean_us(n.copy_out_submit_ns, n0.copy_out_submit_ns)},
          {"wait", mean_us(n.wait_ns, n0.wait_ns)},
          {"copy_out_host", mean_us(n.copy_out_host_ns, n0.copy_out_host_ns)}};
      std::printf(" steps (mean us: prepare %.1f, copy in %.1f, enqueue %.1f, copy out submit "
                  "%.1f, wait %.1f, copy out host %.1f);",
                  steps["prepare"].get<double>(), steps["copy_in"].get<double>(),
                  steps["enqueue"].get<double>(), steps["copy_out_submit"].get<double>(),
                  steps["wait"].get<double>(), steps["copy_out_host"].get<double>());
      row[configs[b].name] = {{"wall", ToJson(st)},
                              {"eager_runs", n.eager_runs},
                              {"graph_captures", n.graph_captures},
                              {"graph_replays", n.graph_replays},
                              {"pinned_runs", n.pinned_runs},
                              {"kernel_copy_runs", n.kernel_copy_runs},
                              {"steps_mean_us", steps}};
    }
    std::printf("\n");
    rows.push_back(row);
  }
  return rows;
}

// --backend_mixed=N: what graph_max_tokens costs or saves when the batch sizes vary, as a
// server's do: every token count 1..N with 4 routings each (4N shapes or more, over the kept
// kMaxCudaGraphs graphs at N >= 16), in a new shuffled order every round; the graph limits
// 0 (none), 8 and N alternate per round, in a rotated order each round (so that a drift of the
// clock within a round favours none). Mean and median Run wall time overall and per token-count
// band, and the counters (captures, replays, refusals of the cache's eviction guard). Returns
// the JSON rows.
nlohmann::json TimeBackendMixed(const ProblemLayer& problem) {
  nlohmann::json rows = nlohmann::json::array();
  const int max_tokens = absl::GetFlag(FLAGS_backend_mixed);
  if (max_tokens <= 0) return rows;
  std::mt19937_64 rng(4242);
  std::vector<HostBatch> batches;
  for (int t = 1; t <= max_tokens; ++t) {
    for (int i = 0; i < 4; ++i) batches.push_back(RandomBatch(problem, t, rng));
  }
  std::vector<uint16_t> out(static_cast<size_t>(max_tokens * problem.layer.hidden));
  const int limits[] = {0, 8, max_tokens};
  std::vector<std::unique_ptr<ExpertBackend>> backends;
  for (int limit : limits) {
    CudaBackendOptions options;
    options.graph_max_tokens = limit;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> b = MakeCudaExpertBackend(options);
    BENCH_CHECK_OK(b.status());
    BENCH_CHECK_OK((*b)->PrepareLayer(0, problem.layer));
    backends.push_back(*std::move(b));
  }
  std::vector<std::vector<double>> us(backends.size());
  // Token-count bands: 1-4, 5-8, 9-16, 17-32, 33 and more.
  constexpr int kBands = 5;
  const auto band_of = [](int64_t t) { return t <= 4 ? 0 : t <= 8 ? 1 : t <= 16 ? 2 : t <= 32 ? 3 : 4; };
  std::vector<std::array<std::vector<double>, kBands>> band_us(backends.size());
  std::vector<size_t> order(batches.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const int rounds = absl::GetFlag(FLAGS_backend_rounds) + 1;  // the first one is not timed
  for (int round = 0; round < rounds; ++round) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t k = 0; k < backends.size(); ++k) {
      const size_t b = (k + static_cast<size_t>(round)) % backends.size();
      for (size_t i : order) {
        const ExpertsRequest request = batches[i].Request(out.data());
        const auto t0 = std::chrono::steady_clock::now();
        BENCH_CHECK_OK(backends[b]->Run(0, problem.layer, request));
        const double took =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        if (round > 0) {
          us[b].push_back(took);
          band_us[b][band_of(batches[i].tokens)].push_back(took);
        }
      }
    }
  }
  std::printf("backend mixed 1..%d tokens, %zu batches x %d rounds:", max_tokens, batches.size(),
              rounds - 1);
  for (size_t b = 0; b < backends.size(); ++b) {
    const Stats st = Summarize(us[b]);
    double sum = 0;
    for (double v : us[b]) sum += v;
    const double mean = us[b].empty() ? 0 : sum / static_cast<double>(us[b].size());
    const CudaBackendCounters n = GetCudaBackendCounters(*backends[b]);
    std::printf(" graphs up to %d: mean %.1f us, median %.1f [captures %lld, replays %lld, "
                "refusals %lld, eager %lld], band medians (1-4, 5-8, 9-16, 17-32, 33+):",
                limits[b], mean, st.median, static_cast<long long>(n.graph_captures),
                static_cast<long long>(n.graph_replays), static_cast<long long>(n.graph_refusals),
                static_cast<long long>(n.eager_runs));
    nlohmann::json bands = nlohmann::json::array();
    for (int k = 0; k < kBands; ++k) {
      const double median = band_us[b][k].empty() ? 0 : Summarize(band_us[b][k]).median;
      std::printf(" %.1f", median);
      bands.push_back(median);
    }
    std::printf(";");
    rows.push_back({{"graph_max_tokens", limits[b]},
                    {"band_medians_us", bands},
                    {"mean_us", mean},
                    {"wall", ToJson(st)},
                    {"graph_captures", n.graph_captures},
                    {"graph_replays", n.graph_replays},
                    {"graph_refusals", n.graph_refusals},
                    {"eager_runs", n.eager_runs}});
  }
  std::printf("\n");
  return rows;
}

const char* ActivationName(const ProblemLayer& p) {
  return p.name == 'A' ? "swigluoai alpha=1.702 limit=7, biases, interleaved"
                       : "silu, no biases, concatenated gate/up";
}

int Main() {
  cudaStream_t stream;
  CUDA_CHECK_OK(cudaSetDevice(0));
  CUDA_CHECK_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CUDA_CHECK_OK(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = CopyBandwidth(stream);
  std::printf("device: %s, %d SMs, L2 %.0f MB; copy bandwidth %.3f TB/s (read + write)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_bw / 1e12);

  const auto t0 = std::chrono::steady_clock::now();
  const std::string problem_flag = absl::GetFlag(FLAGS_problem);
  ProblemLayer problem = MakeProblem(problem_flag.empty() ? 'A' : problem_flag[0],
                                     /*seed=*/20251129);
  const int num_experts = static_cast<int>(problem.layer.experts.size());
  const int64_t hidden = problem.layer.hidden, inter = problem.layer.intermediate;
  absl::StatusOr<std::unique_ptr<cuda::DeviceExpertLayer>> uploaded =
      cuda::UploadExpertLayer(problem.layer, 0, 16);
  BENCH_CHECK_OK(uploaded.status());
  const cuda::DeviceExpertLayer& layer = **uploaded;
  const double bytes_per_expert = ExpertBytes(problem);
  std::printf("problem %c: %d experts, top-%d, H=%lld, I=%lld, %s, %.2f MB per expert, %.2f GB on "
              "the device (%.1f s setup)\n",
              problem.name, num_experts, problem.top_k, static_cast<long long>(hidden),
              static_cast<long long>(inter), std::string(WeightFormatName(problem.layer.format)).c_str(),
              bytes_per_expert / 1e6, layer.device_bytes() / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  nlohmann::json points = nlohmann::json::array();
  cuda::ExpertRunner runner;
  runner.set_gemm_variant(absl::GetFlag(FLAGS_variant));
  runner.set_wgmma_persistent(absl::GetFlag(FLAGS_wgmma_persistent));
  runner.set_even_items(absl::GetFlag(FLAGS_even_items));
  for (absl::string_view field : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    const int64_t tokens = std::stoll(std::string(field));
    // Routing seeded per token count: a point's batches do not depend on which other points the
    // run measures (with one generator for the whole list, A 64 drew 107 or 111 active experts).
    std::mt19937_64 rng(7 + static_cast<uint64_t>(tokens));
    const int rotations = tokens <= 8 ? 16 : 2;
    std::vector<std::unique_ptr<DeviceInputs>> sets;
    double active = 0;
    for (int r = 0; r < rotations; ++r) {
      sets.push_back(Upload(RandomBatch(problem, tokens, rng), num_experts, stream));
      for (int draw = 1; absl::GetFlag(FLAGS_direct_batches) && sets.back()->plan.max_count > 1;
           ++draw) {
        if (draw == 100000) {
          std::fprintf(stderr, "--direct_batches: no batch of %lld tokens without a shared "
                       "expert slot in %d draws\n", static_cast<long long>(tokens), draw);
          std::exit(2);
        }
        sets.back() = Upload(RandomBatch(problem, tokens, rng), num_experts, stream);
      }
      BENCH_CHECK_OK(runner.Reserve(layer, sets.back()->plan, stream));
      active += sets.back()->plan.active_slots;
    }
    active /= rotations;
    EnqueuePasses(layer, runner, sets, false, stream);  // warm-up, outside capture
    CUDA_CHECK_OK(cudaStreamSynchronize(stream));
    int reps = absl::GetFlag(FLAGS_reps);
    if (reps <= 0) reps = tokens <= 64 ? 200 : (tokens <= 512 ? 60 : 20);
    const int64_t item_ready_before = runner.item_ready_launches();
    std::vector<double> end_wall_ms;
    const std::vector<double> samples =
        TimeGraph(layer, runner, sets, false, reps, stream, &end_wall_ms);
    if (const std::string csv = absl::GetFlag(FLAGS_samples_csv); !csv.empty()) {
      std::FILE* f = std::fopen(csv.c_str(), "a");
      if (f == nullptr) {
        std::fprintf(stderr, "cannot write %s\n", csv.c_str());
        std::exit(2);
      }
      for (size_t i = 0; i < samples.size(); ++i) {
        std::fprintf(f, "%lld,%zu,%.3f,%.2f\n", static_cast<long long>(tokens), i,
                     end_wall_ms[i], samples[i]);
      }
      std::fclose(f);
    }
    const Stats device = Summarize(samples);
    const bool item_ready = runner.item_ready_launches() > item_ready_before;
    const Stats e2e = Summarize(TimeGraph(layer, runner, sets, true, std::max(10, reps / 4), stream));
    const std::vector<double> stages = StageSplit(layer, runner, sets, stream);
    nlohmann::json extras = nlohmann::json::array();
    // Times the sets with the runner's current settings; records median and stage split.
    const auto time_with_stages = [&](const std::string& name) {
      const Stats st = Summarize(TimeGraph(layer, runner, sets, false, reps, stream));
      const std::vector<double> sp = StageSplit(layer, runner, sets, stream);
      std::printf("      %-16s median %8.1f us (p10 %8.1f p90 %8.1f) stages %.1f/%.1f/%.1f/%.1f us\n",
                  name.c_str(), st.median, st.p10, st.p90, sp[0], sp[1], sp[2], sp[3]);
      extras.push_back({{"name", name},
                        {"device_graph", ToJson(st)},
                        {"stage_median_us",
                         {{"prologue", sp[0]}, {"gemm1", sp[1]}, {"gemm2", sp[2]}, {"combine", sp[3]}}}});
    };
    const std::string wanted = absl::GetFlag(FLAGS_extras);
    const std::vector<std::string> wanted_names = absl::StrSplit(wanted, ',', absl::SkipEmpty());
    const auto is_wanted = [&](const std::string& name) {
      return wanted.empty() ||
             std::find(wanted_names.begin(), wanted_names.end(), name) != wanted_names.end();
    };
    const bool wgmma = sets[0]->plan.max_count >= cuda::ExpertRunner::kDefaultWgmmaMinTokens;
    if (wgmma) {
      // The same sets through the mma.sync kernels (wgmma off): old vs new in one run.
      if (is_wanted("mma_sync_no_wgmma")) {
        runner.set_wgmma_min_tokens(0);
        time_with_stages("mma_sync_no_wgmma");
        runner.set_wgmma_min_tokens(cuda::ExpertRunner::kDefaultWgmmaMinTokens);
      }
      // The other wgmma configurations (variant 1: 2 warpgroups x 2 m64 blocks, register weight
      // ring; variant 2: 4 x 1, register weight ring).
      for (int variant : {1, 2}) {
        if (!is_wanted(absl::StrCat("wgmma_variant", variant))) continue;
        runner.set_gemm_variant(variant);
        time_with_stages(absl::StrCat("wgmma_variant", variant));
      }
      runner.set_gemm_variant(absl::GetFlag(FLAGS_variant));
      // The default's two byte savers off, one at a time: hidden rows staged for GEMM1 instead
      // of read in place, and y in F32 instead of BF16.
      if (is_wanted("wgmma_hidden_staged")) {
        runner.set_hidden_in_place(false);
        time_with_stages("wgmma_hidden_staged");
        runner.set_hidden_in_place(true);
      }
      if (is_wanted("wgmma_y_f32")) {
        runner.set_y_bf16(false);
        time_with_stages("wgmma_y_f32");
        runner.set_y_bf16(true);
      }
      if (is_wanted("wgmma_l2_ahead")) {  // off by default (ExpertRunner::set_wgmma_l2_ahead)
        runner.set_wgmma_l2_ahead(true);
        time_with_stages("wgmma_l2_ahead");
        runner.set_wgmma_l2_ahead(false);
      }
      // Persistent CTAs forced on and off (set_wgmma_persistent; the default: NVFP4 only).
      if (is_wanted("wgmma_persistent")) {
        runner.set_wgmma_persistent(cuda::ExpertRunner::kPersistentOn);
        time_with_stages("wgmma_persistent");
        runner.set_wgmma_persistent(absl::GetFlag(FLAGS_wgmma_persistent));
      }
      if (is_wanted("wgmma_not_persistent")) {
        runner.set_wgmma_persistent(cuda::ExpertRunner::kPersistentOff);
        time_with_stages("wgmma_not_persistent");
        runner.set_wgmma_persistent(absl::GetFlag(FLAGS_wgmma_persistent));
      }
      if (is_wanted("wgmma_even_items")) {  // every wgmma batch (set_even_items)
        runner.set_even_items(cuda::ExpertRunner::kPersistentOn);
        time_with_stages("wgmma_even_items");
        runner.set_even_items(absl::GetFlag(FLAGS_even_items));
      }
      // The default again after the extras above: with the main line, an A-B-A pair that cancels
      // a steady drift of the clock (the power cap) between them.
      if (is_wanted("default_again")) time_with_stages("default_again");
      if (is_wanted("wgmma_staged_y_f32")) {  // both off: the form before they existed
        runner.set_hidden_in_place(false);
        runner.set_y_bf16(false);
        time_with_stages("wgmma_staged_y_f32");
        runner.set_hidden_in_place(true);
        runner.set_y_bf16(true);
      }
    }
    if (!wgmma && sets[0]->plan.max_count > 8) {
      // The same sets through the wgmma kernel (every batch): where the threshold should be.
      runner.set_wgmma_min_tokens(1);
      time_with_stages("wgmma_forced");
      runner.set_wgmma_min_tokens(cuda::ExpertRunner::kDefaultWgmmaMinTokens);
    }
    if (wgmma && absl::GetFlag(FLAGS_wgmma_trace)) PrintWgmmaTrace(layer, runner, sets, stream);
    if (absl::GetFlag(FLAGS_layer_trace)) {
      runner.set_fused_layer(cuda::ExpertRunner::kFusedLayerAlways);
      PrintLayerTrace(layer, runner, sets, stream);
      runner.set_fused_layer(cuda::ExpertRunner::kFusedLayerAuto);
    }
    // A knob on (`name`) against off (`no_` + name), alternated twice: extras measured later run
    // on a warmer GPU, so one order alone would favour the first. `set` turns it on or off.
    const auto alternate = [&](const std::string& name, const auto& set) {
      for (int round = 0; round < 2; ++round) {
        for (const bool on : {false, true}) {
          const std::string label = on ? name : "no_" + name;
          if (!is_wanted(label)) continue;
          set(on);
          time_with_stages(label);
        }
      }
    };
    if (!wgmma) {
      // GEMM2 waiting per item (ExpertRunner::set_item_ready forced on) against the wait for the
      // whole GEMM1 grid; the MXFP4 block scale on the accumulators (set_acc_scale) against the
      // scale on the decoded weights (the default).
      alternate("item_ready", [&](bool on) {
        runner.set_item_ready(on ? cuda::ExpertRunner::kItemReadyAlways
                                 : cuda::ExpertRunner::kItemReadyOff);
      });
      runner.set_item_ready(cuda::ExpertRunner::kItemReadyAuto);
      alternate("acc_scale", [&](bool on) { runner.set_acc_scale(on); });
      runner.set_acc_scale(false);
    }
    if (sets[0]->plan.max_count <= 1) {
      // Direct batches with the fused layer kernel forced on and off (the default takes it by
      // the bytes per SM, ExpertRunner::kFusedLayerMinBytesPerSm).
      const struct {
        const char* name;
        int mode;
      } modes[] = {{"fused_layer", cuda::ExpertRunner::kFusedLayerAlways},
                   {"no_fused_layer", cuda::ExpertRunner::kFusedLayerOff}};
      for (const auto& m : modes) {
        if (!is_wanted(m.name)) continue;
        runner.set_fused_layer(m.mode);
        time_with_stages(m.name);
      }
      runner.set_fused_layer(cuda::ExpertRunner::kFusedLayerAuto);
    }
    if (tokens <= absl::GetFlag(FLAGS_extras_max_tokens)) {
      // variant0_grouped is the previous default (register ring, routes always grouped).
      // Bulk-copy variants (8..11): l2 = ExpertGemmParams::l2_prefetch bits (-1: the runner's
      // per-batch choice), evict = the evict-first policy on the weight copies.
      constexpr int kAutoL2 = cuda::ExpertRunner::kAutoL2Prefetch;
      const struct {
        const char* name;
        int variant;
        bool pdl;
        bool direct;
        int l2 = -1;
        bool evict = true;
        bool fold = true;
        bool fold_grouped = false;
        bool tiled_evict = false;
      } knobs[] = {{"variant0_grouped", 0, true, false},
                   {"variant0_direct", 0, true, true},
                   {"variant4_grouped", 4, true, false},
                   {"variant1", 1, true, true},
                   {"variant2", 2, true, true},
                   {"variant3", 3, true, true},
                   {"variant5", 5, true, true},
                   {"variant6", 6, true, true},
                   {"variant7", 7, true, true},
                   {"variant4", 4, true, true},
                   {"variant8", 8, true, true},
                   {"variant9", 9, true, true},
                   {"variant10", 10, true, true},
                   {"variant11", 11, true, true},
                   {"variant12", 12, true, true},
                   {"variant13", 13, true, true},
                   {"variant12_no_fold", 12, true, true, kAutoL2, true, false},
                   {"variant12_fold_grouped", 12, true, true, kAutoL2, true, true, true},
                   {"variant6_no_evict_first", 6, true, true, kAutoL2, false},
                   {"variant4_no_evict_first", 4, true, true, kAutoL2, false},
                   {"variant7_no_evict_first", 7, true, true, kAutoL2, false},
                   {"variant8_no_evict_first", 8, true, true, kAutoL2, false},
                   {"variant8_evict_first", 8, true, true, kAutoL2, true, true, false, true},
                   {"variant11_no_evict_first", 11, true, true, kAutoL2, false},
                   {"variant8_l2_own", 8, true, true, cuda::kL2PrefetchOwn},
                   {"variant8_l2_ahead", 8, true, true, cuda::kL2PrefetchAhead},
                   {"variant11_l2_ahead", 11, true, true, cuda::kL2PrefetchAhead},
                   {"variant9_l2_none", 9, true, true, 0},
                   {"variant9_l2_next", 9, true, true, cuda::kL2PrefetchNext},
                   {"variant9_l2_own_next", 9, true, true,
                    cuda::kL2PrefetchOwn | cuda::kL2PrefetchNext},
                   {"variant10_l2_none", 10, true, true, 0},
                   {"variant10_l2_next", 10, true, true, cuda::kL2PrefetchNext},
                   {"variant10_l2_own_next", 10, true, true,
                    cuda::kL2PrefetchOwn | cuda::kL2PrefetchNext},
                   {"auto_no_pdl", cuda::kAutoGemmVariant, false, true}};
      for (const auto& k : knobs) {
        if (!k.pdl && tokens > 64) continue;
        if (!wanted.empty() && std::find(wanted_names.begin(), wanted_names.end(),
                                         std::string(k.name)) == wanted_names.end()) {
          continue;
        }
        runner.set_gemm_variant(k.variant);
        runner.set_programmatic_launch(k.pdl);
        runner.set_direct_routes(k.direct);
        runner.set_l2_prefetch(k.l2);
        runner.set_weights_evict_first(k.evict);
        runner.set_fold_combine(k.fold);
        runner.set_fold_grouped(k.fold_grouped);
        runner.set_tiled_evict_first(k.tiled_evict);
        const Stats st = Summarize(TimeGraph(layer, runner, sets, false, reps, stream));
        std::printf("      %-16s median %8.1f us (p10 %8.1f p90 %8.1f)\n", k.name, st.median,
                    st.p10, st.p90);
        extras.push_back({{"name", k.name}, {"device_graph", ToJson(st)}});
      }
      runner.set_gemm_variant(absl::GetFlag(FLAGS_variant));
      runner.set_programmatic_launch(true);
      runner.set_direct_routes(true);
      runner.set_l2_prefetch(kAutoL2);
      runner.set_weights_evict_first(true);
      runner.set_fold_combine(true);
      runner.set_fold_grouped(false);
      runner.set_tiled_evict_first(false);
      // Smaller token tiles than the plan's choice: more items, each expert's weights re-read
      // (from L2 when the items run together), the few-token kernels instead of the tiled one.
      for (int groups : {1, 2, 4}) {
        const std::string name = absl::StrCat("token_groups_", groups);
        if (groups >= sets[0]->plan.token_groups) continue;
        if (!wanted.empty() && std::find(wanted_names.begin(), wanted_names.end(), name) ==
                                   wanted_names.end()) {
          continue;
        }
        std::vector<cuda::RoutePlan> saved;
        for (auto& set : sets) {
          saved.push_back(set->plan);
          set->plan = cuda::WithTokenGroups(set->plan, groups);
          BENCH_CHECK_OK(runner.Reserve(layer, set->plan, stream));
        }
        const Stats st = Summarize(TimeGraph(layer, runner, sets, false, reps, stream));
        std::printf("      %-16s median %8.1f us (p10 %8.1f p90 %8.1f)\n", name.c_str(),
                    st.median, st.p10, st.p90);
        extras.push_back({{"name", name}, {"device_graph", ToJson(st)}});
        for (size_t i = 0; i < sets.size(); ++i) sets[i]->plan = saved[i];
      }
    }
    const double memory_floor = active * bytes_per_expert / 4.23e12 * 1e6;
    const double measured_floor = active * bytes_per_expert / copy_bw * 1e6;
    const double flops = 2.0 * tokens * problem.top_k * 3.0 * hidden * inter;
    const double compute_floor = flops / 790e12 * 1e6;
    const double floor = std::max(memory_floor, compute_floor);
    const double target = TargetFor(problem.name, tokens);
    std::printf(
        "T=%5lld active=%6.1f groups=%d%s%s items=%5lld | median %8.1f us (p10 %8.1f p90 %8.1f) | "
        "floor %7.1f us (%s) ratio %.2f | target %6.0f us %s | with copies %8.1f us | stages "
        "%.1f/%.1f/%.1f/%.1f us\n",
        static_cast<long long>(tokens), active, sets[0]->plan.token_groups,
        wgmma ? absl::StrCat(" (wgmma: ", cuda::kWgmmaTokenGroups, ")").c_str() : "",
        item_ready ? " item-ready" : "", static_cast<long long>(sets[0]->plan.num_items),
        device.median, device.p10, device.p90,
        floor, memory_floor >= compute_floor ? "memory" : "compute", device.median / floor,
        target, target > 0 ? (device.median <= target ? "MET" : "missed") : "", e2e.median,
        stages[0], stages[1], stages[2], stages[3]);
    nlohmann::json point = {{"tokens", tokens},
                            {"rotations", rotations},
                            {"active_experts", active},
                            {"token_groups", sets[0]->plan.token_groups},
                            {"wgmma", wgmma},
                            {"item_ready", item_ready},
                            {"items", sets[0]->plan.num_items},
                            {"device_graph", ToJson(device)},
                            {"with_host_copies", ToJson(e2e)},
                            {"stage_median_us",
                             {{"prologue", stages[0]},
                              {"gemm1", stages[1]},
                              {"gemm2", stages[2]},
                              {"combine", stages[3]}}},
                            {"memory_floor_us_at_4.23TBps", memory_floor},
                            {"memory_floor_us_at_measured_copy_bw", measured_floor},
                            {"compute_floor_us_at_790TFLOPs", compute_floor},
                            {"ratio_to_floor", device.median / floor},
                            {"target_us", target},
                            {"extras", extras}};
    if (tokens == absl::GetFlag(FLAGS_check_tokens)) {
      const double rel = CheckAgainstReference(problem, layer, runner, *sets[0], stream);
      std::printf("      check vs CPU reference at T=%lld: rel_err %.3e\n",
                  static_cast<long long>(tokens), rel);
      point["rel_err_vs_reference"] = rel;
    }
    points.push_back(point);
  }

  nlohmann::json out = {
      {"benchmark", absl::StrCat("kernel_bench: CUDA expert path, problem ", std::string(1, problem.name))},
      {"machine",
       {{"device", prop.name},
        {"sms", prop.multiProcessorCount},
        {"l2_bytes", prop.l2CacheSize},
        {"memory_bytes", prop.totalGlobalMem}}},
      {"commit", absl::GetFlag(FLAGS_commit)},
      {"date_unix", static_cast<int64_t>(std::time(nullptr))},
      {"copy_bandwidth_TBps", copy_bw / 1e12},
      {"problem",
       {{"name", std::string(1, problem.name)},
        {"experts", num_experts},
        {"top_k", problem.top_k},
        {"hidden", hidden},
        {"intermediate", inter},
        {"format", std::string(WeightFormatName(problem.layer.format))},
        {"activation", ActivationName(problem)},
        {"inputs", "bf16 hidden, uniform routes, bf16 output"},
        {"bytes_per_expert", bytes_per_expert}}},
      {"timing",
       "CUDA graph of `rotations` passes with different routes, per-pass time = replay / "
       "rotations; median over replays; device-resident inputs unless with_host_copies; "
       "default (--variant=-1): GEMM variant chosen per batch (kAutoGemmVariant: 6 with direct "
       "routes where no expert has two routes, else 12 up to 16-token items; tiled 0 from "
       "32-token items; L2 evict-first on the ring variants' weight copies), "
       "programmatic dependent launch on; stage split from plain "
       "launches with events between the kernels"},
      {"points", points},
      {"backend_run",
       {{"timing",
         "wall time of CudaExpertBackend::Run (host inputs to host output), median over "
         "--backend_rounds alternating rounds x --backend_runs runs cycling over 8 routings; "
         "default: CUDA graphs for repeated shapes + one pinned staging buffer, host copies on "
         "CudaBackendOptions::copy_threads threads, moved by copy kernels up to "
         "kernel_copy_max_bytes, graphed ones writing their output straight into it; "
         "dma_copies: the copy engine for every pinned batch; copy_out_kernel: graphed batches' "
         "output moved into the pinned buffer by a copy kernel; "
         "eager_pageable: kernels launched one by one, "
         "pageable per-tensor copies; pinned_one_copy_thread: the default with one copy thread; "
         "pinned_eager: the default without graphs (kernels launched one by one, programmatic "
         "dependent launch on); graphs_pdl_512: graphs up to 512 tokens captured with "
         "programmatic dependent launch"},
        {"rows", TimeBackend(problem)}}},
      {"backend_mixed",
       {{"timing",
         "--backend_mixed=N: Runs of every token count 1..N, 4 routings each, shuffled anew per "
         "round, graph_max_tokens 0 / 8 / N alternating per round (the first round untimed); "
         "wall time per Run"},
        {"rows", TimeBackendMixed(problem)}}}};
  WriteJson(absl::GetFlag(FLAGS_out_json), out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::bench::Main();
}
