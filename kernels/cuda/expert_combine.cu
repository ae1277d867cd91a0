// Expert combine (see expert_kernels.h): out[t, h] = sum over k of topk_weight[t, k] * y[t*K+k, h]
// for the routes that landed here, then the marked shared experts with weight 1, in that fixed
// order, in fp32; written once as F32 or BF16 (rounded to nearest even). Each thread owns four
// consecutive h of one token, so y rows are read as coalesced 16-byte vectors.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/expert_kernels.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ void AddScaled(float4& acc, float w, const float4& y) {
  acc.x += w * y.x;
  acc.y += w * y.y;
  acc.z += w * y.z;
  acc.w += w * y.w;
}

// Four consecutive y values of one row, F32 or BF16.
__device__ __forceinline__ float4 LoadY(const ExpertCombineParams& p, int64_t at) {
  if (!p.y_bf16) return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.y) + at));
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p.y) + at));
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u),
                     __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xFFFF0000u));
}

__global__ void __launch_bounds__(kThreads) ExpertCombineKernel(const ExpertCombineParams p,
                                                               int blocks_per_token) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // y comes from GEMM2
  const int64_t token = blockIdx.x / blocks_per_token;
  const int h = ((blockIdx.x % blocks_per_token) * kThreads + threadIdx.x) * 4;
  if (h >= p.hidden_size) return;
  const int64_t routes = static_cast<int64_t>(p.tokens) * p.top_k;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k = 0; k < p.top_k; ++k) {
    const int64_t route = token * p.top_k + k;
    if (p.ids[route] < 0) continue;
    AddScaled(acc, p.weights[route], LoadY(p, route * p.hidden_size + h));
  }
  if (p.shared_mask != nullptr && p.shared_mask[token] != 0) {
    for (int s = 0; s < p.num_shared; ++s) {
      const int64_t row = routes + static_cast<int64_t>(s) * p.tokens + token;
      AddScaled(acc, 1.f, LoadY(p, row * p.hidden_size + h));
    }
  }
  const int64_t at = token * p.hidden_size + h;
  if (p.out_bf16) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc.x)) |
                        (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(acc.y))) << 16);
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc.z)) |
                        (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(acc.w))) << 16);
    reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + at)[0] = make_uint2(lo, hi);
  } else {
    reinterpret_cast<float4*>(static_cast<float*>(p.out) + at)[0] = acc;
  }
}

}  // namespace

cudaError_t LaunchExpertCombine(const ExpertCombineParams& p, bool programmatic,
                                cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden_size % 4 != 0) return cudaErrorInvalidValue;
  const int blocks_per_token = (p.hidden_size / 4 + kThreads - 1) / kThreads;
  const int64_t blocks = static_cast<int64_t>(blocks_per_token) * p.tokens;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, ExpertCombineKernel, p, blocks_per_token);
}

}  // namespace moe::cuda
