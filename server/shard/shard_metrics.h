// ShardMetrics: the shard's Prometheus metrics. Counters and histograms are updated once per
// request and once per executor batch through the ShardObserver hooks (never per token or route);
// the queue depth, the loaded map version and readiness are read when /metrics is scraped.
//
// Series (bounded: per layer, per status code, fixed histogram buckets):
//   moe_shard_requests_total{layer}          Forward requests served
//   moe_shard_tokens_total{layer}            tokens in those requests
//   moe_shard_request_errors_total{code}     Forward requests that failed, by gRPC status code
//   moe_shard_forward_latency_seconds        histogram: request latency inside the shard
//   moe_shard_batches_total                  executor batches run
//   moe_shard_merged_batches_total           batches that merged more than one request
//   moe_shard_batch_tokens                   histogram: tokens per batch
//   moe_shard_batch_requests                 histogram: requests merged per batch
//   moe_shard_batch_seconds                  histogram: backend time per batch
//   moe_shard_queue_depth                    requests waiting for the executor (at scrape)
//   moe_shard_map_version                    cluster-map version whose weights are active
//   moe_shard_ready                          1 when weights are active and not draining
//   moe_shard_info{backend,device}           constant 1
// With TCP request channels (moe_shard --tcp_channel), at scrape:
//   moe_shard_tcp_channel_connections        data connections open now
//   moe_shard_tcp_channel_requests_total     requests answered over them (also counted above)
//   moe_shard_tcp_channel_refused_total      connections turned away (ticket, limit, no hello)
//   moe_shard_tcp_channel_framing_errors_total  connections ended by a frame the shard refused
//
// Created by moe_shard's main before the service (it is the executor's observer); Serve starts the
// HTTP endpoint once the service exists.
// Thread-safety: thread-safe (prometheus-cpp metrics are; the service's accessors are).
// Ownership: owns its registry and collectables; borrows the service for scrapes.
#ifndef MOE_SERVER_SHARD_SHARD_METRICS_H_
#define MOE_SERVER_SHARD_SHARD_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/common/metrics.h"
#include "server/shard/observer.h"
#include "server/shard/service.h"
#include "server/shard/tcp_channel.h"

namespace moe {

class ShardMetrics final : public ShardObserver {
 public:
  // REQUIRES: num_layers >= 1.
  ShardMetrics(int num_layers, const std::string& backend, const std::string& device);

  ShardMetrics(const ShardMetrics&) = delete;
  ShardMetrics& operator=(const ShardMetrics&) = delete;

  void OnForward(int64_t layer, int64_t tokens, absl::StatusCode code,
                 absl::Duration latency) override;
  void OnBatch(int64_t tokens, int64_t requests, absl::Duration compute) override;

  // Serves these metrics plus `service`'s (and `tcp_channel`'s, when given) scrape-time state at
  // /metrics. Call once.
  // REQUIRES: the returned endpoint is destroyed before `service`, `tcp_channel` and this object.
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Serve(
      const HttpEndpointOptions& options, const ExpertShardService* service,
      const TcpChannelService* tcp_channel = nullptr);

 private:
  class StateCollectable;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StateCollectable> state_;
  // [num_layers]: indexed by the request's layer, so the hot path does no label lookup.
  std::vector<prometheus::Counter*> requests_;
  std::vector<prometheus::Counter*> tokens_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Histogram* forward_latency_;
  prometheus::Counter* batches_;
  prometheus::Counter* merged_batches_;
  prometheus::Histogram* batch_tokens_;
  prometheus::Histogram* batch_requests_;
  prometheus::Histogram* batch_seconds_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SHARD_METRICS_H_
