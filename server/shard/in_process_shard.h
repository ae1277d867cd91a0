// InProcessShard: an expert shard (ExpertShardService, RawForwardService, ShmForwardService,
// TcpChannelService) served by a gRPC server inside the calling process, standalone (every
// expert, map version 1), on 127.0.0.1 port 0. For tests and benchmarks that want the real
// service without a child process (bench/rpc_bench, raw_forward_test, tcp_channel_test).
//
// Thread-safety: the accessors are const after Start; the server serves concurrently.
// Ownership: owns the weight source, backend, services and server; the destructor shuts the
// server down (in-flight calls finish) before freeing the rest.
#ifndef MOE_SERVER_SHARD_IN_PROCESS_SHARD_H_
#define MOE_SERVER_SHARD_IN_PROCESS_SHARD_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/shard/admission.h"
#include "server/shard/model_source.h"
#include "server/shard/observer.h"
#include "server/shard/raw_forward.h"
#include "server/shard/service.h"
#include "server/shard/shm_forward.h"
#include "server/shard/tcp_channel.h"

namespace moe {

struct InProcessShardOptions {
  std::string model_dir;               // checkpoint directory (server/model/generator.h writes one)
  std::string backend = "cpu-reference";
  int cuda_concurrent_runs = 0;  // CreateBackend's (moe_shard --cuda_concurrent_runs)
  int64_t max_message_bytes = 256 << 20;  // receive and send limit (moe_shard's)
  int64_t max_batch_tokens = 8192;
  absl::Duration max_batch_wait = absl::ZeroDuration();  // ExecutorOptions::max_batch_wait
  int64_t overlap_min_tokens = kDefaultOverlapMinTokens;  // ExecutorOptions::overlap_min_tokens
  // Told about every Forward and executor batch (ShardObserver); borrowed, may be null, must
  // outlive the shard.
  ShardObserver* observer = nullptr;
  // Shared-memory regions registered with the backend too (ShmForwardService's pin_regions),
  // and ForwardCuda's device memory handed to a CUDA backend as it is (its cuda_on_device).
  bool pin_shared_memory = true;
  bool forward_cuda_on_device = true;
  // ForwardRaw's reused payload and output buffers (RawForwardService).
  HostBufferPoolOptions raw_buffers;
  // Also serve direct TCP channels (TcpChannelService) on 127.0.0.1, port 0.
  bool tcp_channel = true;
  absl::Duration tcp_channel_spin = kTcpChannelDefaultSpin;  // TcpChannelOptions::spin
  std::shared_ptr<const TlsContext> tcp_channel_tls;  // TcpChannelOptions::tls (null: plaintext)
  // Per-client and total bounds on Forward requests in flight (admission.h); zeros: none.
  AdmissionOptions admission;
};

class InProcessShard {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<InProcessShard>> Start(
      const InProcessShardOptions& options);
  ~InProcessShard();

  const std::string& address() const { return address_; }
  const ServedModel& model() const { return source_->model(); }
  ExpertShardService& service() { return *service_; }
  ShmForwardService& shm() { return *shm_; }
  // Null unless InProcessShardOptions::tcp_channel.
  TcpChannelService* tcp() { return tcp_.get(); }
  // The shard's admission controller (its bounds: InProcessShardOptions::admission).
  AdmissionController& admission() { return *admission_; }
  // The backend the shard runs its batches on (benchmarks read its counters).
  const ExpertBackend& backend() const { return *backend_; }

 private:
  InProcessShard() = default;

  std::unique_ptr<ModelWeightSource> source_;
  std::unique_ptr<ExpertBackend> backend_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<ExpertShardService> service_;
  std::unique_ptr<RawForwardService> raw_;
  std::unique_ptr<ShmForwardService> shm_;
  std::unique_ptr<TcpChannelService> tcp_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_IN_PROCESS_SHARD_H_
