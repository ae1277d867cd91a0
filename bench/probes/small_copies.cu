// Probe: what does moving a one-token batch's inputs and output between pinned host memory and
// the device cost, as copy-engine copies (cudaMemcpyAsync) and as kernels that read or write the
// pinned memory directly (zero copy, through the unified address space)? The CUDA backend's Run
// at one token takes ~54 us against a ~30 us device graph (kernel_bench --backend_tokens).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/small_copies bench/probes/small_copies.cu
//   /tmp/small_copies [bytes_in] [bytes_out]
//
// Every form runs as a CUDA graph (one launch), timed two ways: device time between events
// around the launch, and host wall time from the launch to the end of cudaStreamSynchronize.
// Each form ends with the same small "compute" kernel, so the forms differ only in the moves.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe.h"

// Copies n 16-byte words (grid-stride); from and to may be host (pinned) or device memory.
__global__ void Move(const uint4* from, uint4* to, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    to[i] = from[i];
  }
}

// Stands in for the expert kernels: reads the device input, writes the device output.
__global__ void Compute(const uint4* in, uint4* out, int64_t n_in, int64_t n_out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t i = threadIdx.x; i < n_in; i += blockDim.x) {
    const uint4 v = in[i];
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  for (int64_t i = threadIdx.x; i < n_out; i += blockDim.x) out[i] = acc;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t in_bytes = argc > 1 ? std::atoll(argv[1]) : 5760 + 256;  // A: 2880 bf16 + ids
  const int64_t out_bytes = argc > 2 ? std::atoll(argv[2]) : 5760;
  const int64_t n_in = (in_bytes + 15) / 16, n_out = (out_bytes + 15) / 16;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint4 *h_in, *h_out, *d_in, *d_out;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&h_in), n_in * 16, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&h_out), n_out * 16, cudaHostAllocDefault));
  CHECK(cudaMalloc(&d_in, n_in * 16));
  CHECK(cudaMalloc(&d_out, n_out * 16));
  uint4* d_tmp;
  CHECK(cudaMalloc(&d_tmp, n_out * 16));
  const int move_blocks = static_cast<int>(std::min<int64_t>(64, (n_in + 255) / 256 + 1));
  struct Form {
    const char* name;
    std::function<void()> enqueue;
  };
  const std::vector<Form> forms = {
      {"compute only (device in and out)",
       [&] { Compute<<<1, 256, 0, s>>>(d_in, d_out, n_in, n_out); }},
      {"copy engine in + out (cudaMemcpyAsync)",
       [&] {
         CHECK(cudaMemcpyAsync(d_in, h_in, n_in * 16, cudaMemcpyHostToDevice, s));
         Compute<<<1, 256, 0, s>>>(d_in, d_out, n_in, n_out);
         CHECK(cudaMemcpyAsync(h_out, d_out, n_out * 16, cudaMemcpyDeviceToHost, s));
       }},
      {"zero copy: kernel reads pinned in, kernel writes pinned out",
       [&] {
         Move<<<move_blocks, 256, 0, s>>>(h_in, d_in, n_in);
         Compute<<<1, 256, 0, s>>>(d_in, d_out, n_in, n_out);
         Move<<<move_blocks, 256, 0, s>>>(d_out, h_out, n_out);
       }},
      {"zero copy in the compute kernel itself (reads pinned, writes pinned)",
       [&] { Compute<<<1, 256, 0, s>>>(h_in, h_out, n_in, n_out); }},
      {"copy engine in, zero copy out",
       [&] {
         CHECK(cudaMemcpyAsync(d_in, h_in, n_in * 16, cudaMemcpyHostToDevice, s));
         Compute<<<1, 256, 0, s>>>(d_in, h_out, n_in, n_out);
       }},
      {"zero copy in, copy engine out",
       [&] {
         Compute<<<1, 256, 0, s>>>(h_in, d_out, n_in, n_out);
         CHECK(cudaMemcpyAsync(h_out, d_out, n_out * 16, cudaMemcpyDeviceToHost, s));
       }},
  };
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("in %lld bytes, out %lld bytes; medians of 2000 graph launches\n",
              static_cast<long long>(in_bytes), static_cast<long long>(out_bytes));
  for (int round = 0; round < 2; ++round) {
    for (const Form& f : forms) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      f.enqueue();
      CHECK(cudaStreamEndCapture(s, &g));
      CHECK(cudaGraphInstantiate(&ge, g, 0));
      std::vector<double> dev, wall;
      for (int i = 0; i < 2100; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        CHECK(cudaEventRecord(e0, s));
        CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaStreamSynchronize(s));
        const auto t1 = std::chrono::steady_clock::now();
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 100) {
          dev.push_back(ms * 1e3);
          wall.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
      }
      std::printf("round %d  %-66s device %6.2f us  host wall %6.2f us\n", round, f.name,
                  Median(dev), Median(wall));
      CHECK(cudaGraphExecDestroy(ge));
      CHECK(cudaGraphDestroy(g));
    }
  }
  return 0;
}
