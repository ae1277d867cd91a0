// rpc_bench: transport cost of a shard Forward (performance.md, transport section): the protobuf
// `bytes` path, the raw-buffer ForwardRaw path, the same-host shared-memory Forward and the
// shared-memory request channel (no gRPC call per request), against an in-process shard on
// loopback.
//
// By default compute is excluded: every route is -1 (no expert hosted for it), so the shard
// validates, stages (BF16 hidden states in place), counts load and writes zero rows into the
// output's final place without a GEMM; what is measured is transport + staging. With
// --routes=uniform every token goes to top_k distinct experts drawn uniformly (8 routings per
// client, cycled, so a GPU's L2 does not keep one request's weights for the next), and the
// experts run on --backend: the served latency of a real layer (--experts, --intermediate,
// --top_k, --format shape the generated model; `--backend cuda` on the GPU machine). Sweep:
// payload 1 token .. 64 MiB of BF16 hidden states (H = --hidden), 1 .. 64 concurrent clients
// (each with its own connection; clients * payload is capped by --max_inflight_mib). Reported per
// case: p50/p99 latency at the client; the shard's own p50 per Forward (from the start of its
// handler to the answer, ShardObserver::OnForward) and per executor batch (the backend Run,
// OnBatch), so that client - shard = transport and shard - batch = validation, staging and load
// counting; requests per batch; effective GB/s = (request payload + response payload bytes) *
// calls / wall time. The ceiling, measured in the same run: raw TCP loopback throughput of one
// connection pushing 64 MiB buffers.
//
// `bazel run -c opt //bench:rpc_bench` writes bench/results/rpc_bench_<date>.json.
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/raw_forward.h"
#include "client/shm_channel.h"
#include "client/tcp_channel.h"
#include "glog/logging.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "moe/v1/shard.grpc.pb.h"
#include "moe/v1/shm.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "server/common/large_buffers.h"
#include "server/common/tcp_channel_frame.h"
#include "server/common/tcp_stream.h"
#include "server/common/tls.h"
#include "server/model/generator.h"
#include "server/shard/in_process_shard.h"

ABSL_FLAG(std::string, out_json, "", "JSON output (default bench/results/rpc_bench_<date>.json)");
ABSL_FLAG(int64_t, hidden, 2048, "hidden size H of the generated model (BF16: 2H bytes/token)");
ABSL_FLAG(std::string, tokens, "1,16,256,1024,4096,16384", "tokens per request, comma-separated");
ABSL_FLAG(std::string, clients, "1,4,16,64", "concurrent clients, comma-separated");
ABSL_FLAG(std::string, modes, "proto,raw,tcp,shm,channel",
          "proto (Forward), raw (ForwardRaw), tcp (direct TCP channel: ForwardRaw's bytes as "
          "frames on a socket of its own, no gRPC call per request), shm "
          "(SharedMemoryShard.Forward), channel (shared-memory request channel: no gRPC call per "
          "request), stream (ForwardStream: "
          "one request and its response per call on a bidirectional stream opened once per "
          "client), cuda (SharedMemoryShard.ForwardCuda from a second process whose hidden "
          "states and output are its own device memory, shared by CUDA IPC handles; one client "
          "only; needs a GPU), ping (GetInfo: a small "
          "unary call with no payload and no executor, the gRPC floor of this host)");
ABSL_FLAG(std::string, cuda_client, "",
          "internal: run as the cuda mode's client process against this shard address (with "
          "--cuda_client_tokens, --seconds and the request shape flags), print one result line");
ABSL_FLAG(int64_t, cuda_client_tokens, 1, "internal: tokens per request of the cuda client");
ABSL_FLAG(bool, cuda_on_device, true,
          "cuda mode: the shard hands a CUDA backend the client's device memory as it is "
          "(false: ForwardCuda staged through host memory)");
ABSL_FLAG(bool, pin_shm, true,
          "register the clients' shared-memory regions with the backend too (a CUDA backend "
          "pins them and reads and writes large batches in place; false: staged copies)");
ABSL_FLAG(std::string, shard_address, "",
          "benchmark this running shard (host:port; a standalone moe_shard) instead of an "
          "in-process one: requests follow the model it reports (GetInfo), the shard-side columns "
          "stay 0, and shm, channel and cuda modes need it on this host");
ABSL_FLAG(int64_t, tcp_spin_us, -1,
          "tcp mode: how long the client polls for an answer before it blocks (TcpChannel::"
          "set_spin); -1 keeps the default");
ABSL_FLAG(int64_t, shard_tcp_spin_us, -1,
          "tcp mode, in-process shard: how long a connection's thread may poll for the next "
          "request after an answer (TcpChannelOptions::spin, moe_shard --tcp_channel_spin_us); "
          "-1 keeps the default");
ABSL_FLAG(std::string, tcp_tls_dir, "",
          "tcp mode, in-process shard: serve the channels in TLS with DIR/cert.pem and "
          "DIR/key.pem (a certificate for IP 127.0.0.1), the clients verifying it as their CA; "
          "empty: plaintext. E.g. openssl req -x509 -newkey ec -pkeyopt "
          "ec_paramgen_curve:prime256v1 -nodes -keyout key.pem -out cert.pem -days 1 -subj /CN=b "
          "-addext subjectAltName=IP:127.0.0.1");
ABSL_FLAG(int64_t, raw_pool_mib, 256,
          "raw mode: MiB of idle ForwardRaw payload/output buffers the shard keeps (registered "
          "with a CUDA backend); 0: fresh, unregistered buffers per call (staged copies)");
ABSL_FLAG(std::string, model_dir, "",
          "use the checkpoint in this directory, generating it there first when it has no "
          "config.json (kept afterwards); empty: a temporary directory, removed at exit");
ABSL_FLAG(std::string, think_us, "0",
          "microseconds each client sleeps between its calls, comma-separated (each value a case "
          "of its own; not the cuda mode): a frontend's own work between two layers, during which "
          "the shard's threads go idle, so the figures include their wake-ups");
ABSL_FLAG(int64_t, max_batch_tokens, 1 << 20,
          "in-process shard: token budget of one merged executor batch (moe_shard "
          "--max_batch_tokens); the tokens per request turns cross-request batching off");
ABSL_FLAG(int64_t, max_batch_wait_us, 0,
          "in-process shard: how long the executor may wait for more requests before running an "
          "under-budget batch (moe_shard --max_batch_wait_us)");
ABSL_FLAG(int64_t, overlap_min_tokens, -1,
          "in-process shard's executor: queued tokens of a running layer that start another of "
          "its batches on a free lane (moe_shard --overlap_min_tokens); -1: its default (128)");
ABSL_FLAG(double, seconds, 1.0, "timed seconds per case (at least 3 calls per client)");
ABSL_FLAG(int64_t, max_inflight_mib, 128, "skip cases where clients * payload exceeds this");
ABSL_FLAG(std::string, backend, "cpu",
          "shard backend (what moe_shard --backend=auto picks without a GPU; no expert runs)");
ABSL_FLAG(int, cuda_concurrent_runs, 0,
          "batches the shard's cuda backend runs at once (moe_shard --cuda_concurrent_runs; 0: "
          "its default)");
ABSL_FLAG(bool, tune_allocator, true, "raise glibc's mmap threshold (as moe_shard does)");
ABSL_FLAG(std::string, routes, "none",
          "none: every route -1 (transport + staging only); uniform: top_k distinct experts per "
          "token drawn uniformly, run on --backend");
ABSL_FLAG(int64_t, experts, 8, "experts of the generated model's layer");
ABSL_FLAG(int64_t, top_k, 2, "experts per token of the generated model");
ABSL_FLAG(int64_t, layers, 1,
          "layers the clients spread over (client i sends layer i % layers; the generated model "
          "has that many): requests of different layers never merge into one batch, and with "
          "--cuda_concurrent_runs > 1 their batches run at once");
ABSL_FLAG(int64_t, intermediate, 64, "expert intermediate size I of the generated model");
ABSL_FLAG(std::string, format, "mxfp4",
          "weight format of the generated model: mxfp4 (gpt-oss layout, SWIGLUOAI with biases) "
          "or nvfp4 (ModelOpt layout, SiLU)");
ABSL_FLAG(int64_t, channel_spin_us, -1,
          "channel mode: microseconds the client polls for the answer before its futex wait "
          "(ShmChannel::set_spin); -1 keeps the library default (kShmChannelSpin), 0 never polls");

namespace moe {
namespace {

// The clients' TLS roots for --tcp_tls_dir (its cert.pem), loaded once; null without it.
std::shared_ptr<const TlsContext> ClientTls() {
  static const std::shared_ptr<const TlsContext>* const tls = [] {
    auto* out = new std::shared_ptr<const TlsContext>();
    if (const std::string dir = absl::GetFlag(FLAGS_tcp_tls_dir); !dir.empty()) {
      absl::StatusOr<std::shared_ptr<const TlsContext>> ctx =
          TcpTlsClientFromFile(dir + "/cert.pem");
      if (!ctx.ok()) {
        std::fprintf(stderr, "rpc_bench: --tcp_tls_dir: %s\n", ctx.status().ToString().c_str());
        std::exit(1);
      }
      *out = *std::move(ctx);
    }
    return out;
  }();
  return *tls;
}

// Routings per client with --routes=uniform (cycled call by call).
constexpr int kRoutings = 8;

// What every client's requests look like (the model's shape and how routes are drawn).
struct RequestShape {
  int64_t hidden = 0;
  int64_t top_k = 0;
  int64_t experts = 0;
  bool routed = false;  // --routes=uniform
  int64_t layers = 1;    // --layers
  int64_t layer = 0;     // the layer a client's requests go to
};

struct Case {
  std::string mode;
  int64_t tokens = 0;
  int clients = 0;
  int64_t think_us = 0;  // pause after each call (not timed)
};

struct CaseResult {
  Case c;
  int64_t payload_bytes = 0;   // request hidden states (= response output: BF16 [T, H] both)
  int64_t calls = 0;
  int64_t errors = 0;
  std::string first_error;
  double wall_s = 0, p50_us = 0, p99_us = 0, mean_us = 0, effective_gbps = 0;
  double tokens_per_s = 0;  // all clients' tokens answered per second of the timed window
  // The shard's side (BenchObserver) over the timed window.
  double shard_p50_us = 0, batch_p50_us = 0, requests_per_batch = 0;
  int64_t batches = 0;
  // CUDA backend: Runs that moved hidden states or output straight from or to a registered
  // shared-memory region (CudaBackendCounters::direct_runs), warm-up included.
  int64_t direct_runs = 0;
  // CUDA backend: mean host time per backend Run of the timed window in each step of
  // CudaBackendCounters (prepare, copy_in, enqueue, copy_out_submit, wait, copy_out_host; empty
  // for another backend).
  nlohmann::json run_steps_us = nlohmann::json::object();
};

// The shard's own timings: every Forward's latency inside the shard and every executor batch's
// backend time, collected between Reset and Take.
class BenchObserver final : public ShardObserver {
 public:
  void OnForward(int64_t, int64_t, absl::StatusCode code, absl::Duration latency) override {
    if (code != absl::StatusCode::kOk) return;
    absl::MutexLock lock(&mu_);
    forward_us_.push_back(absl::ToDoubleMicroseconds(latency));
  }
  void OnBatch(int64_t, int64_t requests, absl::Duration compute) override {
    absl::MutexLock lock(&mu_);
    batch_us_.push_back(absl::ToDoubleMicroseconds(compute));
    batch_requests_ += requests;
  }
  void Reset() {
    absl::MutexLock lock(&mu_);
    forward_us_.clear();
    batch_us_.clear();
    batch_requests_ = 0;
  }
  struct Taken {
    std::vector<double> forward_us, batch_us;
    int64_t batch_requests = 0;
  };
  Taken Take() {
    absl::MutexLock lock(&mu_);
    Taken t{std::move(forward_us_), std::move(batch_us_), batch_requests_};
    forward_us_.clear();
    batch_us_.clear();
    batch_requests_ = 0;
    return t;
  }

 private:
  absl::Mutex mu_;
  std::vector<double> forward_us_ ABSL_GUARDED_BY(mu_);
  std::vector<double> batch_us_ ABSL_GUARDED_BY(mu_);
  int64_t batch_requests_ ABSL_GUARDED_BY(mu_) = 0;
};

// Header of a request of `t` tokens, its routes all -1 (no compute) or, when shape.routed,
// shape.top_k distinct experts per token drawn from `rng` with equal weights; and its payload.
v1::ForwardRequest MakeHeader(int64_t t, const RequestShape& shape, std::mt19937_64& rng,
                              std::string* payload) {
  const int64_t hidden = shape.hidden, top_k = shape.top_k;
  v1::ForwardRequest req;
  req.set_layer(static_cast<uint32_t>(shape.layer));
  req.set_map_version(1);
  req.set_output_dtype(v1::BF16);
  v1::HiddenStates* hs = req.mutable_hidden_states();
  hs->set_format(v1::ACTIVATION_BF16);
  hs->mutable_data()->set_dtype(v1::BF16);
  hs->mutable_data()->add_shape(t);
  hs->mutable_data()->add_shape(hidden);
  payload->assign(static_cast<size_t>(t * hidden * 2), '\0');
  for (size_t i = 0; i < payload->size(); i += 2) (*payload)[i + 1] = 0x3f;  // BF16 ~0.5..1
  std::vector<int32_t> ids(t * top_k, -1);
  std::vector<float> w(t * top_k, 0.f);
  if (shape.routed) {
    std::vector<int32_t> all(static_cast<size_t>(shape.experts));
    for (int64_t e = 0; e < shape.experts; ++e) all[e] = static_cast<int32_t>(e);
    for (int64_t i = 0; i < t; ++i) {
      // A partial Fisher-Yates shuffle: the first top_k are distinct and uniform.
      for (int64_t k = 0; k < top_k; ++k) {
        std::uniform_int_distribution<int64_t> pick(k, shape.experts - 1);
        std::swap(all[k], all[pick(rng)]);
        ids[i * top_k + k] = all[k];
        w[i * top_k + k] = 1.f / static_cast<float>(top_k);
      }
    }
  }
  v1::Tensor* ti = req.mutable_topk_ids();
  ti->set_dtype(v1::I32);
  ti->add_shape(t);
  ti->add_shape(top_k);
  ti->set_data(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  v1::Tensor* tw = req.mutable_topk_weights();
  tw->set_dtype(v1::F32);
  tw->add_shape(t);
  tw->add_shape(top_k);
  tw->set_data(std::string(reinterpret_cast<const char*>(w.data()), w.size() * 4));
  return req;
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per client
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// One client: a call function bound to its channel and request.
class Client {
 public:
  Client(const std::string& mode, const std::string& address, int64_t t,
         const RequestShape& shape, uint64_t seed)
      : raw_(mode == "raw"), shm_(mode == "shm"), shm_channel_(mode == "channel"),
        ping_(mode == "ping"), stream_(mode == "stream"), tcp_(mode == "tcp"),
        channel_(NewChannel(address)),
        stub_(v1::ExpertShard::NewStub(channel_)),
        shm_stub_(v1::SharedMemoryShard::NewStub(channel_)) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < (shape.routed ? kRoutings : 1); ++i) {
      headers_.push_back(MakeHeader(t, shape, rng, &payload_));
    }
    if (shm_) {
      SetUpSharedMemory();
    } else if (shm_channel_) {
      absl::StatusOr<std::unique_ptr<ShmChannel>> c = ShmChannel::Open(channel_, 2 * payload_.size());
      if (!c.ok()) {
        std::fprintf(stderr, "rpc_bench: channel: %s\n", c.status().ToString().c_str());
        std::exit(1);
      }
      shm_channel_client_ = *std::move(c);
      if (const int64_t spin = absl::GetFlag(FLAGS_channel_spin_us); spin >= 0) {
        shm_channel_client_->set_spin(absl::Microseconds(spin));
      }
      std::memcpy(shm_channel_client_->data().data(), payload_.data(), payload_.size());
      for (const v1::ForwardRequest& header : headers_) {
        v1::ShmForwardRequest& r = shm_requests_.emplace_back();
        *r.mutable_request() = header;
        r.mutable_hidden_states()->set_length(payload_.size());
        r.mutable_output()->set_offset(payload_.size());
        r.mutable_output()->set_length(payload_.size());
      }
    } else if (tcp_) {
      absl::StatusOr<std::unique_ptr<TcpChannel>> c =
          TcpChannel::Open(channel_.get(), "127.0.0.1", absl::Seconds(10), ClientTls(),
                           /*require_tls=*/ClientTls() != nullptr);
      if (!c.ok()) {
        std::fprintf(stderr, "rpc_bench: tcp channel: %s\n", c.status().ToString().c_str());
        std::exit(1);
      }
      tcp_channel_ = *std::move(c);
      if (const int64_t spin = absl::GetFlag(FLAGS_tcp_spin_us); spin >= 0) {
        tcp_channel_->set_spin(absl::Microseconds(spin));
      }
    } else if (!raw_) {
      for (const v1::ForwardRequest& header : headers_) {
        v1::ForwardRequest& full = fulls_.emplace_back(header);
        full.mutable_hidden_states()->mutable_data()->set_data(payload_);
      }
    }
    if (stream_) {
      stream_ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Hours(1)));
      stream_rw_ = stub_->ForwardStream(&stream_ctx_);
    }
  }

  // Calls a warm-up needs: every routing twice (a CUDA backend captures a shape's graph at its
  // second sighting).
  int WarmUpCalls() const { return 2 * static_cast<int>(headers_.size()); }
  ~Client() {
    if (stream_rw_ != nullptr) {
      stream_rw_->WritesDone();
      (void)stream_rw_->Finish();
    }
    if (shm_base_ == nullptr) return;
    munmap(shm_base_, 2 * payload_.size());
    shm_unlink(shm_key_.c_str());
    // The shard unmaps its side at exit; unregistering here would race nothing but costs a call.
  }

  // One call; OK only when the output has the expected size.
  absl::Status Call() {
    const size_t v = next_++ % headers_.size();
    if (shm_channel_) {
      v1::ForwardResponse response;
      return shm_channel_client_->Forward(shm_requests_[v], &response, absl::Seconds(60));
    }
    if (stream_) {
      v1::ForwardResponse response;
      if (!stream_rw_->Write(fulls_[v]) || !stream_rw_->Read(&response)) {
        return absl::UnavailableError("ForwardStream ended");
      }
      return CheckSize(response.output().data().size());
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    if (ping_) {
      v1::ShardInfo info;
      grpc::Status s = stub_->GetInfo(&ctx, v1::GetInfoRequest(), &info);
      if (!s.ok()) return absl::UnknownError(absl::StrCat(s.error_code(), ": ", s.error_message()));
      return absl::OkStatus();
    }
    if (shm_) {
      v1::ForwardResponse response;
      grpc::Status s = shm_stub_->Forward(&ctx, shm_requests_[v], &response);
      if (!s.ok()) return absl::UnknownError(absl::StrCat(s.error_code(), ": ", s.error_message()));
      return absl::OkStatus();
    }
    if (tcp_) {
      output_.resize(payload_.size());
      absl::StatusOr<v1::ForwardResponse> r = tcp_channel_->Forward(
          headers_[v], payload_,
          absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(output_.data()), output_.size()),
          absl::Seconds(60));
      return r.status();
    }
    if (raw_) {
      // The output lands in the caller's own buffer (what a frontend does with its next layer's
      // input), copied once out of the received slices.
      output_.resize(payload_.size());
      absl::StatusOr<v1::ForwardResponse> r = ForwardRawInto(
          channel_.get(), &ctx, headers_[v], payload_,
          absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(output_.data()), output_.size()));
      if (!r.ok()) return r.status();
      return absl::OkStatus();
    }
    v1::ForwardResponse response;
    grpc::Status s = stub_->Forward(&ctx, fulls_[v], &response);
    if (!s.ok()) return absl::UnknownError(absl::StrCat(s.error_code(), ": ", s.error_message()));
    return CheckSize(response.output().data().size());
  }

 private:
  absl::Status CheckSize(size_t n) const {
    if (n == payload_.size()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("output of ", n, " bytes, expected ", payload_.size()));
  }

  // A region of [hidden | output] holding this client's payload, registered with the shard.
  void SetUpSharedMemory() {
    static std::atomic<int> next{0};
    const int n = next.fetch_add(1);
    shm_key_ = absl::StrCat("/rpc_bench_", getpid(), "_", n);
    const size_t bytes = 2 * payload_.size();
    const int fd = shm_open(shm_key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      std::perror("rpc_bench: shm_open");
      std::exit(1);
    }
    shm_base_ = static_cast<char*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    std::memcpy(shm_base_, payload_.data(), payload_.size());
    v1::RegisterSharedMemoryRequest reg;
    reg.set_region_id(shm_key_);
    reg.set_shm_key(shm_key_);
    reg.set_byte_size(bytes);
    v1::RegisterSharedMemoryResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    if (grpc::Status s = shm_stub_->RegisterSharedMemory(&ctx, reg, &ignored); !s.ok()) {
      std::fprintf(stderr, "rpc_bench: register: %s\n", s.error_message().c_str());
      std::exit(1);
    }
    for (const v1::ForwardRequest& header : headers_) {
      v1::ShmForwardRequest& r = shm_requests_.emplace_back();
      *r.mutable_request() = header;
      for (auto [ref, offset] : {std::pair{r.mutable_hidden_states(), size_t{0}},
                                 std::pair{r.mutable_output(), payload_.size()}}) {
        ref->set_region_id(shm_key_);
        ref->set_offset(offset);
        ref->set_length(payload_.size());
      }
    }
  }

  const bool raw_, shm_, shm_channel_, ping_, stream_, tcp_;
  std::unique_ptr<ShmChannel> shm_channel_client_;
  std::unique_ptr<TcpChannel> tcp_channel_;
  std::string output_;  // raw and tcp modes: the caller's output buffer, reused
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ExpertShard::Stub> stub_;
  std::unique_ptr<v1::SharedMemoryShard::Stub> shm_stub_;
  // stream mode: the client's one ForwardStream (its context must outlive it).
  grpc::ClientContext stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> stream_rw_;
  std::vector<v1::ShmForwardRequest> shm_requests_;  // one per routing (shm, channel)
  std::string shm_key_;
  char* shm_base_ = nullptr;
  std::vector<v1::ForwardRequest> headers_;  // one per routing
  std::vector<v1::ForwardRequest> fulls_;    // proto: headers_ with the payload inline
  std::string payload_;
  size_t next_ = 0;
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + i, v.end());
  return v[i];
}

// The backend's direct Runs so far (0 for a shard in another process: backend null).
int64_t DirectRuns(const ExpertBackend* backend) {
  return backend != nullptr ? GetCudaBackendCounters(*backend).direct_runs : 0;
}

CudaBackendCounters Counters(const ExpertBackend* backend) {
  return backend != nullptr ? GetCudaBackendCounters(*backend) : CudaBackendCounters{};
}

// The shard's side of a case (BenchObserver since its Reset, the backend's direct Runs since
// `direct_before`, its step times since `window`, taken at that Reset) into `r`.
void TakeShardSide(BenchObserver& observer, const ExpertBackend* backend, int64_t direct_before,
                   const CudaBackendCounters& window, CaseResult& r) {
  const CudaBackendCounters now = Counters(backend);
  const int64_t runs = (now.eager_runs - window.eager_runs) +
                       (now.graph_captures - window.graph_captures) +
                       (now.graph_replays - window.graph_replays);
  if (runs > 0) {
    const auto mean_us = [runs](int64_t after, int64_t before) {
      return static_cast<double>(after - before) / static_cast<double>(runs) / 1e3;
    };
    r.run_steps_us = {{"runs", runs},
                      {"prepare", mean_us(now.prepare_ns, window.prepare_ns)},
                      {"copy_in", mean_us(now.copy_in_ns, window.copy_in_ns)},
                      {"enqueue", mean_us(now.enqueue_ns, window.enqueue_ns)},
                      {"copy_out_submit", mean_us(now.copy_out_submit_ns, window.copy_out_submit_ns)},
                      {"wait", mean_us(now.wait_ns, window.wait_ns)},
                      {"copy_out_host", mean_us(now.copy_out_host_ns, window.copy_out_host_ns)}};
  }
  BenchObserver::Taken taken = observer.Take();
  r.shard_p50_us = Percentile(taken.forward_us, 0.5);
  r.batch_p50_us = Percentile(taken.batch_us, 0.5);
  r.batches = static_cast<int64_t>(taken.batch_us.size());
  r.requests_per_batch =
      r.batches > 0 ? static_cast<double>(taken.batch_requests) / static_cast<double>(r.batches) : 0;
  r.direct_runs = DirectRuns(backend) - direct_before;
}

// The cuda mode's client process: the same requests as a Client of that many tokens (seed of
// client 0), hidden states and output in its own device memory shared through CUDA IPC handles;
// warms up, calls ForwardCuda for `seconds`, prints "calls errors p50 p99 mean" on one line and
// the first error on the next. Returns the exit status.
int RunCudaClient(const std::string& address, int64_t t, const RequestShape& shape,
                  double seconds) {
  std::mt19937_64 rng(1000003 * (t + 1));
  std::string payload;
  std::vector<v1::ForwardRequest> headers;
  for (int i = 0; i < (shape.routed ? kRoutings : 1); ++i) {
    headers.push_back(MakeHeader(t, shape, rng, &payload));
  }
  const size_t bytes = payload.size();  // BF16 in, BF16 out
  void* d_in = cuda::DeviceAlloc(std::max<size_t>(bytes, 1));
  void* d_out = cuda::DeviceAlloc(std::max<size_t>(bytes, 1));
  if (d_in == nullptr || d_out == nullptr || !cuda::CopyAnyBytes(d_in, payload.data(), bytes)) {
    std::printf("0 1 0 0 0\ncannot allocate or fill device memory\n");
    return 1;
  }
  const std::string in_handle = cuda::IpcHandleOf(d_in), out_handle = cuda::IpcHandleOf(d_out);
  std::vector<v1::CudaForwardRequest> requests;
  for (const v1::ForwardRequest& header : headers) {
    v1::CudaForwardRequest& r = requests.emplace_back();
    *r.mutable_request() = header;
    r.mutable_hidden_states()->set_handle(in_handle);
    r.mutable_hidden_states()->set_length(bytes);
    r.mutable_output()->set_handle(out_handle);
    r.mutable_output()->set_length(bytes);
  }
  auto stub = v1::SharedMemoryShard::NewStub(NewChannel(address));
  int64_t errors = 0;
  std::string first_error;
  const auto call = [&](size_t i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::ForwardResponse response;
    const grpc::Status s = stub->ForwardCuda(&ctx, requests[i % requests.size()], &response);
    if (!s.ok() && errors++ == 0) first_error = s.error_message();
    return s.ok();
  };
  for (size_t i = 0; i < 2 * requests.size(); ++i) call(i);  // warm-up (graph captures)
  errors = 0;
  std::vector<double> us;
  const absl::Time stop = absl::Now() + absl::Seconds(seconds);
  for (size_t i = 0; us.size() + errors < 3 || absl::Now() < stop; ++i) {
    const absl::Time t0 = absl::Now();
    if (call(i)) us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  double sum = 0;
  for (double v : us) sum += v;
  const double mean = us.empty() ? 0 : sum / static_cast<double>(us.size());
  const size_t calls = us.size();
  const double p50 = Percentile(us, 0.5), p99 = Percentile(us, 0.99);
  std::printf("%zu %lld %.3f %.3f %.3f\n%s\n", calls, static_cast<long long>(errors), p50, p99,
              mean, first_error.c_str());
  cuda::DeviceFree(d_in);
  cuda::DeviceFree(d_out);
  return 0;
}

// The cuda mode: runs RunCudaClient in a second process (this binary again) and reads its line.
CaseResult RunCudaCase(const Case& c, const std::string& address, const RequestShape& shape,
                       double seconds, BenchObserver& observer, const ExpertBackend* backend) {
  CaseResult r;
  r.c = c;
  r.payload_bytes = c.tokens * shape.hidden * 2;
  const int64_t direct_before = DirectRuns(backend);
  const std::string command = absl::StrCat(
      "/proc/", getpid(), "/exe --cuda_client=", address, " --cuda_client_tokens=", c.tokens,
      " --seconds=", seconds, " --hidden=", shape.hidden, " --top_k=", shape.top_k,
      " --experts=", shape.experts, " --routes=", shape.routed ? "uniform" : "none");
  observer.Reset();  // the client's 16 warm-up calls are counted too
  const CudaBackendCounters window = Counters(backend);
  const absl::Time start = absl::Now();
  FILE* child = popen(command.c_str(), "r");
  if (child == nullptr) {
    r.errors = 1;
    r.first_error = "cannot start the cuda client process";
    return r;
  }
  char line[4096] = {};
  double p50 = 0, p99 = 0, mean = 0;
  long long calls = 0, errors = 0;
  if (std::fgets(line, sizeof(line), child) == nullptr ||
      std::sscanf(line, "%lld %lld %lf %lf %lf", &calls, &errors, &p50, &p99, &mean) != 5) {
    errors = std::max(errors, 1LL);
    r.first_error = "the cuda client process printed no result";
  } else if (std::fgets(line, sizeof(line), child) != nullptr) {
    r.first_error = std::string(absl::StripTrailingAsciiWhitespace(line));
  }
  if (pclose(child) != 0 && r.first_error.empty()) r.first_error = "the cuda client process failed";
  r.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  r.calls = calls;
  r.errors = errors;
  r.p50_us = p50;
  r.p99_us = p99;
  r.mean_us = mean;
  r.effective_gbps = seconds > 0 ? 2.0 * r.payload_bytes * calls / seconds / 1e9 : 0;
  r.tokens_per_s = seconds > 0 ? static_cast<double>(r.c.tokens) * calls / seconds : 0;
  TakeShardSide(observer, backend, direct_before, window, r);
  return r;
}

CaseResult RunCase(const Case& c, const std::string& address, const RequestShape& shape,
                   double seconds, BenchObserver& observer, const ExpertBackend* backend) {
  if (c.mode == "cuda") return RunCudaCase(c, address, shape, seconds, observer, backend);
  const int64_t direct_before = DirectRuns(backend);
  CaseResult r;
  r.c = c;
  r.payload_bytes = c.tokens * shape.hidden * 2;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < c.clients; ++i) {
    RequestShape own = shape;
    own.layer = i % shape.layers;
    clients.push_back(std::make_unique<Client>(c.mode, address, c.tokens, own,
                                               /*seed=*/1000003 * (c.tokens + 1) + i));
  }
  absl::Mutex mu;
  std::vector<double> latencies_us;
  std::atomic<int> warm{0};
  absl::Notification go;
  absl::Time start, end;
  std::vector<std::thread> threads;
  for (int i = 0; i < c.clients; ++i) {
    threads.emplace_back([&, i] {
      Client& client = *clients[i];
      // Connect and warm up outside the timed window.
      for (int w = 0; w < client.WarmUpCalls(); ++w) (void)client.Call();
      warm.fetch_add(1);
      go.WaitForNotification();
      std::vector<double> mine;
      int64_t errors = 0;
      std::string first_error;
      const absl::Time stop = start + absl::Seconds(seconds);
      while (mine.size() + errors < 3 || absl::Now() < stop) {
        const absl::Time t0 = absl::Now();
        absl::Status s = client.Call();
        const absl::Time t1 = absl::Now();
        if (s.ok()) {
          mine.push_back(absl::ToDoubleMicroseconds(t1 - t0));
        } else if (errors++ == 0) {
          first_error = s.ToString();
        }
        if (c.think_us > 0) absl::SleepFor(absl::Microseconds(c.think_us));
      }
      absl::MutexLock lock(&mu);
      latencies_us.insert(latencies_us.end(), mine.begin(), mine.end());
      r.errors += errors;
      if (r.first_error.empty()) r.first_error = first_error;
      end = std::max(end, absl::Now());
    });
  }
  while (warm.load() < c.clients) absl::SleepFor(absl::Milliseconds(1));
  observer.Reset();
  const CudaBackendCounters window = Counters(backend);
  start = absl::Now();
  end = start;
  go.Notify();
  for (std::thread& t : threads) t.join();
  TakeShardSide(observer, backend, direct_before, window, r);
  r.calls = static_cast<int64_t>(latencies_us.size());
  r.wall_s = absl::ToDoubleSeconds(end - start);
  double sum = 0;
  for (double v : latencies_us) sum += v;
  r.mean_us = r.calls > 0 ? sum / r.calls : 0;
  r.p50_us = Percentile(latencies_us, 0.5);
  r.p99_us = Percentile(latencies_us, 0.99);
  r.effective_gbps = r.wall_s > 0 ? 2.0 * r.payload_bytes * r.calls / r.wall_s / 1e9 : 0;
  r.tokens_per_s = r.wall_s > 0 ? static_cast<double>(r.c.tokens) * r.calls / r.wall_s : 0;
  return r;
}

// Two connected loopback TCP sockets with TCP_NODELAY; {-1, -1} on failure.
std::pair<int, int> LoopbackPair() {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("rpc_bench: tcp listener");
    if (listener >= 0) close(listener);
    return {-1, -1};
  }
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  // The kernel completes the handshake from the backlog, so accept after connect does not block.
  if (client < 0 || connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::perror("rpc_bench: tcp connect");
    close(listener);
    if (client >= 0) close(client);
    return {-1, -1};
  }
  const int server = accept(listener, nullptr, nullptr);
  close(listener);
  const int one = 1;
  setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return {client, server};
}

// Blocking socket transfers (server/common/tcp_channel_frame.h) as bools.
bool ReadFully(int fd, char* p, int64_t n) {
  return ReadExactly(fd, p, static_cast<size_t>(n), absl::InfiniteFuture()).ok();
}

bool WriteFully(int fd, const char* p, int64_t n) {
  iovec iov{const_cast<char*>(p), static_cast<size_t>(n)};
  return WriteAll(fd, &iov, 1, absl::InfiniteFuture()).ok();
}

// Raw TCP loopback: one connection, a writer pushing `buffer_bytes` buffers `rounds` times and a
// reader draining them; GB/s of payload moved (one direction), the transport ceiling.
double TcpLoopbackGbps(int64_t buffer_bytes, int rounds) {
  const auto [client, server] = LoopbackPair();
  if (client < 0) return 0;
  const int64_t total = buffer_bytes * rounds;
  std::thread reader([fd = server, total] {
    std::vector<char> buf(4 << 20);
    int64_t got = 0;
    while (got < total) {
      const ssize_t n = read(fd, buf.data(), buf.size());
      if (n <= 0) break;
      got += n;
    }
  });
  const std::vector<char> buffer(buffer_bytes, 1);
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < rounds; ++i) {
    if (!WriteFully(client, buffer.data(), buffer_bytes)) break;
  }
  reader.join();  // the reader has everything: the time is end to end
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  close(client);
  close(server);
  return static_cast<double>(total) / s / 1e9;
}

// Raw TCP loopback round trip: `bytes` to an echo thread and back, blocking reads on both sides
// (what any request/response transport over TCP pays at least); median us over `rounds`.
double TcpRoundTripUs(int64_t bytes, int rounds) {
  const auto [client, server] = LoopbackPair();
  if (client < 0) return 0;
  std::thread echo([fd = server, bytes, rounds] {
    std::vector<char> buf(bytes);
    for (int i = 0; i < rounds; ++i) {
      if (!ReadFully(fd, buf.data(), bytes) || !WriteFully(fd, buf.data(), bytes)) break;
    }
  });
  std::vector<char> buf(bytes, 1);
  std::vector<double> us;
  for (int i = 0; i < rounds; ++i) {
    const absl::Time t0 = absl::Now();
    if (!WriteFully(client, buf.data(), bytes) || !ReadFully(client, buf.data(), bytes)) break;
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  echo.join();
  close(client);
  close(server);
  if (us.empty()) return 0;
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

std::vector<int64_t> ParseList(const std::string& flag) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    out.push_back(std::strtoll(std::string(p).c_str(), nullptr, 10));
  }
  return out;
}

std::string Today() {
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y%m%d", std::gmtime(&now));
  return date;
}

nlohmann::json ToJson(const CaseResult& r) {
  return {{"mode", r.c.mode},          {"tokens", r.c.tokens},
          {"think_us", r.c.think_us},
          {"clients", r.c.clients},    {"payload_bytes", r.payload_bytes},
          {"calls", r.calls},          {"errors", r.errors},
          {"first_error", r.first_error}, {"wall_s", r.wall_s},
          {"p50_us", r.p50_us},        {"p99_us", r.p99_us},
          {"mean_us", r.mean_us},      {"effective_gbps", r.effective_gbps},
          {"tokens_per_s", r.tokens_per_s},
          {"shard_p50_us", r.shard_p50_us}, {"batch_p50_us", r.batch_p50_us},
          {"batches", r.batches},      {"requests_per_batch", r.requests_per_batch},
          {"direct_runs", r.direct_runs}, {"run_steps_mean_us", r.run_steps_us}};
}

// The model the requests are shaped after, and where it came from.
struct ServedShape {
  int64_t hidden = 0, top_k = 0, experts = 0, intermediate = 0, layers = 0;
  std::string backend, device;
  bool generated = false;  // written by this run
};

// The in-process shard of a run and its model: in --model_dir (generated there once), or in a
// temporary directory removed with it (a problem-A-sized layer is 1.7 GB).
struct LocalShard {
  ~LocalShard() {
    shard.reset();
    std::error_code ignored;
    if (!temporary_dir.empty()) std::filesystem::remove_all(temporary_dir, ignored);
  }
  std::unique_ptr<InProcessShard> shard;
  std::string temporary_dir;
  ServedShape served;
};

absl::StatusOr<std::unique_ptr<LocalShard>> StartLocalShard(const RequestShape& shape,
                                                            const std::string& format,
                                                            BenchObserver* observer) {
  auto local = std::make_unique<LocalShard>();
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    char dir_template[] = "/tmp/rpc_bench_XXXXXX";
    if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
    dir = local->temporary_dir = dir_template;
  }
  model::GenerateOptions gen;
  gen.format = format == "nvfp4" ? WeightFormat::kNvfp4 : WeightFormat::kMxfp4;
  gen.layers = static_cast<int>(shape.layers);
  gen.hidden = shape.hidden;
  gen.experts = shape.experts;
  gen.top_k = shape.top_k;
  gen.intermediate = absl::GetFlag(FLAGS_intermediate);
  const absl::Time gen_start = absl::Now();
  local->served.generated = !std::filesystem::exists(std::filesystem::path(dir) / "config.json");
  if (local->served.generated) {
    if (absl::Status s = model::GenerateModel(gen, dir); !s.ok()) return s;
    std::printf("model: %s, %lld experts, top-%lld, H=%lld, I=%lld (generated in %.1f s)\n",
                format.c_str(), static_cast<long long>(gen.experts),
                static_cast<long long>(gen.top_k), static_cast<long long>(gen.hidden),
                static_cast<long long>(gen.intermediate),
                absl::ToDoubleSeconds(absl::Now() - gen_start));
  } else {
    std::printf("model: the checkpoint in %s (its own shape; the model flags are not used)\n",
                dir.c_str());
  }
  InProcessShardOptions options;
  options.model_dir = dir;
  options.backend = absl::GetFlag(FLAGS_backend);
  options.cuda_concurrent_runs = absl::GetFlag(FLAGS_cuda_concurrent_runs);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_batch_wait = absl::Microseconds(absl::GetFlag(FLAGS_max_batch_wait_us));
  if (const int64_t overlap = absl::GetFlag(FLAGS_overlap_min_tokens); overlap >= 0) {
    options.overlap_min_tokens = overlap;
  }
  options.observer = observer;
  options.pin_shared_memory = absl::GetFlag(FLAGS_pin_shm);
  options.forward_cuda_on_device = absl::GetFlag(FLAGS_cuda_on_device);
  if (const int64_t spin = absl::GetFlag(FLAGS_shard_tcp_spin_us); spin >= 0) {
    options.tcp_channel_spin = absl::Microseconds(spin);
  }
  if (const std::string dir = absl::GetFlag(FLAGS_tcp_tls_dir); !dir.empty()) {
    absl::StatusOr<std::shared_ptr<const TlsContext>> tls =
        TcpTlsServerFromFiles(dir + "/cert.pem", dir + "/key.pem");
    if (!tls.ok()) return tls.status();
    options.tcp_channel_tls = *std::move(tls);
  }
  options.raw_buffers.max_idle_bytes =
      static_cast<size_t>(std::max<int64_t>(absl::GetFlag(FLAGS_raw_pool_mib), 0)) << 20;
  absl::StatusOr<std::unique_ptr<InProcessShard>> shard = InProcessShard::Start(options);
  if (!shard.ok()) return shard.status();
  local->shard = *std::move(shard);
  const ServedModel& model = local->shard->model();
  local->served.hidden = model.hidden;
  local->served.top_k = model.top_k;
  local->served.experts = model.num_experts;
  local->served.intermediate = model.intermediate;
  local->served.layers = model.num_layers;
  local->served.backend = options.backend;
  return local;
}

// The shape of the model a running shard serves (GetInfo).
absl::StatusOr<ServedShape> AskShard(const std::string& address) {
  auto stub = v1::ExpertShard::NewStub(NewChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ShardInfo info;
  if (grpc::Status s = stub->GetInfo(&ctx, v1::GetInfoRequest(), &info); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetInfo from ", address, ": ", s.error_message()));
  }
  ServedShape served;
  served.hidden = info.hidden_size();
  served.top_k = info.top_k();
  served.experts = info.num_experts();
  served.intermediate = info.intermediate_size();
  served.layers = info.num_layers();
  served.backend = info.backend();
  served.device = info.device();
  return served;
}

int Main() {
  const bool tuned = absl::GetFlag(FLAGS_tune_allocator) && TuneAllocatorForLargeBuffers();
  const int64_t hidden = absl::GetFlag(FLAGS_hidden);
  const std::string routes = absl::GetFlag(FLAGS_routes);
  const std::string format = absl::GetFlag(FLAGS_format);
  if (routes != "none" && routes != "uniform") {
    std::fprintf(stderr, "rpc_bench: --routes must be none or uniform, not '%s'\n", routes.c_str());
    return 2;
  }
  if (format != "mxfp4" && format != "nvfp4") {
    std::fprintf(stderr, "rpc_bench: --format must be mxfp4 or nvfp4, not '%s'\n", format.c_str());
    return 2;
  }
  RequestShape shape;
  shape.hidden = hidden;
  shape.top_k = absl::GetFlag(FLAGS_top_k);
  shape.experts = absl::GetFlag(FLAGS_experts);
  shape.routed = routes == "uniform";
  shape.layers = absl::GetFlag(FLAGS_layers);
  if (shape.layers < 1) {
    std::fprintf(stderr, "rpc_bench: --layers must be 1 or more\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_batch_tokens) < 1 || absl::GetFlag(FLAGS_max_batch_wait_us) < 0) {
    std::fprintf(stderr, "rpc_bench: need --max_batch_tokens >= 1 and --max_batch_wait_us >= 0\n");
    return 2;
  }
  if (shape.top_k < 1 || shape.experts < shape.top_k) {
    std::fprintf(stderr, "rpc_bench: need 1 <= --top_k <= --experts\n");
    return 2;
  }
  BenchObserver observer;
  std::unique_ptr<LocalShard> local;
  ServedShape served;
  std::string address = absl::GetFlag(FLAGS_shard_address);
  if (address.empty()) {
    absl::StatusOr<std::unique_ptr<LocalShard>> started = StartLocalShard(shape, format, &observer);
    if (!started.ok()) {
      std::fprintf(stderr, "rpc_bench: %s\n", started.status().ToString().c_str());
      return 1;
    }
    local = *std::move(started);
    address = local->shard->address();
    served = local->served;
  } else {
    absl::StatusOr<ServedShape> remote = AskShard(address);
    if (!remote.ok()) {
      std::fprintf(stderr, "rpc_bench: %s\n", remote.status().ToString().c_str());
      return 1;
    }
    served = *remote;
    std::printf("shard at %s: %s on %s, %lld experts, top-%lld, H=%lld, I=%lld (shard-side "
                "columns stay 0)\n",
                address.c_str(), served.backend.c_str(), served.device.c_str(),
                static_cast<long long>(served.experts), static_cast<long long>(served.top_k),
                static_cast<long long>(served.hidden),
                static_cast<long long>(served.intermediate));
  }
  // Requests follow the served model (a --model_dir checkpoint has its own shape).
  shape.hidden = served.hidden;
  shape.top_k = served.top_k;
  shape.experts = served.experts;
  if (shape.layers > served.layers) {
    std::fprintf(stderr, "rpc_bench: --layers=%lld but the model has %lld layer(s)\n",
                 static_cast<long long>(shape.layers), static_cast<long long>(served.layers));
    return 2;
  }
  const ExpertBackend* backend = local != nullptr ? &local->shard->backend() : nullptr;
  const double tcp_gbps = TcpLoopbackGbps(64 << 20, 16);
  const double tcp_rtt_us = TcpRoundTripUs(64, 4000);
  std::printf("raw TCP loopback (64 MiB buffers): %.2f GB/s; 64-byte round trip %.1f us\n",
              tcp_gbps, tcp_rtt_us);
  std::printf("%-7s %8s %10s %7s %6s %7s %6s %10s %10s %10s %10s %6s %8s %9s %7s\n", "mode",
              "tokens", "payload", "clients", "think", "calls", "errors", "p50_us", "p99_us",
              "shard_p50", "batch_p50", "req/b", "GB/s", "tok/s", "direct");
  nlohmann::json cases = nlohmann::json::array();
  const int64_t cap = absl::GetFlag(FLAGS_max_inflight_mib) << 20;
  for (int64_t t : ParseList(absl::GetFlag(FLAGS_tokens))) {
    for (int64_t n : ParseList(absl::GetFlag(FLAGS_clients))) {
      if (n > 1 && n * t * shape.hidden * 2 > cap) continue;
      for (int64_t think : ParseList(absl::GetFlag(FLAGS_think_us))) {
        for (absl::string_view mode : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',')) {
          if (mode == "cuda" && (n > 1 || think > 0)) continue;  // one client process, no pause
          const CaseResult r =
              RunCase({std::string(mode), t, static_cast<int>(n), think}, address, shape,
                      absl::GetFlag(FLAGS_seconds), observer, backend);
          std::printf("%-7s %8lld %10lld %7d %6lld %7lld %6lld %10.1f %10.1f %10.1f %10.1f %6.2f "
                      "%8.3f %9.0f %7lld %s\n",
                      r.c.mode.c_str(), static_cast<long long>(t),
                      static_cast<long long>(r.payload_bytes), r.c.clients,
                      static_cast<long long>(think), static_cast<long long>(r.calls),
                      static_cast<long long>(r.errors), r.p50_us, r.p99_us, r.shard_p50_us,
                      r.batch_p50_us, r.requests_per_batch, r.effective_gbps, r.tokens_per_s,
                      static_cast<long long>(r.direct_runs), r.first_error.c_str());
          if (!r.run_steps_us.empty()) {
            std::printf("        backend Run steps, mean us over %lld Runs: prepare %.1f, copy in "
                        "%.1f, enqueue %.1f, copy out submit %.1f, wait %.1f, copy out host %.1f\n",
                        static_cast<long long>(r.run_steps_us["runs"].get<int64_t>()),
                        r.run_steps_us["prepare"].get<double>(),
                        r.run_steps_us["copy_in"].get<double>(),
                        r.run_steps_us["enqueue"].get<double>(),
                        r.run_steps_us["copy_out_submit"].get<double>(),
                        r.run_steps_us["wait"].get<double>(),
                        r.run_steps_us["copy_out_host"].get<double>());
          }
          std::fflush(stdout);
          cases.push_back(ToJson(r));
        }
      }
    }
  }
  const nlohmann::json out = {
      {"bench", "rpc_bench"},
      {"date", Today()},
      {"hidden", shape.hidden},
      {"routes", routes},
      {"experts", shape.experts},
      {"top_k", shape.top_k},
      {"layers", shape.layers},
      {"intermediate", served.intermediate},
      {"model_generated", served.generated},
      {"format", served.generated ? format : std::string("as in the checkpoint")},
      {"shard_address", absl::GetFlag(FLAGS_shard_address)},
      {"cpus", std::thread::hardware_concurrency()},
      {"backend", served.backend},
      {"pin_shm", absl::GetFlag(FLAGS_pin_shm)},
      {"cuda_on_device", absl::GetFlag(FLAGS_cuda_on_device)},
      {"tcp_round_trip_us", tcp_rtt_us},
      {"tcp_spin_us", absl::GetFlag(FLAGS_tcp_spin_us)},
      {"shard_tcp_spin_us", absl::GetFlag(FLAGS_shard_tcp_spin_us)},
      {"tcp_tls", !absl::GetFlag(FLAGS_tcp_tls_dir).empty()},
      {"raw_pool_mib", absl::GetFlag(FLAGS_raw_pool_mib)},
      {"max_batch_tokens", absl::GetFlag(FLAGS_max_batch_tokens)},
      {"max_batch_wait_us", absl::GetFlag(FLAGS_max_batch_wait_us)},
      {"overlap_min_tokens", absl::GetFlag(FLAGS_overlap_min_tokens)},
      {"cuda_concurrent_runs", absl::GetFlag(FLAGS_cuda_concurrent_runs)},
      {"allocator_tuned", tuned},
      {"channel_spin_us", absl::GetFlag(FLAGS_channel_spin_us) >= 0
                              ? absl::GetFlag(FLAGS_channel_spin_us)
                              : static_cast<int64_t>(kShmChannelSpin.count())},
      {"note", absl::StrCat(shape.routed
                                ? "routes uniform over the experts: transport + staging + expert "
                                  "compute on the backend"
                                : "routes all -1: transport + staging, no expert compute",
                            "; shard_p50_us: the shard's own time per Forward, batch_p50_us: "
                            "per executor batch (backend Run); effective_gbps = 2 * "
                            "payload_bytes * calls / wall_s (request + response payloads)")},
      {"tcp_loopback_gbps", tcp_gbps},
      {"cases", cases}};
  std::string path = absl::GetFlag(FLAGS_out_json);
  if (path.empty()) {
    const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
    path = absl::StrCat(workspace != nullptr ? workspace : ".", "/bench/results/rpc_bench_",
                        Today(), ".json");
  }
  std::ofstream(path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "rpc_bench [--tokens 1,16,...] [--clients 1,4,...] [--modes proto,raw,shm,channel,stream,"
      "cuda,ping]\n"
      "          [--routes none|uniform --backend cpu|cuda --experts --top_k --intermediate\n"
      "           --hidden --format mxfp4|nvfp4]\n"
      "Forward transport benchmark (protobuf, raw buffers, shared memory, request channel) "
      "against an in-process shard; with --routes=uniform, the served latency of real expert "
      "compute on --backend.");
  absl::ParseCommandLine(argc, argv);
  google::InstallFailureSignalHandler();  // a crash prints its stack
  if (const std::string address = absl::GetFlag(FLAGS_cuda_client); !address.empty()) {
    moe::RequestShape shape;
    shape.hidden = absl::GetFlag(FLAGS_hidden);
    shape.top_k = absl::GetFlag(FLAGS_top_k);
    shape.experts = absl::GetFlag(FLAGS_experts);
    shape.routed = absl::GetFlag(FLAGS_routes) == "uniform";
    return moe::RunCudaClient(address, absl::GetFlag(FLAGS_cuda_client_tokens), shape,
                              absl::GetFlag(FLAGS_seconds));
  }
  return moe::Main();
}
