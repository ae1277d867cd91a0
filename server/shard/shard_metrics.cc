#include "server/shard/shard_metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "prometheus/gauge.h"
#include "server/common/metrics.h"

namespace moe {

// The scrape-time gauges: read from the service on every Collect, so they cost nothing between
// scrapes.
class ShardMetrics::StateCollectable final : public prometheus::Collectable {
 public:
  StateCollectable(const ExpertShardService* service, const TcpChannelService* tcp)
      : service_(service), tcp_(tcp) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily depth =
        GaugeFamily("moe_shard_queue_depth", "Requests waiting for the executor.");
    AddSample(depth, static_cast<double>(service_->queued_requests()));
    prometheus::MetricFamily version = GaugeFamily(
        "moe_shard_map_version", "Cluster-map version whose weights are active (0: none yet).");
    AddSample(version, static_cast<double>(service_->active_version()));
    prometheus::MetricFamily ready =
        GaugeFamily("moe_shard_ready", "1 when weights are active and the shard is not draining.");
    AddSample(ready, service_->active_version() > 0 && !service_->draining() ? 1 : 0);
    std::vector<prometheus::MetricFamily> families = {std::move(depth), std::move(version),
                                                      std::move(ready)};
    if (tcp_ != nullptr) {
      families.push_back(GaugeFamily("moe_shard_tcp_channel_connections",
                                     "TCP request-channel data connections open now."));
      AddSample(families.back(), static_cast<double>(tcp_->open_connections()));
      families.push_back(CounterFamily("moe_shard_tcp_channel_requests_total",
                                       "Requests answered over TCP request channels."));
      AddSample(families.back(), static_cast<double>(tcp_->served()));
      families.push_back(CounterFamily(
          "moe_shard_tcp_channel_refused_total",
          "TCP channel connections turned away: bad or used ticket, no hello, connection limit."));
      AddSample(families.back(), static_cast<double>(tcp_->refused_connections()));
      families.push_back(CounterFamily(
          "moe_shard_tcp_channel_framing_errors_total",
          "TCP channel connections ended by a request frame the shard could not take."));
      AddSample(families.back(), static_cast<double>(tcp_->framing_errors()));
    }
    return families;
  }

 private:
  const ExpertShardService* const service_;
  const TcpChannelService* const tcp_;
};

ShardMetrics::ShardMetrics(int num_layers, const std::string& backend, const std::string& device)
    : registry_(std::make_shared<prometheus::Registry>()) {
  CHECK_GE(num_layers, 1);
  auto& requests = prometheus::BuildCounter()
                       .Name("moe_shard_requests_total")
                       .Help("Forward requests served, by layer.")
                       .Register(*registry_);
  auto& tokens = prometheus::BuildCounter()
                     .Name("moe_shard_tokens_total")
                     .Help("Tokens in the Forward requests served, by layer.")
                     .Register(*registry_);
  for (int l = 0; l < num_layers; ++l) {
    requests_.push_back(&requests.Add({{"layer", absl::StrCat(l)}}));
    tokens_.push_back(&tokens.Add({{"layer", absl::StrCat(l)}}));
  }
  errors_ = &prometheus::BuildCounter()
                 .Name("moe_shard_request_errors_total")
                 .Help("Forward requests that failed, by gRPC status code.")
                 .Register(*registry_);
  forward_latency_ = &prometheus::BuildHistogram()
                          .Name("moe_shard_forward_latency_seconds")
                          .Help("Time from receiving a Forward request to its answer.")
                          .Register(*registry_)
                          .Add({}, ExponentialBuckets(50e-6, 2, 18));
  batches_ = &prometheus::BuildCounter()
                  .Name("moe_shard_batches_total")
                  .Help("Executor batches run.")
                  .Register(*registry_)
                  .Add({});
  merged_batches_ = &prometheus::BuildCounter()
                         .Name("moe_shard_merged_batches_total")
                         .Help("Executor batches that merged more than one request.")
                         .Register(*registry_)
                         .Add({});
  batch_tokens_ = &prometheus::BuildHistogram()
                       .Name("moe_shard_batch_tokens")
                       .Help("Tokens per executor batch.")
                       .Register(*registry_)
                       .Add({}, ExponentialBuckets(1, 2, 14));
  batch_requests_ = &prometheus::BuildHistogram()
                         .Name("moe_shard_batch_requests")
                         .Help("Requests merged into one executor batch.")
                         .Register(*registry_)
                         .Add({}, ExponentialBuckets(1, 2, 7));
  batch_seconds_ = &prometheus::BuildHistogram()
                        .Name("moe_shard_batch_seconds")
                        .Help("Backend time per executor batch.")
                        .Register(*registry_)
                        .Add({}, ExponentialBuckets(25e-6, 2, 18));
  prometheus::BuildGauge()
      .Name("moe_shard_info")
      .Help("Constant 1, labelled with the shard's backend and device.")
      .Register(*registry_)
      .Add({{"backend", backend}, {"device", device}})
      .Set(1);
}

void ShardMetrics::OnForward(int64_t layer, int64_t tokens, absl::StatusCode code,
                             absl::Duration latency) {
  forward_latency_->Observe(absl::ToDoubleSeconds(latency));
  if (code != absl::StatusCode::kOk) {
    // Rare by design (bad input, stale maps, draining): the label lookup's mutex is affordable.
    errors_->Add({{"code", absl::StatusCodeToString(code)}}).Increment();
    return;
  }
  // A served request's layer was validated by staging; the bound check keeps a future caller from
  // indexing out of range.
  if (layer < 0 || layer >= static_cast<int64_t>(requests_.size())) return;
  requests_[layer]->Increment();
  tokens_[layer]->Increment(static_cast<double>(tokens));
}

void ShardMetrics::OnBatch(int64_t tokens, int64_t requests, absl::Duration compute) {
  batches_->Increment();
  if (requests > 1) merged_batches_->Increment();
  batch_tokens_->Observe(static_cast<double>(tokens));
  batch_requests_->Observe(static_cast<double>(requests));
  batch_seconds_->Observe(absl::ToDoubleSeconds(compute));
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> ShardMetrics::Serve(
    const HttpEndpointOptions& options, const ExpertShardService* service,
    const TcpChannelService* tcp_channel) {
  CHECK(state_ == nullptr) << "Serve is called once";
  state_ = std::make_shared<StateCollectable>(service, tcp_channel);
  return MetricsEndpoint::Start(options, {registry_, state_});
}

}  // namespace moe
