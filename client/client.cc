#include "client/client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kernels/formats.h"
#include "server/common/status.h"
#include "server/common/wire.h"

namespace moe {
namespace {

constexpr int kMaxMessageBytes = 256 << 20;

// "host:port" -> "host", "[v6]:port" -> "v6" (a TCP channel connects to the same host).
std::string HostOf(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close != std::string::npos) return address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  // One colon: host:port. More (a bare IPv6 address) or none: no port to strip.
  if (colon != std::string::npos && address.find(':') == colon) return address.substr(0, colon);
  return address;
}

// Longest pause between two attempts of a Forward (a shard that went down is removed from the
// map within a few heartbeat intervals; polling the map faster than that gains nothing).
constexpr absl::Duration kMaxRetryPause = absl::Milliseconds(50);

bool Serving(const v1::ShardEntry& shard) {
  return shard.state() == v1::SHARD_ACTIVE || shard.state() == v1::SHARD_DRAINING;
}

bool Retryable(const absl::Status& s) {
  // Experts without a live replica fail fast: retrying cannot help until they are reloaded.
  return (s.code() == absl::StatusCode::kUnavailable &&
          !absl::StrContains(s.message(), kNoLiveReplica)) ||
         (s.code() == absl::StatusCode::kFailedPrecondition &&
          absl::StrContains(s.message(), "stale map version"));
}

bool AllReady(const v1::ClusterMap& map) {
  bool any = false;
  for (const auto& s : map.shards()) {
    if (!Serving(s)) continue;  // removed shards do not count
    if (!s.ready()) return false;
    any = true;
  }
  return any;
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  return MakeChannel(address, DefaultChannelSecurity());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelSecurity& security) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return CreateSecureChannel(address, security, args);
}

MoeClient::MoeClient(ClientOptions options)
    : options_(std::move(options)),
      encrypted_(options_.security.value_or(DefaultChannelSecurity()).encrypted()),
      tcp_tls_(options_.security.value_or(DefaultChannelSecurity()).tcp_tls),
      coordinator_(v1::Coordinator::NewStub(MakeChannel(
          options_.coordinator, options_.security.value_or(DefaultChannelSecurity())))) {}

MoeClient::~MoeClient() {
  stopping_.store(true);
  {
    absl::MutexLock lock(&mu_);
    if (watch_ctx_) watch_ctx_->TryCancel();
  }
  if (watcher_.joinable()) watcher_.join();
}

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Connect(ClientOptions options,
                                                              absl::Duration wait) {
  std::unique_ptr<MoeClient> client(new MoeClient(std::move(options)));
  const absl::Time give_up = absl::Now() + wait;
  absl::Status last = absl::UnavailableError("no answer");
  for (absl::Duration backoff = absl::Milliseconds(20); absl::Now() < give_up;
       backoff = std::min(backoff * 2, absl::Milliseconds(500))) {
    last = client->RefreshMap();
    if (last.ok() && AllReady(client->cluster_map())) break;
    if (last.ok()) last = absl::UnavailableError("shards are not all ready yet");
    absl::SleepFor(backoff);  // polling the coordinator at start-up, not synchronization
  }
  if (!last.ok()) {
    return absl::Status(
        last.code(), absl::StrCat("connecting to coordinator ", client->options_.coordinator, ": ",
                                  last.message()));
  }
  if (client->options_.watch_map) {
    client->watcher_ = std::thread([c = client.get()] { c->WatchLoop(); });
  }
  return client;
}

absl::Status MoeClient::InstallMap(const v1::ClusterMap& map) {
  auto state = std::make_shared<MapState>();
  state->map = map;
  for (int l = 0; l < map.layers_size(); ++l) {
    const auto& p2l = map.layers(l).physical_to_logical();
    absl::StatusOr<LayerPlacement> lp =
        LayerPlacement::Create(absl::MakeConstSpan(p2l.data(), p2l.size()),
                               static_cast<int32_t>(map.model().num_experts()));
    if (!lp.ok()) return lp.status();
    state->layers.push_back(*std::move(lp));
  }
  state->serving.assign(map.shards_size(), false);
  std::vector<bool> hosts(map.shards_size(), false);
  for (uint32_t rank : map.slot_to_rank()) {
    if (rank < hosts.size()) hosts[rank] = true;
  }
  state->shared_fallback_rank = -1;
  for (int r = 0; r < map.shards_size(); ++r) {
    state->serving[r] = Serving(map.shards(r));
    if (state->shared_fallback_rank < 0 && state->serving[r] && hosts[r]) {
      state->shared_fallback_rank = r;
    }
  }
  state->shared_fallback_rank = std::max(state->shared_fallback_rank, 0);
  absl::MutexLock lock(&mu_);
  if (!state_ || state_->map.version() <= map.version()) state_ = std::move(state);
  return absl::OkStatus();
}

absl::Status MoeClient::RefreshMap() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ClusterMap map;
  grpc::Status s = coordinator_->GetClusterMap(&ctx, v1::GetClusterMapRequest(), &map);
  if (!s.ok()) return FromGrpcStatus(s);
  return InstallMap(map);
}

void MoeClient::WatchLoop() {
  while (!stopping_.load()) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    grpc::ClientContext* raw = ctx.get();
    {
      absl::MutexLock lock(&mu_);
      if (stopping_.load()) return;
      watch_ctx_ = std::move(ctx);
    }
    v1::WatchClusterMapRequest req;
    req.set_known_version(cluster_map().version());
    auto reader = coordinator_->WatchClusterMap(raw, req);
    v1::ClusterMap map;
    while (reader->Read(&map)) {
      if (!InstallMap(map).ok()) break;
    }
    reader->Finish();
    if (!stopping_.load()) absl::SleepFor(absl::Milliseconds(200));  // reconnect backoff
  }
}

std::shared_ptr<const MoeClient::MapState> MoeClient::map_state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

v1::ClusterMap MoeClient::cluster_map() const {
  std::shared_ptr<const MapState> s = map_state();
  return s ? s->map : v1::ClusterMap();
}

MoeClient::ShardStubs* MoeClient::ShardStub(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stubs = stubs_[address];
  if (!stubs) {
    std::shared_ptr<grpc::Channel> channel =
        MakeChannel(address, options_.security.value_or(DefaultChannelSecurity()));
    stubs = std::make_unique<ShardStubs>();
    stubs->channel = channel;
    stubs->stub = v1::ExpertShard::NewStub(channel);
    stubs->raw = std::make_unique<grpc::GenericStub>(channel);
    stubs->host = HostOf(address);
  }
  return stubs.get();
}

std::unique_ptr<TcpChannel> MoeClient::TakeTcpChannel(ShardStubs* stubs, absl::Time deadline,
                                                      bool fall_back, absl::Status* error) {
  {
    absl::MutexLock lock(&mu_);
    if (stubs->no_tcp) {
      *error = absl::UnimplementedError("the shard does not serve TCP channels");
      return nullptr;
    }
    if (fall_back && absl::Now() < stubs->tcp_retry_after) {
      *error = absl::FailedPreconditionError("a TCP channel to this shard failed to open recently");
      return nullptr;
    }
    // kAuto under TLS reuses TLS channels only (a kAlways call may have left a plaintext one).
    const bool need_tls = fall_back && encrypted_;
    for (auto it = stubs->idle_tcp.rbegin(); it != stubs->idle_tcp.rend(); ++it) {
      if (need_tls && !(*it)->tls()) continue;
      std::unique_ptr<TcpChannel> c = std::move(*it);
      stubs->idle_tcp.erase(std::next(it).base());
      return c;
    }
  }
  // kAuto under TLS takes TLS channels only; kAlways whatever the shard offers.
  absl::StatusOr<std::unique_ptr<TcpChannel>> opened = TcpChannel::Open(
      stubs->channel.get(), stubs->host, std::max(deadline - absl::Now(), absl::ZeroDuration()),
      tcp_tls_, /*require_tls=*/fall_back && encrypted_);
  if (opened.ok()) return *std::move(opened);
  *error = opened.status();
  if (error->code() == absl::StatusCode::kUnimplemented) {
    absl::MutexLock lock(&mu_);
    stubs->no_tcp = true;
  } else if (fall_back) {
    ABSL_RAW_LOG(WARNING, "tcp channel to %s did not open (%s); gRPC calls for %s, then a new try",
                 stubs->host.c_str(), error->ToString().c_str(),
                 absl::FormatDuration(kTcpChannelRetryAfter).c_str());
    absl::MutexLock lock(&mu_);
    stubs->tcp_retry_after = absl::Now() + kTcpChannelRetryAfter;
  }
  return nullptr;
}

void MoeClient::ReturnTcpChannel(ShardStubs* stubs, std::unique_ptr<TcpChannel> channel) {
  // More idle channels than concurrent callers ever needed would only hold shard threads.
  constexpr size_t kMaxIdlePerShard = 16;
  if (channel == nullptr || channel->broken()) return;
  absl::MutexLock lock(&mu_);
  if (stubs->idle_tcp.size() < kMaxIdlePerShard) stubs->idle_tcp.push_back(std::move(channel));
}

absl::Status MoeClient::RouteLogits(const RoutingParams& params, const TensorView& logits,
                                    HostTensor& topk_ids, HostTensor& topk_weights) {
  if (logits.rank() != 2) return absl::InvalidArgumentError("logits must be [T, E]");
  topk_ids = HostTensor(DType::kI32, {logits.dim(0), params.top_k});
  topk_weights = HostTensor(DType::kF32, {logits.dim(0), params.top_k});
  return Route(params, logits, topk_ids.view(), topk_weights.view());
}

absl::StatusOr<ForwardResult> MoeClient::Forward(int layer, const TensorView& hidden,
                                                 const TensorView& topk_ids,
                                                 const TensorView& topk_weights,
                                                 const ForwardOptions& options) {
  const absl::Time deadline =
      absl::Now() +
      (options.deadline > absl::ZeroDuration() ? options.deadline : options_.default_deadline);
  absl::Status last;
  for (int attempt = 1;; ++attempt) {
    std::shared_ptr<const MapState> state = map_state();
    if (!state) return absl::FailedPreconditionError("client has no cluster map");
    absl::StatusOr<ForwardResult> result =
        ForwardOnce(*state, layer, hidden, topk_ids, topk_weights, options, deadline);
    if (result.ok()) {
      result->attempts = attempt;
      return result;
    }
    last = result.status();
    if (!Retryable(last) || absl::Now() >= deadline) return last;
    absl::SleepFor(
        std::min({absl::Milliseconds(5 * attempt), kMaxRetryPause, deadline - absl::Now()}));
    (void)RefreshMap();  // a failed refresh shows up as the next attempt's error
  }
}

absl::StatusOr<v1::LoadStats> MoeClient::GetLoadStats(bool refresh) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::GetLoadStatsRequest req;
  req.set_refresh(refresh);
  v1::LoadStats stats;
  grpc::Status s = coordinator_->GetLoadStats(&ctx, req, &stats);
  if (!s.ok()) return FromGrpcStatus(s);
  return stats;
}

}  // namespace moe
