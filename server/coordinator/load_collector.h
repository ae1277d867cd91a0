// Pulls the load the shards counted since their last collection (ExpertShard.CollectLoad), in
// parallel, over one cached channel per shard address.
//
// Called by CoordinatorService.GetLoadStats when the caller asks for a refresh.
// Thread-safety: thread-safe; concurrent CollectAll calls share the channel cache.
// Ownership: owns the channels; the targets are copied.
#ifndef MOE_SERVER_COORDINATOR_LOAD_COLLECTOR_H_
#define MOE_SERVER_COORDINATOR_LOAD_COLLECTOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "moe/v1/shard.pb.h"
#include "server/coordinator/cluster_state.h"

namespace moe {

struct CollectedLoad {
  ShardTarget target;
  // The shard's delta, or why it could not be collected.
  absl::StatusOr<v1::LoadDelta> delta;
};

class LoadCollector {
 public:
  // `timeout` bounds each CollectLoad call; `max_message_bytes` sizes the channels' receive limit.
  LoadCollector(absl::Duration timeout, int max_message_bytes);

  LoadCollector(const LoadCollector&) = delete;
  LoadCollector& operator=(const LoadCollector&) = delete;

  // Calls every target at once and returns when all have answered or timed out; one result per
  // target, in the targets' order. A failing shard only fails its own entry.
  std::vector<CollectedLoad> CollectAll(const std::vector<ShardTarget>& targets);

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);

  const absl::Duration timeout_;
  const int max_message_bytes_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_LOAD_COLLECTOR_H_
