// CoordinatorLink: a shard's connection to the coordinator. It registers (retrying until the
// coordinator answers), follows WatchClusterMap and activates each new placement on the service,
// and heartbeats with the shard's ready map version and its load delta. A delta whose heartbeat
// fails is kept and sent with the next one, so no recorded load is lost.
//
// Thread-safety: Start/Stop from one thread; runs two internal threads. Ownership: borrows the
// service, which must outlive the link.
#ifndef MOE_SERVER_SHARD_COORDINATOR_LINK_H_
#define MOE_SERVER_SHARD_COORDINATOR_LINK_H_

#include <atomic>
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

 private:
  absl::Status Register();
  void WatchLoop();
  void HeartbeatLoop();
  absl::Status SendHeartbeat();

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
  std::thread watcher_;
  std::thread heartbeater_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_COORDINATOR_LINK_H_
