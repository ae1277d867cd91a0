// ExpertShardService: the gRPC face of one expert shard. Forward validates and stages each request
// (request.h), records load, runs it through the batching executor and answers with the token
// outputs. Placement switches (Activate) load the new version's layers while the current ones keep
// serving (a layer whose local slots hold the same experts as in a snapshot already loaded is
// shared, not reloaded), then add it atomically. Every loaded version stays accepted until the
// coordinator says older ones have drained (ReleaseBefore), up to kMaxSnapshots of them.
//
// Thread-safety: every method may be called concurrently. Ownership: borrows the WeightSource and
// the backend; owns the executor and the loaded weight snapshots.
#ifndef MOE_SERVER_SHARD_SERVICE_H_
#define MOE_SERVER_SHARD_SERVICE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/shard/admission.h"
#include "server/shard/executor.h"
#include "server/shard/load_counter.h"
#include "server/shard/placement.h"
#include "server/shard/weights.h"

namespace moe {

// Where a Forward's tensor bytes are when they do not travel inside the protobuf messages (raw
// frames, shared memory). Default: inside the messages.
struct ForwardIo {
  // The hidden-state bytes (the request's hidden_states.data.data must then be empty).
  std::optional<absl::string_view> hidden_payload;
  // Called once with the output's byte count; returns where those bytes go (exactly that many).
  // The response's output then carries dtype and shape only. Unset: response->output.data.
  std::function<absl::StatusOr<absl::Span<uint8_t>>(size_t bytes)> output_buffer;
  // Both of the above are memory of the backend's CUDA device (ExpertBackend::DeviceForTensors),
  // which the host never touches: the payload must be F32 or BF16 hidden states at an address
  // aligned for their type, and zero_device fills an output the shard has nothing to compute for
  // (no hosted slot, no token). REQUIRES: hidden_payload, output_buffer and zero_device set.
  bool device = false;
  std::function<absl::Status(absl::Span<uint8_t>)> zero_device;
};

struct ShardIdentity {
  std::string shard_id;
  std::string address;
};

class ExpertShardService final : public v1::ExpertShard::Service {
 public:
  ExpertShardService(WeightSource* source, ExpertBackend* backend, ExecutorOptions options);

  void set_identity(ShardIdentity identity) ABSL_LOCKS_EXCLUDED(mu_);
  // Quotas of Forward/ForwardStream requests (admission.h); borrowed, null: none.
  // REQUIRES: called before the service serves.
  void set_admission(AdmissionController* admission) { admission_ = admission; }

  // Snapshots (map versions) a shard holds at most; activating one more frees the oldest.
  static constexpr size_t kMaxSnapshots = 4;

  // Loads the weights of `placement`, prepares the backend, then accepts its version (and makes
  // it current when it is the newest). On error the loaded versions keep serving.
  [[nodiscard]] absl::Status Activate(std::shared_ptr<const ShardPlacement> placement);
  // Newest version whose weights are active (0 before the first Activate).
  uint64_t active_version() const;
  // Whether requests of `map_version` are served.
  bool Accepts(uint64_t map_version) const;
  // Frees the snapshots of versions older than `min_version` (never the newest one).
  void ReleaseBefore(uint64_t min_version);
  // New Forward calls get UNAVAILABLE from now on.
  void StartDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Requests waiting for the executor (metrics).
  size_t queued_requests() const { return executor_.queued_requests(); }
  // The backend the batches run on (borrowed; for RegisterHostMemory of shared-memory regions).
  ExpertBackend* backend() const { return backend_; }

  // Takes the load and executor stats counted since the last hand-off and passes them to `send`
  // (the heartbeat RPC), returning its status. The hand-off lock is held until `send` returns and
  // CollectLoad takes it too, so a coordinator collecting load while a heartbeat is in flight
  // gets the shard's answer only after that heartbeat's delta has reached it: a refreshed
  // GetLoadStats never misses counts that were on the wire. (A delta whose heartbeat failed is
  // the caller's to resend.)
  absl::Status HandOffLoad(absl::FunctionRef<absl::Status(v1::LoadDelta)> send)
      ABSL_LOCKS_EXCLUDED(handoff_mu_);

  // Forward without the gRPC wrapper: validates, runs and reports one request (the raw-buffer,
  // shared-memory and TCP-channel methods call it with their payload and output buffers in
  // `io`). `deadline`: the caller's; the executor drops the request unrun once it has passed.
  absl::Status ServeForward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                            const ForwardIo& io = ForwardIo(),
                            absl::Time deadline = absl::InfiniteFuture());
  // An admission ticket (admission.h) for one request of the client named `identity`
  // (CallerIdentity of its gRPC call); always granted when the shard has no quotas. Forward and
  // ForwardStream take one per request themselves; the other Forward paths call this first.
  absl::StatusOr<AdmissionController::Ticket> AdmitCaller(const std::string& identity);

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
    std::vector<LayerWeights> layers;  // [L]; empty when the placement hosts no slot
  };

  v1::LoadDelta TakeLoadDelta() ABSL_EXCLUSIVE_LOCKS_REQUIRED(handoff_mu_);
  // `deadline`: the call's; the executor drops the request unrun once it has passed.
  absl::Status DoForward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                         absl::Time deadline = absl::InfiniteFuture(),
                         const ForwardIo& io = ForwardIo());
  // Reports one finished Forward request to the observer, if any.
  void Observe(const v1::ForwardRequest& request, const v1::ForwardResponse& response,
               const absl::Status& status, absl::Time start) const;
  // The snapshot serving `map_version` (0: the current one); FAILED_PRECONDITION when stale.
  absl::StatusOr<std::shared_ptr<const Snapshot>> SnapshotFor(uint64_t map_version) const;
  // Layer `l` of `placement`: shared from a loaded snapshot whose local slots hold the same
  // experts, else loaded and prepared.
  absl::StatusOr<LayerWeights> LayerFor(const ShardPlacement& placement, int l)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(activate_mu_);

  WeightSource* const source_;
  ExpertBackend* const backend_;
  Executor executor_;
  ShardObserver* const observer_;  // from ExecutorOptions; may be null
  AdmissionController* admission_ = nullptr;
  LoadCounter load_;
  std::atomic<bool> draining_{false};
  absl::Mutex activate_mu_;  // serializes Activate
  absl::Mutex handoff_mu_;   // serializes load hand-offs (HandOffLoad, CollectLoad)
  mutable absl::Mutex mu_;
  // Loaded versions; the newest is current.
  std::map<uint64_t, std::shared_ptr<const Snapshot>> snapshots_ ABSL_GUARDED_BY(mu_);
  ShardIdentity identity_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SERVICE_H_
