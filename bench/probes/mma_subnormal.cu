// Probe: does mma.sync.m16n8k16 (bf16 in, fp32 accumulate) on this GPU keep subnormal bf16 inputs
// and subnormal fp32 results, or flush them to zero? The expert GEMMs decode E2M1 code 0.5 to the
// bf16 subnormal 2^-127 (fp4_fragment.h) and multiply by the block scale before the MMA; applying
// the scale to the fp32 accumulators instead needs the MMA to take that subnormal as it is.
//
//   nvcc -O2 -arch=sm_90a -o /tmp/mma_subnormal bench/probes/mma_subnormal.cu && /tmp/mma_subnormal
//
// Each case fills A with one bf16 value and B with another (every element), so every D element
// is 16 * a * b; prints what the MMA returned and what exact arithmetic gives.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

__global__ void MmaAll(uint16_t a_bits, uint16_t b_bits, float* d_out) {
  const uint32_t a = a_bits | (static_cast<uint32_t>(a_bits) << 16);
  const uint32_t b = b_bits | (static_cast<uint32_t>(b_bits) << 16);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b));
  if (threadIdx.x == 0) d_out[0] = d[0];
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main() {
  struct Case {
    const char* what;
    uint16_t a, b;
  } cases[] = {
      {"a = 2^-127 (bf16 subnormal), b = 2^100", 0x0040, 0x7180},
      {"a = 1.5 * 2^-127 (bf16 subnormal), b = 2^64", 0x0060, 0x5F80},
      {"a = 2^-126 (smallest normal), b = 2^100", 0x0080, 0x7180},
      {"a = 2^-127 (bf16 subnormal), b = 1 (fp32 result 2^-123, normal)", 0x0040, 0x3F80},
      {"a = 2^-127, b = 2^-10 (fp32 result 2^-133, subnormal)", 0x0040, 0x3A80},
      {"a = 1, b = 2^-129 (bf16 subnormal B)", 0x3F80, 0x0010},
  };
  float* d = nullptr;
  if (cudaMalloc(&d, sizeof(float)) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 1;
  }
  int bad = 0;
  for (const Case& c : cases) {
    MmaAll<<<1, 32>>>(c.a, c.b, d);
    float got = 0;
    if (cudaMemcpy(&got, d, sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
      std::printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    const double want = 16.0 * Bf16ToFloat(c.a) * Bf16ToFloat(c.b);
    const bool same = got == static_cast<float>(want);
    bad += same ? 0 : 1;
    std::printf("%-62s got %.9g want %.9g %s\n", c.what, got, want, same ? "exact" : "DIFFERS");
  }
  std::printf("%d of %zu cases differ\n", bad, sizeof(cases) / sizeof(cases[0]));
  return 0;
}
