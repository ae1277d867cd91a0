// What the probes in this folder share: a CUDA error check that ends the program, and the
// median time of a captured CUDA graph. Each probe is one .cu file built by nvcc on its own
// (its header comment gives the command); this header sits beside them.
#ifndef MOE_BENCH_PROBES_PROBE_H_
#define MOE_BENCH_PROBES_PROBE_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    const cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// Captures what `enqueue` puts on `stream` into a graph, replays it `replays` + 3 times (the
// first 3 untimed) and returns the median replay time in microseconds divided by `per`.
inline double GraphMedianUs(cudaStream_t stream, const std::function<void()>& enqueue, double per,
                            int replays = 50) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int i = 0; i < replays + 3; ++i) {
    CHECK(cudaEventRecord(a, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) us.push_back(ms * 1e3 / per);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return us[us.size() / 2];
}

#endif  // MOE_BENCH_PROBES_PROBE_H_
