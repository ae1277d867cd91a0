// Launch-size heuristics (numerics.md section 8). The constants come from vLLM's TRT-LLM MoE
// wrapper (chunk bound) and its FlashInfer autotuning bucket rule (8192 floor).
#include "kernels/launch.h"

#include <algorithm>

namespace moe {
namespace {

// vLLM's TRT-LLM wrapper derives its chunk bound from the 65535-block limit of a grid dimension:
// (65535 - E) * 8 / K tokens still fit.
constexpr int64_t kGridDimLimit = 65535;
constexpr int64_t kTokensPerBlock = 8;
// The wrapper's absolute cap, whatever E and K are.
constexpr int64_t kMaxChunkTokens = 300000;
// Small batches are always worth tuning and capturing.
constexpr int64_t kMinTunedTokens = 8192;

}  // namespace

int64_t MaxTokensPerLaunch(int64_t num_experts, int64_t top_k) {
  const int64_t by_grid =
      (kGridDimLimit - num_experts) * kTokensPerBlock / std::max<int64_t>(top_k, 1);
  return std::max<int64_t>(1, std::min(kMaxChunkTokens, by_grid));
}

std::vector<std::pair<int64_t, int64_t>> SplitIntoLaunchChunks(int64_t num_tokens,
                                                               int64_t num_experts, int64_t top_k) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  const int64_t limit = MaxTokensPerLaunch(num_experts, top_k);
  for (int64_t begin = 0; begin < num_tokens; begin += limit) {
    chunks.emplace_back(begin, std::min(num_tokens, begin + limit));
  }
  return chunks;
}

int64_t MaxTunedTokens(int64_t max_tokens_per_request, int64_t senders) {
  return std::max(max_tokens_per_request * senders, kMinTunedTokens);
}

}  // namespace moe
