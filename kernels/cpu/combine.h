// The top-k-weighted combine of the optimized CPU backend: each token's output row is the sum of
// its routes' expert outputs times their router weights, in top-k slot order, then its
// shared-expert outputs (weight 1), accumulated in fp32 and written once as F32 or BF16
// (round-to-nearest-even). The order is fixed, so results do not depend on the thread count.
//
// Called by the CPU backend. Thread-safety: threads write disjoint token rows.
#ifndef MOE_KERNELS_CPU_COMBINE_H_
#define MOE_KERNELS_CPU_COMBINE_H_

#include <cstdint>

namespace moe::cpu {

struct CombineParams {
  const float* expert_out = nullptr;  // [routes][hidden]
  int64_t hidden = 0;
  int64_t tokens = 0;
  int64_t top_k = 0;
  const int32_t* route_of = nullptr;         // [tokens][top_k]: route index or -1
  const float* weights = nullptr;            // [tokens][top_k]
  int64_t shared = 0;                        // shared experts
  const int32_t* shared_route_of = nullptr;  // [tokens][shared]: route index or -1
  float* out_f32 = nullptr;                  // exactly one of the two outputs is set
  uint16_t* out_bf16 = nullptr;
};

// Writes the rows of tokens EvenSplit(tokens, thread_index, thread_count).
void CombineRoutes(const CombineParams& p, int thread_index, int thread_count);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_COMBINE_H_
