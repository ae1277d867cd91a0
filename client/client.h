// MoeClient: the frontend's side of moe-serve. It keeps the cluster map (fetched from the
// coordinator and kept current by a watch), optionally routes router logits, plans which shard
// gets which tokens with the same EPLB replica choice as the shards, calls the shards in parallel,
// and sums their partial outputs per token. Stale map versions and unavailable shards are retried
// on a refreshed map within the caller's deadline.
//
// Thread-safety: Forward may be called from many threads at once. Ownership: the client owns its
// channels and the watch thread; tensors passed in are borrowed for the duration of a call.
#ifndef MOE_CLIENT_CLIENT_H_
#define MOE_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "kernels/eplb.h"
#include "kernels/routing.h"
#include "kernels/tensor.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "client/tcp_channel.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/tls.h"

namespace moe {

struct ClientOptions {
  std::string coordinator;  // host:port
  absl::Duration default_deadline = absl::Seconds(30);
  // Keep the map current through WatchClusterMap (otherwise refresh only on stale-version errors).
  bool watch_map = true;
  // TLS credentials and bearer token of every call (coordinator and shards); unset: the process
  // default (tls.h DefaultChannelSecurity, plaintext without a token unless main set one).
  std::optional<ChannelSecurity> security;
};

// ForwardOptions::tcp_channel.
enum class TcpChannelUse {
  kNever,
  // Where the shard serves them and they are as private as this client's gRPC calls: any
  // channel for a plaintext client, TLS channels (a shard whose gRPC port has TLS) for a client
  // with TLS credentials, verified against the same CA (ChannelSecurity::tcp_tls), for requests
  // of up to kTlsChannelMaxAutoPayload bytes of hidden states (decode steps). A shard whose
  // channel cannot be opened (a firewalled port, a plaintext channel under TLS, no CA) gets gRPC
  // calls, and a new attempt after kTcpChannelRetryAfter.
  kAuto,
  // Every shard that serves them, a plaintext channel under TLS too; a channel that cannot be
  // opened fails the call (UNAVAILABLE, retried as any).
  kAlways,
};
inline constexpr absl::Duration kTcpChannelRetryAfter = absl::Seconds(30);
// kAuto under TLS: requests whose hidden states are larger go over gRPC even where a TLS channel
// is open. TLS costs the channel per 16 KB record (OpenSSL 3.0): on the H200 host it beats
// plaintext ForwardRaw up to 32 KB (problem C, 8 tokens: 175-184 against 227 us), ties at 64 KB
// and loses beyond (32 tokens: 481-513 against 394-401 us; NOTES-cuda.md).
inline constexpr size_t kTlsChannelMaxAutoPayload = size_t{64} << 10;

struct ForwardOptions {
  // F32 or BF16 output on the wire (the result is always returned as F32).
  DType wire_output_dtype = DType::kF32;
  // Hidden states sent as F32 or BF16 (converted from the F32 input).
  DType wire_hidden_dtype = DType::kBF16;
  TensorView is_padding;  // optional BOOL [T]
  // Mark each token for exactly one shard to add the shared-expert output.
  bool shared_experts = false;
  absl::Duration deadline = absl::ZeroDuration();  // 0: ClientOptions::default_deadline
  // Send each shard's hidden states and receive its output as raw gRPC slices
  // (ExpertShard/ForwardRaw, server/common/raw_frame.h) instead of protobuf `bytes`: no protobuf
  // copy of the tensors on either side. Same validation and errors as Forward.
  bool raw_transport = true;
  // When each shard's request goes over a direct TCP channel instead (tcp.proto, moe_shard
  // --tcp_channel): a socket per shard and request in flight, opened on first use and kept, with
  // no gRPC call per request (a decode step's transport then costs about a TCP round trip:
  // on the H200 host 51-63 us against 148-232 us for ForwardRaw, NOTES-cuda.md). The requests go
  // out to every shard before the first answer is read, so the shards work in parallel. A shard
  // that does not serve TCP channels gets the gRPC call above instead.
  TcpChannelUse tcp_channel = TcpChannelUse::kAuto;
};

struct ForwardResult {
  HostTensor output;  // F32 [T, H]
  uint64_t map_version = 0;
  int shards_called = 0;
  int attempts = 0;
};

class MoeClient {
 public:
  // Connects and waits (up to `wait`) until the coordinator has published a map whose shards are
  // all ready.
  static absl::StatusOr<std::unique_ptr<MoeClient>> Connect(ClientOptions options,
                                                            absl::Duration wait);
  ~MoeClient();

  // Modular path: hidden F32 [T, H], topk_ids I32 [T, K] (logical), topk_weights F32 [T, K].
  absl::StatusOr<ForwardResult> Forward(int layer, const TensorView& hidden,
                                        const TensorView& topk_ids, const TensorView& topk_weights,
                                        const ForwardOptions& options = {});

  // Routing helper (same library function the shards use on the monolithic path).
  static absl::Status RouteLogits(const RoutingParams& params, const TensorView& logits,
                                  HostTensor& topk_ids, HostTensor& topk_weights);

  v1::ClusterMap cluster_map() const;
  // Fetches the map now (used after a stale-version answer).
  absl::Status RefreshMap();
  absl::StatusOr<v1::LoadStats> GetLoadStats(bool refresh);

 private:
  struct MapState {
    v1::ClusterMap map;
    std::vector<LayerPlacement> layers;
    // By rank: whether the shard serves (not removed). Routes to a removed rank fail fast.
    std::vector<bool> serving;
    // The rank that adds the shared-expert output of a token with no route: the lowest serving
    // rank that hosts a slot.
    int shared_fallback_rank = 0;
  };
  struct ShardCall;

  explicit MoeClient(ClientOptions options);
  absl::Status InstallMap(const v1::ClusterMap& map);
  std::shared_ptr<const MapState> map_state() const;
  struct ShardStubs {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::ExpertShard::Stub> stub;
    std::unique_ptr<grpc::GenericStub> raw;  // ForwardRaw frames on the same channel
    std::string host;                        // the address without its port
    // Open TCP channels not in use (ForwardOptions::tcp_channel), guarded by mu_.
    std::vector<std::unique_ptr<TcpChannel>> idle_tcp;
    bool no_tcp = false;  // the shard answered that it does not serve TCP channels
    // kAuto: no new channel is tried before this (an open failed).
    absl::Time tcp_retry_after = absl::InfinitePast();
  };
  ShardStubs* ShardStub(const std::string& address);
  // An idle TCP channel to the shard, or a new one; null with *error set when none could be
  // opened (UNIMPLEMENTED: the shard does not serve them, and is not asked again). With
  // `fall_back` (kAuto) a failed open is remembered for kTcpChannelRetryAfter, during
  // which null comes back at once (*error FAILED_PRECONDITION) and the caller uses gRPC.
  std::unique_ptr<TcpChannel> TakeTcpChannel(ShardStubs* stubs, absl::Time deadline,
                                             bool fall_back, absl::Status* error);
  // Keeps `channel` for the next request unless it is broken (or enough are idle).
  void ReturnTcpChannel(ShardStubs* stubs, std::unique_ptr<TcpChannel> channel);
  absl::StatusOr<ForwardResult> ForwardOnce(const MapState& state, int layer,
                                            const TensorView& hidden, const TensorView& topk_ids,
                                            const TensorView& topk_weights,
                                            const ForwardOptions& options, absl::Time deadline);
  void WatchLoop();

  const ClientOptions options_;
  // The gRPC links may use TLS (ChannelSecurity::encrypted): kAuto then opens TLS channels only,
  // verified with tcp_tls_ (null: no CA, so no channels).
  const bool encrypted_;
  const std::shared_ptr<const TlsContext> tcp_tls_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const MapState> state_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<ShardStubs>> stubs_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};
  std::unique_ptr<grpc::ClientContext> watch_ctx_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
};

// Text in the UNAVAILABLE error of a call that routes to experts with no live replica (their only
// shard was removed; the survivors are loading them). Such calls fail fast, without retries.
inline constexpr char kNoLiveReplica[] = "no live replica";

// Channel arguments shared by every moe-serve client: message limits raised to 256 MiB.
// Uses the process default security (tls.h); the overload takes it explicitly.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelSecurity& security);

}  // namespace moe

#endif  // MOE_CLIENT_CLIENT_H_
