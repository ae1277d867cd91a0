// Expert combine (see expert_kernels.h): out[t, h] = sum over k of topk_weight[t, k] * y[t*K+k, h]
// for the routes that landed here, then the marked shared experts with weight 1, in that fixed
// order, in fp32; written once as F32 or BF16 (rounded to nearest even). y is F32 or BF16
// (ExpertCombineParams::y_bf16). Each thread owns V consecutive h of one token (8 for BF16 y rows
// of whole 16-byte vectors, else 4), so y rows are read as coalesced vectors, and it issues the
// loads of kBatch y rows before it adds any: the kernel is bound by how many bytes are in flight.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/expert_kernels.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kBatch = 4;  // y rows loaded before the first add

__device__ __forceinline__ void Bf16x2ToFloats(uint32_t w, float* out) {
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xFFFF0000u);
}

// V consecutive y values of `row` from h on; zeros when row < 0.
template <bool kBf16, int V>
__device__ __forceinline__ void LoadY(const ExpertCombineParams& p, int64_t row, int h,
                                      float (&out)[V]) {
  if (row < 0) {
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = 0.f;
    return;
  }
  const int64_t at = row * p.hidden_size + h;
  if constexpr (!kBf16) {
#pragma unroll
    for (int v = 0; v < V; v += 4) {
      const float4 y =
          __ldcg(reinterpret_cast<const float4*>(static_cast<const float*>(p.y) + at + v));
      out[v] = y.x;
      out[v + 1] = y.y;
      out[v + 2] = y.z;
      out[v + 3] = y.w;
    }
  } else if constexpr (V == 8) {
    const uint4 y = __ldcg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.y) + at));
    Bf16x2ToFloats(y.x, out);
    Bf16x2ToFloats(y.y, out + 2);
    Bf16x2ToFloats(y.z, out + 4);
    Bf16x2ToFloats(y.w, out + 6);
  } else {
    static_assert(V == 4);
    const uint2 y = __ldcg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p.y) + at));
    Bf16x2ToFloats(y.x, out);
    Bf16x2ToFloats(y.y, out + 2);
  }
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

template <int V>
__device__ __forceinline__ void StoreOut(const ExpertCombineParams& p, int64_t at,
                                         const float (&acc)[V]) {
  if (p.out_bf16) {
    uint16_t* out = static_cast<uint16_t*>(p.out) + at;
    if constexpr (V == 8) {
      *reinterpret_cast<uint4*>(out) =
          make_uint4(PackBf16x2(acc[0], acc[1]), PackBf16x2(acc[2], acc[3]),
                     PackBf16x2(acc[4], acc[5]), PackBf16x2(acc[6], acc[7]));
    } else {
      *reinterpret_cast<uint2*>(out) =
          make_uint2(PackBf16x2(acc[0], acc[1]), PackBf16x2(acc[2], acc[3]));
    }
  } else {
    float* out = static_cast<float*>(p.out) + at;
#pragma unroll
    for (int v = 0; v < V; v += 4) {
      *reinterpret_cast<float4*>(out + v) =
          make_float4(acc[v], acc[v + 1], acc[v + 2], acc[v + 3]);
    }
  }
}

template <bool kBf16, int V>
__global__ void __launch_bounds__(kThreads) ExpertCombineKernel(const ExpertCombineParams p,
                                                               int blocks_per_token) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // y comes from GEMM2
  const int64_t token = blockIdx.x / blocks_per_token;
  const int h = ((blockIdx.x % blocks_per_token) * kThreads + threadIdx.x) * V;
  if (h >= p.hidden_size) return;
  const int64_t routes = static_cast<int64_t>(p.tokens) * p.top_k;
  const int shared = p.shared_mask != nullptr && p.shared_mask[token] != 0 ? p.num_shared : 0;
  const int terms = p.top_k + shared;  // the k routes, then the marked shared experts
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.f;
  for (int i0 = 0; i0 < terms; i0 += kBatch) {
    float w[kBatch];
    float y[kBatch][V];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j;
      int64_t row = -1;
      w[j] = 0.f;
      if (i < p.top_k) {
        const int64_t route = token * p.top_k + i;
        if (p.ids[route] >= 0) {
          row = route;
          w[j] = p.weights[route];
        }
      } else if (i < terms) {
        row = routes + static_cast<int64_t>(i - p.top_k) * p.tokens + token;
        w[j] = 1.f;
      }
      LoadY<kBf16, V>(p, row, h, y[j]);
    }
    // Terms past the end and unrouted ones add w = 0 times zeros, which leaves acc unchanged.
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += w[j] * y[j][v];
    }
  }
  StoreOut<V>(p, token * p.hidden_size + h, acc);
}

template <bool kBf16, int V>
cudaError_t Launch(const ExpertCombineParams& p, bool programmatic, cudaStream_t stream) {
  const int blocks_per_token = (p.hidden_size / V + kThreads - 1) / kThreads;
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
  return cudaLaunchKernelEx(&config, ExpertCombineKernel<kBf16, V>, p, blocks_per_token);
}

}  // namespace

cudaError_t LaunchExpertCombine(const ExpertCombineParams& p, bool programmatic,
                                cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden_size % 4 != 0) return cudaErrorInvalidValue;
  if (!p.y_bf16) return Launch<false, 4>(p, programmatic, stream);
  // 8 values per thread: 16-byte BF16 y loads, and 16-byte BF16 or 32-byte F32 stores.
  const bool wide = p.hidden_size % 8 == 0 && (reinterpret_cast<uintptr_t>(p.y) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  return wide ? Launch<true, 8>(p, programmatic, stream) : Launch<true, 4>(p, programmatic, stream);
}

}  // namespace moe::cuda
