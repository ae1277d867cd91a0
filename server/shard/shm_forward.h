// ShmForwardService: the same-host shared-memory face of an expert shard
// (proto/moe/v1/shm.proto). Forward reads the hidden states in place from a registered region
// (F32 and BF16 as they are, quantized forms decoded once), runs the request through
// ExpertShardService::ServeForward (same validation, batching, load counting and metrics as
// Forward), which writes the output straight into the region range the request named. Region
// ranges are validated by ShmRegistry.
//
// Register it beside the ExpertShardService (moe_shard does with --shared_memory; it maps
// whatever object a caller names, so only enable it where the callers are trusted local
// frontends). OpenChannel starts a request channel (shm_channel.h) over a registered region:
// one-token requests then skip gRPC entirely. Regions are registered with the shard's backend
// too (a CUDA backend pins them: large batches then skip its staging copies). ForwardCuda serves
// GPU-resident tensors of a same-host frontend through CUDA IPC handles (cuda_ipc.h): a CUDA
// backend on the handles' device reads and writes them on the GPU (F32 and BF16 hidden states);
// otherwise they are staged through host memory (one device-to-host copy in, one host-to-device
// copy out).
//
// Thread-safety: handlers run concurrently. Ownership: borrows `shard`; owns the
// registry.
#ifndef MOE_SERVER_SHARD_SHM_FORWARD_H_
#define MOE_SERVER_SHARD_SHM_FORWARD_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "moe/v1/shm.grpc.pb.h"
#include "server/shard/service.h"
#include "server/shard/cuda_ipc.h"
#include "server/shard/shm_channel.h"
#include "server/shard/shm_registry.h"

namespace moe {

class ShmForwardService final : public v1::SharedMemoryShard::Service {
 public:
  // With `pin_regions`, registered regions are also registered with the shard's backend
  // (ExpertBackend::RegisterHostMemory: a CUDA backend pins them and moves hidden states and
  // outputs straight between them and the device). With `cuda_on_device`, ForwardCuda hands a
  // CUDA backend the frontend's device memory itself (false: always staged through host memory).
  explicit ShmForwardService(ExpertShardService* shard, bool pin_regions = true,
                             bool cuda_on_device = true);

  ShmRegistry& registry() { return registry_; }

  grpc::Status RegisterSharedMemory(grpc::ServerContext* ctx,
                                    const v1::RegisterSharedMemoryRequest* request,
                                    v1::RegisterSharedMemoryResponse* response) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext* ctx,
                                      const v1::UnregisterSharedMemoryRequest* request,
                                      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::Status Forward(grpc::ServerContext* ctx, const v1::ShmForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status OpenChannel(grpc::ServerContext* ctx, const v1::OpenChannelRequest* request,
                           v1::OpenChannelResponse* response) override;
  grpc::Status CloseChannel(grpc::ServerContext* ctx, const v1::CloseChannelRequest* request,
                            v1::CloseChannelResponse* response) override;
  grpc::Status ForwardCuda(grpc::ServerContext* ctx, const v1::CudaForwardRequest* request,
                           v1::ForwardResponse* response) override;

  // Largest hidden-states or output range of one ForwardCuda.
  static constexpr uint64_t kMaxCudaIpcBytes = uint64_t{1} << 30;

  // Open channels at most (each holds a thread).
  static constexpr size_t kMaxChannels = 256;
  // Stops every channel's thread. Call before the shard service goes away (the destructor does).
  void CloseAllChannels() ABSL_LOCKS_EXCLUDED(channels_mu_);
  ~ShmForwardService() override { CloseAllChannels(); }

 private:
  absl::Status DoForward(const v1::ShmForwardRequest& request, v1::ForwardResponse* response);
  absl::Status DoForwardCuda(const v1::CudaForwardRequest& request, v1::ForwardResponse* response);
  // ForwardCuda with the frontend's device memory handed to the backend as it is.
  absl::Status ServeOnDevice(const v1::CudaForwardRequest& request,
                             const CudaIpcMemory::Borrowed& in,
                             const CudaIpcMemory::Borrowed& out, v1::ForwardResponse* response);

  ExpertShardService* const shard_;
  const bool cuda_on_device_;
  ShmRegistry registry_;
  CudaIpcMemory cuda_ipc_;
  absl::Mutex channels_mu_;
  std::map<std::string, std::unique_ptr<ShmChannelServer>> channels_ ABSL_GUARDED_BY(channels_mu_);
  uint64_t next_channel_ ABSL_GUARDED_BY(channels_mu_) = 0;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SHM_FORWARD_H_
