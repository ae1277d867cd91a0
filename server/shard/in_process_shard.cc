#include "server/shard/in_process_shard.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {

absl::StatusOr<std::unique_ptr<InProcessShard>> InProcessShard::Start(
    const InProcessShardOptions& options) {
  std::unique_ptr<InProcessShard> shard(new InProcessShard());
  absl::StatusOr<std::unique_ptr<ModelWeightSource>> source =
      ModelWeightSource::Open(options.model_dir);
  if (!source.ok()) return source.status();
  shard->source_ = *std::move(source);
  absl::StatusOr<std::unique_ptr<ExpertBackend>> backend = CreateBackend(options.backend, /*cuda_device=*/0, options.cuda_concurrent_runs);
  if (!backend.ok()) return backend.status();
  shard->backend_ = *std::move(backend);
  ExecutorOptions executor;
  executor.max_batch_tokens = options.max_batch_tokens;
  executor.max_batch_wait = options.max_batch_wait;
  executor.overlap_min_tokens = options.overlap_min_tokens;
  executor.observer = options.observer;
  shard->service_ = std::make_unique<ExpertShardService>(shard->source_.get(),
                                                         shard->backend_.get(), executor);
  shard->admission_ = std::make_unique<AdmissionController>(options.admission);
  shard->service_->set_admission(shard->admission_.get());
  const ServedModel& model = shard->source_->model();
  if (absl::Status s = shard->service_->Activate(
          ShardPlacement::Standalone(model.num_layers, model.num_experts, 1));
      !s.ok()) {
    return s;
  }
  shard->raw_ = std::make_unique<RawForwardService>(shard->service_.get(), options.raw_buffers);
  shard->shm_ =
      std::make_unique<ShmForwardService>(shard->service_.get(), options.pin_shared_memory,
                                          options.forward_cuda_on_device);
  if (options.tcp_channel) {
    TcpChannelOptions tcp;
    tcp.max_payload_bytes = options.max_message_bytes;
    tcp.buffers = options.raw_buffers;
    tcp.spin = options.tcp_channel_spin;
    tcp.tls = options.tcp_channel_tls;
    absl::StatusOr<std::unique_ptr<TcpChannelService>> started =
        TcpChannelService::Start(shard->service_.get(), tcp);
    if (!started.ok()) return started.status();
    shard->tcp_ = *std::move(started);
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(shard->service_.get());
  builder.RegisterService(shard->raw_.get());
  builder.RegisterService(shard->shm_.get());
  if (shard->tcp_ != nullptr) builder.RegisterService(shard->tcp_.get());
  shard->server_ = builder.BuildAndStart();
  if (shard->server_ == nullptr || port == 0) {
    return absl::UnavailableError("in-process shard: cannot listen on 127.0.0.1");
  }
  shard->address_ = absl::StrCat("127.0.0.1:", port);
  shard->service_->set_identity({"in-process", shard->address_});
  return shard;
}

InProcessShard::~InProcessShard() {
  if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  if (tcp_ != nullptr) tcp_->Stop();
}

}  // namespace moe
