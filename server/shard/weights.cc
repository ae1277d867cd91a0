#include "server/shard/weights.h"

namespace moe {

int64_t ExpertWeightBytes(const ExpertWeights& expert) {
  return expert.w13.values.NumBytes() + expert.w13.scales.NumBytes() + expert.w2.values.NumBytes() +
         expert.w2.scales.NumBytes() + 3 * static_cast<int64_t>(sizeof(float)) +
         expert.b13.NumBytes() + expert.b2.NumBytes();
}

}  // namespace moe
