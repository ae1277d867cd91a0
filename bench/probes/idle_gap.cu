// Probe: is the GPU slower right after the host has left it idle for a while? A shard's one-token
// Run takes 36-41 us back to back but 52-75 us when the frontend pauses 1-3 ms between calls
// (NOTES-cuda.md, "what a frontend's own work between calls costs it"). Each probe below runs
// alone after the host slept `gap` microseconds with the GPU idle, so its first instructions are
// the GPU's first work after the gap:
//   clock     the SM clock over the probe's first 20 us (clock64 against %globaltimer)
//   compute   device time (events) of a fixed FMA chain on every SM
//   memory    device time of reading 32 MB of device memory
//   zerocopy  device time of reading 4 KB and writing 4 KB of mapped pinned host memory (what the
//             backend's copy kernels do for a one-token batch), over PCIe
//   empty     host wall time from launching an empty kernel to cudaStreamSynchronize's return
// and, to tell the host's part from the GPU's, for the compute kernel: the host time inside the
// launch call, the kernel's own span on the device (%globaltimer from its first block's start to
// its last block's end), and the event time again with the host spinning through the gap instead
// of sleeping (the GPU idles the same; the host's core stays busy).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/idle_gap bench/probes/idle_gap.cu
//   /tmp/idle_gap [reps]
#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe.h"

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread: SM cycles and nanoseconds over ~20 us.
__global__ void ClockProbe(uint64_t* out) {
  const uint64_t t0 = GlobalTimerNs();
  const long long c0 = clock64();
  uint64_t t1 = t0;
  while (t1 - t0 < 20000) t1 = GlobalTimerNs();
  const long long c1 = clock64();
  out[0] = static_cast<uint64_t>(c1 - c0);
  out[1] = t1 - t0;
}

// span[0] / span[1]: the earliest block start and the latest block end (%globaltimer, ns).
__global__ void Compute(float* out, int iters, unsigned long long* span) {
  const unsigned long long t0 = GlobalTimerNs();
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (int i = 0; i < iters; ++i) a = fmaf(a, b, 1e-7f);
  if (a == 12345.f) out[0] = a;  // never true; keeps the chain
  __syncthreads();
  if (threadIdx.x == 0 && span != nullptr) {
    atomicMin(span, t0);
    atomicMax(span + 1, static_cast<unsigned long long>(GlobalTimerNs()));
  }
}

__global__ void ReadAll(const uint4* in, int64_t n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(in + i);
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if (acc.x == 0x12345678u && acc.y == 1u) sink[0] = acc;
}

__global__ void ZeroCopy(const uint4* host_in, uint4* host_out, int n) {
  const int i = threadIdx.x;
  if (i < n) host_out[i] = host_in[i];
}

__global__ void Empty() {}

void SleepUs(int us) {
  if (us <= 0) return;
  timespec ts{us / 1000000, (us % 1000000) * 1000L};
  clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, nullptr);
}

void SpinUs(int us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 40;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t* clock_out = nullptr;
  float* sink_f = nullptr;
  uint4* sink = nullptr;
  uint4* big = nullptr;
  const int64_t big_words = (int64_t{32} << 20) / 16;
  CHECK(cudaMalloc(&clock_out, 16));
  CHECK(cudaMalloc(&sink_f, 4));
  unsigned long long* span = nullptr;
  CHECK(cudaMalloc(&span, 16));
  CHECK(cudaMalloc(&sink, 16));
  CHECK(cudaMalloc(&big, big_words * 16));
  CHECK(cudaMemset(big, 1, big_words * 16));
  uint4 *pin_in = nullptr, *pin_out = nullptr;
  CHECK(cudaHostAlloc(&pin_in, 4096, cudaHostAllocMapped));
  CHECK(cudaHostAlloc(&pin_out, 4096, cudaHostAllocMapped));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const auto device_us = [&](auto launch) {
    CHECK(cudaEventRecord(e0, s));
    launch();
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3 * ms;
  };
  // Warm-up: every kernel once.
  for (int i = 0; i < 3; ++i) {
    ClockProbe<<<1, 1, 0, s>>>(clock_out);
    Compute<<<sms, 256, 0, s>>>(sink_f, 4096, nullptr);
    ReadAll<<<sms * 4, 512, 0, s>>>(big, big_words, sink);
    ZeroCopy<<<1, 256, 0, s>>>(pin_in, pin_out, 256);
    Empty<<<1, 1, 0, s>>>();
  }
  CHECK(cudaStreamSynchronize(s));
  const int gaps[] = {0, 100, 300, 1000, 3000, 10000};
  std::printf("gap_us  clock_MHz  compute_us  memory_us  zerocopy_us  empty_launch_us  "
              "compute_launch_call_us  compute_on_device_us  compute_us_host_spinning  "
              "empty_launch_us_host_spinning  (medians of %d)\n",
              reps);
  for (int gap : gaps) {
    std::vector<double> mhz, compute, memory, zerocopy, empty, launch_call, on_device, compute_spin,
        empty_spin;
    for (int r = 0; r < reps; ++r) {
      SleepUs(gap);
      ClockProbe<<<1, 1, 0, s>>>(clock_out);
      CHECK(cudaStreamSynchronize(s));
      uint64_t c[2];
      CHECK(cudaMemcpy(c, clock_out, 16, cudaMemcpyDeviceToHost));
      mhz.push_back(1e3 * static_cast<double>(c[0]) / static_cast<double>(c[1]));
      SleepUs(gap);
      compute.push_back(device_us([&] { Compute<<<sms, 256, 0, s>>>(sink_f, 4096, nullptr); }));
      const unsigned long long span_init[2] = {~0ull, 0ull};
      CHECK(cudaMemcpy(span, span_init, 16, cudaMemcpyHostToDevice));
      SleepUs(gap);
      const auto l0 = std::chrono::steady_clock::now();
      Compute<<<sms, 256, 0, s>>>(sink_f, 4096, span);
      launch_call.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - l0).count());
      CHECK(cudaStreamSynchronize(s));
      unsigned long long got[2];
      CHECK(cudaMemcpy(got, span, 16, cudaMemcpyDeviceToHost));
      on_device.push_back(1e-3 * static_cast<double>(got[1] - got[0]));
      SpinUs(gap);
      compute_spin.push_back(
          device_us([&] { Compute<<<sms, 256, 0, s>>>(sink_f, 4096, nullptr); }));
      SpinUs(gap);
      const auto t1 = std::chrono::steady_clock::now();
      Empty<<<1, 1, 0, s>>>();
      CHECK(cudaStreamSynchronize(s));
      empty_spin.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t1).count());
      SleepUs(gap);
      memory.push_back(device_us([&] { ReadAll<<<sms * 4, 512, 0, s>>>(big, big_words, sink); }));
      SleepUs(gap);
      zerocopy.push_back(device_us([&] { ZeroCopy<<<1, 256, 0, s>>>(pin_in, pin_out, 256); }));
      SleepUs(gap);
      const auto t0 = std::chrono::steady_clock::now();
      Empty<<<1, 1, 0, s>>>();
      CHECK(cudaStreamSynchronize(s));
      empty.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    CHECK(cudaGetLastError());
    std::printf("%6d  %9.0f  %10.2f  %9.2f  %11.2f  %15.2f  %22.2f  %20.2f  %24.2f  %29.2f\n", gap,
                Median(mhz), Median(compute), Median(memory), Median(zerocopy), Median(empty),
                Median(launch_call), Median(on_device), Median(compute_spin), Median(empty_spin));
    std::fflush(stdout);
  }
  return 0;
}
