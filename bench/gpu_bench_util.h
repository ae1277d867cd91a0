// Scaffolding shared by the GPU benchmarks (kernel_bench, staging_bench): exit-on-error checks,
// order statistics of timing samples, CUDA-graph replay timing, and the device-to-device copy
// bandwidth every GPU figure is compared with.
//
// Benchmark-only (exits the process on errors). Header-only; needs the CUDA runtime.
#ifndef MOE_BENCH_GPU_BENCH_UTIL_H_
#define MOE_BENCH_GPU_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/expert_runner.h"
#include "nlohmann/json.hpp"

// Exits with the status's message when `expr` (an absl::Status) is not OK.
#define BENCH_CHECK_OK(expr)                                                         \
  do {                                                                               \
    const absl::Status _s = (expr);                                                  \
    if (!_s.ok()) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, _s.ToString().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)
#define CUDA_CHECK_OK(expr) BENCH_CHECK_OK(::moe::cuda::CudaStatus((expr), #expr))

namespace moe::bench {

struct Stats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
};

// Order statistics of the samples (nearest rank).
inline Stats Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)]; };
  return Stats{at(0.5), at(0.1), at(0.9), v.front(), v.back()};
}

// Captures what `enqueue(stream)` enqueues into a CUDA graph and times `reps` replays of it with
// events (after 3 untimed ones): each replay's time in microseconds divided by `units` (the
// passes or launches the graph holds). `after_replay`, when set, runs after each timed replay.
template <typename Enqueue>
std::vector<double> TimeGraphReplays(cudaStream_t stream, Enqueue&& enqueue, int reps, double units,
                                     const std::function<void()>& after_replay = {}) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(stream);
  CUDA_CHECK_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK_OK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_CHECK_OK(cudaEventCreate(&start));
  CUDA_CHECK_OK(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int i = 0; i < reps + 3; ++i) {
    CUDA_CHECK_OK(cudaEventRecord(start, stream));
    CUDA_CHECK_OK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK_OK(cudaEventRecord(stop, stream));
    CUDA_CHECK_OK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK_OK(cudaEventElapsedTime(&ms, start, stop));
    if (i < 3) continue;
    us.push_back(ms * 1e3 / units);
    if (after_replay) after_replay();
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us;
}

inline nlohmann::json ToJson(const Stats& s) {
  return {{"median_us", s.median}, {"p10_us", s.p10}, {"p90_us", s.p90}, {"min_us", s.min},
          {"max_us", s.max}};
}

// Device-to-device copy of 1 GiB: bytes read plus written per second, median of 20 (3 warm-up
// copies first).
inline double CopyBandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  cuda::DeviceBuffer a, b;
  BENCH_CHECK_OK(a.Reserve(bytes));
  BENCH_CHECK_OK(b.Reserve(bytes));
  CUDA_CHECK_OK(cudaMemsetAsync(a.get(), 1, bytes, stream));
  cudaEvent_t start, stop;
  CUDA_CHECK_OK(cudaEventCreate(&start));
  CUDA_CHECK_OK(cudaEventCreate(&stop));
  std::vector<double> rates;
  for (int i = 0; i < 23; ++i) {
    CUDA_CHECK_OK(cudaEventRecord(start, stream));
    CUDA_CHECK_OK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK_OK(cudaEventRecord(stop, stream));
    CUDA_CHECK_OK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK_OK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) rates.push_back(2.0 * bytes / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Summarize(rates).median;
}

// Writes the results to `path` (nothing when empty) and says so.
inline void WriteJson(const std::string& path, const nlohmann::json& out) {
  if (path.empty()) return;
  std::ofstream(path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace moe::bench

#endif  // MOE_BENCH_GPU_BENCH_UTIL_H_
