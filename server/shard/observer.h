// ShardObserver: the hook through which the shard's hot path reports what it did (one call per
// Forward request and one per executor batch), so metrics live outside the service and executor.
//
// Called by ExpertShardService (OnForward, on RPC threads) and Executor (OnBatch, on its worker
// thread). Thread-safety: implementations must be thread-safe and cheap (a few atomic updates):
// they run on the request path. Ownership: the observer is borrowed and must outlive both.
#ifndef MOE_SERVER_SHARD_OBSERVER_H_
#define MOE_SERVER_SHARD_OBSERVER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moe {

class ShardObserver {
 public:
  virtual ~ShardObserver() = default;

  // One Forward request (unary, or one message of a stream) ended with `code` after `latency`.
  // `layer` is the request's layer field as sent (not validated when code != OK); `tokens` is the
  // number of tokens served (0 on error).
  virtual void OnForward(int64_t layer, int64_t tokens, absl::StatusCode code,
                         absl::Duration latency) = 0;

  // One executor batch of `requests` merged requests and `tokens` tokens ran for `compute`.
  virtual void OnBatch(int64_t tokens, int64_t requests, absl::Duration compute) = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_OBSERVER_H_
