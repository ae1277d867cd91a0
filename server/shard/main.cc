// moe_shard: one expert-shard server (one per GPU, or a CPU shard).
#include <algorithm>
#include <climits>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend.h"
#include "server/common/large_buffers.h"
#include "server/common/security_flags.h"
#include "server/shard/admission.h"
#include "server/shard/coordinator_link.h"
#include "server/shard/model_source.h"
#include "server/shard/raw_forward.h"
#include "server/shard/service.h"
#include "server/shard/shm_forward.h"
#include "server/shard/tcp_channel.h"
#include "server/shard/shard_metrics.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory: config.json + safetensors (required)");
ABSL_FLAG(std::string, coordinator, "",
          "coordinator host:port; empty runs standalone, hosting every expert (map version 1)");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to listen on");
ABSL_FLAG(int, port, 0, "port to listen on; 0 picks a free one (see --port_file)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving starts");
ABSL_FLAG(std::string, backend, "auto", "auto | cpu | cpu-reference | cuda");
ABSL_FLAG(int, cuda_device, 0,
          "CUDA device of a cuda (or auto) backend, numbered as this process sees the devices "
          "(under CUDA_VISIBLE_DEVICES); one shard per GPU: 0, 1, ... or one device per process");
ABSL_FLAG(int, cuda_concurrent_runs, 0,
          "batches a cuda backend runs at once, each on its own stream and buffers, so that one "
          "batch's host work overlaps another's kernels (1..8; 0: the backend's default, 2)");
ABSL_FLAG(int, rank, -1, "rank to request from the coordinator; -1 takes any free rank");
ABSL_FLAG(int64_t, max_batch_tokens, 8192, "token budget of one merged executor batch");
ABSL_FLAG(int, max_batch_wait_us, 0,
          "how long the executor waits for more requests of the same layer (0: merge only what "
          "is already queued)");
ABSL_FLAG(int64_t, overlap_min_tokens, moe::kDefaultOverlapMinTokens,
          "with --cuda_concurrent_runs > 1: another batch of a layer whose batch is running "
          "starts on a free lane only once that layer's queued requests hold this many tokens "
          "(or --max_batch_tokens); fewer wait to merge into its next batch. 0: at once");
ABSL_FLAG(int, drain_seconds, 10, "on SIGTERM: how long in-flight calls may take to finish");
ABSL_FLAG(int, register_wait_seconds, 60, "how long to keep trying to reach the coordinator");
ABSL_FLAG(int, metrics_port, 0,
          "Prometheus /metrics HTTP port: 0 picks a free one (logged; see --metrics_port_file), "
          "-1 turns metrics off");
ABSL_FLAG(bool, shared_memory, false,
          "serve moe.v1.SharedMemoryShard (same-host frontends register POSIX shm regions; the "
          "shard maps any object a caller names, so enable it only for trusted local callers)");
ABSL_FLAG(bool, pin_shared_memory, true,
          "with --shared_memory: also register each region with the backend (a CUDA backend "
          "pins it, up to 16 GiB in all, and reads hidden states and writes outputs of 256 KB and "
          "more in place instead of through its staging buffer)");
ABSL_FLAG(bool, forward_cuda_on_device, true,
          "with --shared_memory and --backend cuda: ForwardCuda's F32/BF16 hidden states and "
          "output stay on the GPU (false: staged through host memory, as with a CPU backend)");
ABSL_FLAG(bool, tcp_channel, false,
          "also serve direct TCP request channels (moe.v1.TcpChannelShard): a frontend gets a "
          "ticket over gRPC, then sends Forward frames over a socket of its own, without gRPC per "
          "request; with --tls_cert the data connection speaks TLS with that certificate, "
          "otherwise it is plaintext");
ABSL_FLAG(int, tcp_channel_port, 0,
          "with --tcp_channel: the channel port on --host (0 picks a free one; clients learn it "
          "from OpenTcpChannel)");
ABSL_FLAG(int, raw_buffer_pool_mb, 256,
          "ForwardRaw and TCP channels: MiB of idle payload and output buffers kept for reuse (a CUDA backend pins "
          "them once and moves them to and from the GPU without staging copies); 0 keeps none");
ABSL_FLAG(int, tcp_channel_spin_us,
          static_cast<int>(absl::ToInt64Microseconds(moe::kTcpChannelDefaultSpin)),
          "with --tcp_channel: microseconds a connection's thread polls for the next request "
          "after each answer before it sleeps, when that connection's previous request came "
          "within that time (saves the thread's wake-up for a frontend that sends again soon; a "
          "core is busy while it polls); 0: never poll");
ABSL_FLAG(int, tcp_channel_max_connections, 256,
          "with --tcp_channel: most data connections open at once (each holds a thread); more "
          "are refused with RESOURCE_EXHAUSTED, or closed under TLS (MoeClient then uses gRPC "
          "calls)");
ABSL_FLAG(std::string, metrics_port_file, "", "write the bound metrics port to this file");
ABSL_FLAG(std::string, http_host, "127.0.0.1", "address the metrics HTTP endpoint listens on");
ABSL_FLAG(int, max_connection_age_seconds, 300,
          "close each client connection (GOAWAY) after this long so that clients re-resolve and "
          "see new pods behind a DNS name; 0 keeps connections forever");
ABSL_FLAG(int, max_inflight_per_client, 0,
          "Forward requests one client (token name, else peer address) may have in flight; more "
          "get RESOURCE_EXHAUSTED (0: unlimited)");
ABSL_FLAG(int, max_inflight_total, 0,
          "Forward requests in flight (queued or running) in total; more get RESOURCE_EXHAUSTED "
          "(0: unlimited)");

namespace moe {
namespace {

struct ShardOptions {
  std::string model, coordinator, host, port_file, backend;
  int port = 0, rank = -1, drain_seconds = 10, register_wait_seconds = 60, cuda_device = 0;
  int cuda_concurrent_runs = 0;
  int max_connection_age_seconds = 300;
  ExecutorOptions executor;
  HttpEndpointOptions metrics;
  AdmissionOptions admission;
  HostBufferPoolOptions raw_buffers;
  bool tcp_channel = false;
  int tcp_channel_port = 0;
  int tcp_channel_spin_us = 0;
  int tcp_channel_max_connections = 256;
};

ShardOptions OptionsFromFlags() {
  ShardOptions o;
  o.model = absl::GetFlag(FLAGS_model);
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.port_file = absl::GetFlag(FLAGS_port_file);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  o.cuda_concurrent_runs = absl::GetFlag(FLAGS_cuda_concurrent_runs);
  o.rank = absl::GetFlag(FLAGS_rank);
  o.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  o.register_wait_seconds = absl::GetFlag(FLAGS_register_wait_seconds);
  o.max_connection_age_seconds = absl::GetFlag(FLAGS_max_connection_age_seconds);
  o.admission.max_inflight_per_client = absl::GetFlag(FLAGS_max_inflight_per_client);
  o.admission.max_inflight_total = absl::GetFlag(FLAGS_max_inflight_total);
  o.executor.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.executor.max_batch_wait = absl::Microseconds(absl::GetFlag(FLAGS_max_batch_wait_us));
  o.executor.overlap_min_tokens = absl::GetFlag(FLAGS_overlap_min_tokens);
  o.tcp_channel = absl::GetFlag(FLAGS_tcp_channel);
  o.tcp_channel_port = absl::GetFlag(FLAGS_tcp_channel_port);
  o.tcp_channel_spin_us = absl::GetFlag(FLAGS_tcp_channel_spin_us);
  o.tcp_channel_max_connections = absl::GetFlag(FLAGS_tcp_channel_max_connections);
  o.raw_buffers.max_idle_bytes =
      static_cast<size_t>(std::max(absl::GetFlag(FLAGS_raw_buffer_pool_mb), 0)) << 20;
  o.metrics = {absl::GetFlag(FLAGS_http_host), absl::GetFlag(FLAGS_metrics_port),
               absl::GetFlag(FLAGS_metrics_port_file)};
  return o;
}

// Blocks SIGTERM/SIGINT in every thread created after this call so one sigwait sees them.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

int Run(const ShardOptions& o) {
  const sigset_t stop_signals = BlockStopSignals();
  if (o.model.empty()) {
    LOG(ERROR) << "--model is required (a directory with config.json and safetensors; "
                  "`moectl gen-model --out DIR` writes one)";
    return 2;
  }
  if (o.tcp_channel_spin_us < 0 || o.tcp_channel_spin_us > 1000000) {
    LOG(ERROR) << "--tcp_channel_spin_us=" << o.tcp_channel_spin_us
               << ": must be in [0, 1000000] (microseconds)";
    return 2;
  }
  if (o.executor.overlap_min_tokens < 0) {
    LOG(ERROR) << "--overlap_min_tokens=" << o.executor.overlap_min_tokens
               << ": must be 0 or more";
    return 2;
  }
  if (o.tcp_channel_max_connections < 1 || o.tcp_channel_max_connections > 65536) {
    LOG(ERROR) << "--tcp_channel_max_connections=" << o.tcp_channel_max_connections
               << ": must be in [1, 65536]";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<ModelWeightSource>> source = ModelWeightSource::Open(o.model);
  if (!source.ok()) {
    LOG(ERROR) << "cannot open model " << o.model << ": " << source.status();
    return 1;
  }
  absl::StatusOr<std::unique_ptr<ExpertBackend>> backend = CreateBackend(o.backend, o.cuda_device, o.cuda_concurrent_runs);
  if (!backend.ok()) {
    LOG(ERROR) << backend.status();
    return 1;
  }
  if (absl::Status s = ValidateHttpEndpoint(o.metrics, "--metrics_port"); !s.ok()) {
    LOG(ERROR) << s;
    return 2;
  }
  // The metrics observe the executor, so they exist before the service; their endpoint scrapes
  // the service, so it is declared after it (and destroyed before it).
  std::unique_ptr<ShardMetrics> metrics;
  ExecutorOptions executor_options = o.executor;
  if (o.metrics.port != kHttpPortOff) {
    metrics = std::make_unique<ShardMetrics>((*source)->model().num_layers,
                                             std::string((*backend)->name()), (*backend)->device());
    executor_options.observer = metrics.get();
  }
  ExpertShardService service(source->get(), backend->get(), executor_options);
  AdmissionController admission(o.admission);
  service.set_admission(&admission);
  // TLS/mTLS and tokens for this server and for the link to the coordinator.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFromFlags();
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status();
    return 2;
  }
  if (absl::Status s = InstallClientSecurityFromFlags(); !s.ok()) {
    LOG(ERROR) << s;
    return 2;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(o.host, ":", o.port), *credentials, &port);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.SetMaxSendMessageSize(256 << 20);
  if (o.max_connection_age_seconds > 0) {
    // In-flight calls keep their connection (the age grace stays unlimited); new calls reconnect.
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               std::min(o.max_connection_age_seconds, INT_MAX / 1000) * 1000);
  }
  builder.RegisterService(&service);
  // ForwardRaw (server/common/raw_frame.h): the same Forward without protobuf copies of tensors.
  RawForwardService raw_forward(&service, o.raw_buffers);
  builder.RegisterService(&raw_forward);
  ShmForwardService shm_forward(&service, absl::GetFlag(FLAGS_pin_shared_memory),
                                absl::GetFlag(FLAGS_forward_cuda_on_device));
  if (absl::GetFlag(FLAGS_shared_memory)) builder.RegisterService(&shm_forward);
  std::unique_ptr<TcpChannelService> tcp_channel;
  if (o.tcp_channel) {
    TcpChannelOptions tcp;
    tcp.host = o.host;
    tcp.port = o.tcp_channel_port;
    tcp.buffers = o.raw_buffers;
    tcp.spin = absl::Microseconds(o.tcp_channel_spin_us);
    tcp.max_connections = static_cast<size_t>(o.tcp_channel_max_connections);
    // With a TLS certificate the channels speak TLS too.
    absl::StatusOr<std::shared_ptr<const TlsContext>> tls = TcpChannelTlsFromFlags();
    if (!tls.ok()) {
      LOG(ERROR) << tls.status();
      return 2;
    }
    tcp.tls = *std::move(tls);
    absl::StatusOr<std::unique_ptr<TcpChannelService>> started =
        TcpChannelService::Start(&service, tcp);
    if (!started.ok()) {
      LOG(ERROR) << started.status();
      return 1;
    }
    tcp_channel = *std::move(started);
    builder.RegisterService(tcp_channel.get());
    LOG(INFO) << "tcp channels on " << o.host << ":" << tcp_channel->port()
              << (tcp.tls != nullptr ? " (TLS, the gRPC port's certificate)"
                                     : " (data connections are not encrypted)");
  }
  // Declared after what it scrapes (the service, the TCP channels), so destroyed before them.
  std::unique_ptr<MetricsEndpoint> metrics_endpoint;
  if (metrics != nullptr) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
        metrics->Serve(o.metrics, &service, tcp_channel.get());
    if (!endpoint.ok()) {
      LOG(ERROR) << endpoint.status();
      return 1;
    }
    metrics_endpoint = *std::move(endpoint);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    LOG(ERROR) << "cannot listen on " << o.host << ":" << o.port;
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(false);  // NOT_SERVING until weights are loaded
  const std::string address = absl::StrCat(o.host, ":", port);
  LOG(INFO) << "moe_shard listening on " << address << " (backend " << (*backend)->name() << ", "
            << (*backend)->device() << ")";
  if (!o.port_file.empty()) std::ofstream(o.port_file) << port << "\n";

  const ServedModel& model = (*source)->model();
  std::unique_ptr<CoordinatorLink> link;
  if (o.coordinator.empty()) {
    service.set_identity({"standalone", address});
    if (absl::Status s =
            service.Activate(ShardPlacement::Standalone(model.num_layers, model.num_experts, 1));
        !s.ok()) {
      LOG(ERROR) << "cannot load weights: " << s;
      return 1;
    }
  } else {
    v1::RegisterShardRequest reg;
    reg.set_address(address);
    reg.set_backend(std::string((*backend)->name()));
    reg.set_device((*backend)->device());
    reg.set_requested_rank(o.rank);
    v1::ModelShape* shape = reg.mutable_model();
    shape->set_fingerprint(model.fingerprint);
    shape->set_num_layers(model.num_layers);
    shape->set_num_experts(model.num_experts);
    shape->set_top_k(model.top_k);
    shape->set_hidden_size(static_cast<uint32_t>(model.hidden));
    shape->set_intermediate_size(static_cast<uint32_t>(model.intermediate));
    // What moving one expert costs, for the coordinator's rebalance plans.
    absl::StatusOr<int64_t> expert_bytes = (*source)->ExpertBytes();
    if (!expert_bytes.ok()) {
      LOG(ERROR) << "cannot load expert 0 of layer 0: " << expert_bytes.status();
      return 1;
    }
    shape->set_expert_bytes(static_cast<uint64_t>(*expert_bytes));
    link = std::make_unique<CoordinatorLink>(o.coordinator, reg, &service);
    // A drained shard stops serving; its health says so.
    link->set_on_drained([health] { health->SetServingStatus(false); });
    if (absl::Status s = link->Start(absl::Seconds(o.register_wait_seconds)); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
  }
  // Serving once weights are active; the health status tracks that from a small waiter thread.
  // It is joined before shutdown: detached, it could outlive `service` and `server` when a stop
  // signal came soon after start-up (it crashed the process on exit).
  // With a coordinator, weights become active only from a map the coordinator published after
  // this shard registered (CoordinatorLink::Start registers before it watches), so SERVING means
  // registered and loaded: what a Kubernetes gRPC readiness probe needs.
  absl::Notification stop_ready_watch;
  std::thread ready_watch([&service, &stop_ready_watch, health] {
    while (service.active_version() == 0) {
      if (stop_ready_watch.WaitForNotificationWithTimeout(absl::Milliseconds(20))) return;
    }
    health->SetServingStatus(true);
  });

  int sig = 0;
  sigwait(&stop_signals, &sig);
  LOG(INFO) << "signal " << sig << ": draining";
  stop_ready_watch.Notify();
  ready_watch.join();
  health->SetServingStatus(false);
  service.StartDraining();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(o.drain_seconds)));
  shm_forward.CloseAllChannels();  // their threads call into `service`, which goes next
  if (tcp_channel != nullptr) tcp_channel->Stop();  // as do these
  if (link) link->Stop();
  LOG(INFO) << "moe_shard stopped";
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "moe_shard --model DIR [--coordinator HOST:PORT] [--port N] [--backend auto|cpu|cuda]\n"
      "Serves the expert layers of an MoE model for the slots the coordinator assigns (or every\n"
      "expert when run without a coordinator).");
  moe::ListServerFlagsInHelp();
  absl::ParseCommandLine(argc, argv);
  // Per-request tensors are megabytes: keep them in the heap instead of fresh mmaps.
  moe::TuneAllocatorForLargeBuffers();
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // A crash prints its signal and stack to the log before the process dies.
  google::InstallFailureSignalHandler();
  return moe::Run(moe::OptionsFromFlags());
}
