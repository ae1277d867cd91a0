// Launch-size heuristics shared by every backend (numerics.md section 8): splitting a huge batch
// into chunks whose grid fits the hardware limit, and the token bound that autotuning and CUDA
// graph buckets cover. Pure host functions, unit-tested without a GPU.
#ifndef MOE_KERNELS_LAUNCH_H_
#define MOE_KERNELS_LAUNCH_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace moe {

// min(300000, (65535 - E) * 8 / K), at least 1. REQUIRES: E >= 1, K >= 1.
int64_t MaxTokensPerLaunch(int64_t num_experts, int64_t top_k);

// [begin, end) token ranges covering [0, num_tokens), each at most MaxTokensPerLaunch long;
// empty for num_tokens == 0.
std::vector<std::pair<int64_t, int64_t>> SplitIntoLaunchChunks(int64_t num_tokens,
                                                               int64_t num_experts, int64_t top_k);

// max(max_tokens_per_request * senders, 8192): the largest batch tuned and graph-captured.
int64_t MaxTunedTokens(int64_t max_tokens_per_request, int64_t senders);

}  // namespace moe

#endif  // MOE_KERNELS_LAUNCH_H_
