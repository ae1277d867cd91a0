// ExpertShardService: the gRPC face of one expert shard. Forward validates and stages each request
// (request.h), records load, runs it through the batching executor and answers with the token
// outputs; placement switches (Activate) load the new slots' weights while the current ones keep
// serving, then swap atomically; the previous version stays accepted until the next switch.
//
// Thread-safety: every method may be called concurrently. Ownership: borrows the WeightSource and
// the backend; owns the executor and the loaded weight snapshots.
#ifndef MOE_SERVER_SHARD_SERVICE_H_
#define MOE_SERVER_SHARD_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/shard/executor.h"
#include "server/shard/load_counter.h"
#include "server/shard/placement.h"
#include "server/shard/weights.h"

namespace moe {

struct ShardIdentity {
  std::string shard_id;
  std::string address;
};

class ExpertShardService final : public v1::ExpertShard::Service {
 public:
  ExpertShardService(WeightSource* source, ExpertBackend* backend, ExecutorOptions options);

  void set_identity(ShardIdentity identity) ABSL_LOCKS_EXCLUDED(mu_);

  // Loads the weights of `placement`, prepares the backend, then makes it current. On error the
  // current placement keeps serving.
  [[nodiscard]] absl::Status Activate(std::shared_ptr<const ShardPlacement> placement);
  // Version whose weights are active (0 before the first Activate).
  uint64_t active_version() const;
  // New Forward calls get UNAVAILABLE from now on.
  void StartDraining() { draining_.store(true); }

  // Takes the load and executor stats counted since the last hand-off and passes them to `send`
  // (the heartbeat RPC), returning its status. The hand-off lock is held until `send` returns and
  // CollectLoad takes it too, so a coordinator collecting load while a heartbeat is in flight
  // gets the shard's answer only after that heartbeat's delta has reached it: a refreshed
  // GetLoadStats never misses counts that were on the wire. (A delta whose heartbeat failed is
  // the caller's to resend.)
  absl::Status HandOffLoad(absl::FunctionRef<absl::Status(v1::LoadDelta)> send)
      ABSL_LOCKS_EXCLUDED(handoff_mu_);

  grpc::Status Forward(grpc::ServerContext* ctx, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status ForwardStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::ForwardResponse, v1::ForwardRequest>* stream) override;
  grpc::Status GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* request,
                       v1::ShardInfo* response) override;
  grpc::Status GetStats(grpc::ServerContext* ctx, const v1::GetStatsRequest* request,
                        v1::ShardStats* response) override;
  grpc::Status CollectLoad(grpc::ServerContext* ctx, const v1::CollectLoadRequest* request,
                           v1::LoadDelta* response) override;

 private:
  struct Snapshot {
    std::shared_ptr<const ShardPlacement> placement;
    std::shared_ptr<const LoadedWeights> weights;
  };

  v1::LoadDelta TakeLoadDelta() ABSL_EXCLUSIVE_LOCKS_REQUIRED(handoff_mu_);
  absl::Status DoForward(const v1::ForwardRequest& request, v1::ForwardResponse* response);
  // The snapshot serving `map_version` (0: the current one); FAILED_PRECONDITION when stale.
  absl::StatusOr<std::shared_ptr<const Snapshot>> SnapshotFor(uint64_t map_version) const;

  WeightSource* const source_;
  ExpertBackend* const backend_;
  Executor executor_;
  LoadCounter load_;
  std::atomic<bool> draining_{false};
  absl::Mutex activate_mu_;  // serializes Activate
  absl::Mutex handoff_mu_;   // serializes load hand-offs (HandOffLoad, CollectLoad)
  mutable absl::Mutex mu_;
  std::shared_ptr<const Snapshot> current_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Snapshot> previous_ ABSL_GUARDED_BY(mu_);
  ShardIdentity identity_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SERVICE_H_
