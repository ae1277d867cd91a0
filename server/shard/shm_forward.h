// ShmForwardService: the same-host shared-memory face of an expert shard
// (proto/moe/v1/shm.proto). Forward reads the hidden states in place from a registered region
// (converted once into the F32 staging tensor), runs the request through
// ExpertShardService::ServeForward (same validation, batching, load counting and metrics as
// Forward) and converts the output straight into the region range the request named. Region
// ranges are validated by ShmRegistry.
//
// Register it beside the ExpertShardService (moe_shard does with --shared_memory; it maps
// whatever object a caller names, so only enable it where the callers are trusted local
// frontends). Thread-safety: handlers run concurrently. Ownership: borrows `shard`; owns the
// registry.
#ifndef MOE_SERVER_SHARD_SHM_FORWARD_H_
#define MOE_SERVER_SHARD_SHM_FORWARD_H_

#include "absl/status/status.h"
#include "moe/v1/shm.grpc.pb.h"
#include "server/shard/service.h"
#include "server/shard/shm_registry.h"

namespace moe {

class ShmForwardService final : public v1::SharedMemoryShard::Service {
 public:
  explicit ShmForwardService(ExpertShardService* shard) : shard_(shard) {}

  ShmRegistry& registry() { return registry_; }

  grpc::Status RegisterSharedMemory(grpc::ServerContext* ctx,
                                    const v1::RegisterSharedMemoryRequest* request,
                                    v1::RegisterSharedMemoryResponse* response) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext* ctx,
                                      const v1::UnregisterSharedMemoryRequest* request,
                                      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::Status Forward(grpc::ServerContext* ctx, const v1::ShmForwardRequest* request,
                       v1::ForwardResponse* response) override;

 private:
  absl::Status DoForward(const v1::ShmForwardRequest& request, v1::ForwardResponse* response);

  ExpertShardService* const shard_;
  ShmRegistry registry_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SHM_FORWARD_H_
