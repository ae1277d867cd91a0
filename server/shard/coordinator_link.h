// CoordinatorLink: a shard's connection to the coordinator. It registers (retrying until the
// coordinator answers), follows WatchClusterMap, and heartbeats with the shard's ready map version
// and its load delta. A delta whose heartbeat fails is kept and sent with the next one, so no
// recorded load is lost.
//
// For each map it sees it activates, on the service, the current version and then the pending one
// of a placement switch (loading their weights while the loaded versions keep serving), frees
// versions older than min_accepted_version, and when the map says this shard is DRAINED stops
// serving and calls the on-drained callback.
//
// Thread-safety: Start/Stop from one thread; runs two internal threads. Ownership: borrows the
// service, which must outlive the link.
#ifndef MOE_SERVER_SHARD_COORDINATOR_LINK_H_
#define MOE_SERVER_SHARD_COORDINATOR_LINK_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "server/shard/service.h"

namespace moe {

class CoordinatorLink {
 public:
  CoordinatorLink(std::string coordinator, v1::RegisterShardRequest registration,
                  ExpertShardService* service);
  ~CoordinatorLink();

  // Registers (retrying for up to `wait`), then starts the watch and heartbeat threads.
  [[nodiscard]] absl::Status Start(absl::Duration wait);
  // Sends a last heartbeat (flushing load) and stops the threads.
  void Stop();
  // Called once, from the watch thread, when the coordinator reports this shard drained (e.g. to
  // mark the health service NOT_SERVING). REQUIRES: called before Start.
  void set_on_drained(std::function<void()> on_drained) { on_drained_ = std::move(on_drained); }

 private:
  absl::Status Register();
  void WatchLoop();
  void HeartbeatLoop();
  absl::Status SendHeartbeat();
  // Activates what `map` asks of this shard; whether anything new was activated.
  bool ApplyMap(const v1::ClusterMap& map, uint32_t rank);
  bool ActivateVersion(const v1::ClusterMap& map, uint32_t rank);

  const std::string coordinator_;
  const v1::RegisterShardRequest registration_;
  ExpertShardService* const service_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::string shard_id_ ABSL_GUARDED_BY(mu_);
  uint32_t rank_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Milliseconds(500);
  bool heartbeat_now_ ABSL_GUARDED_BY(mu_) = false;
  v1::LoadDelta unsent_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientContext> watch_ctx_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_drained_;
  bool drained_ = false;  // watch thread only
  std::thread watcher_;
  std::thread heartbeater_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_COORDINATOR_LINK_H_
