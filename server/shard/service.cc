#include "server/shard/service.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "kernels/formats.h"
#include "server/common/auth.h"
#include "server/common/status.h"
#include "server/common/wire.h"
#include "server/shard/request.h"

namespace moe {
namespace {

// Sets the wire output's dtype and shape and returns where its bytes go: the buffer `io` names, or
// the response's own data (zero-filled by the resize; protobuf 3.21 cannot adopt a buffer).
absl::StatusOr<absl::Span<uint8_t>> OutputBytes(DType dtype, int64_t tokens, int64_t hidden,
                                                const ForwardIo& io, v1::Tensor* wire,
                                                bool* zeroed) {
  wire->set_dtype(ToWireDType(dtype));
  wire->clear_shape();
  wire->add_shape(tokens);
  wire->add_shape(hidden);
  const size_t bytes = static_cast<size_t>(tokens * hidden) * DTypeSize(dtype);
  if (io.output_buffer) {
    *zeroed = false;
    return io.output_buffer(bytes);
  }
  std::string* data = wire->mutable_data();
  data->resize(bytes);
  *zeroed = true;
  return absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(data->data()), bytes);
}

}  // namespace

ExpertShardService::ExpertShardService(WeightSource* source, ExpertBackend* backend,
                                       ExecutorOptions options)
    : source_(source),
      backend_(backend),
      executor_(backend, options),
      observer_(options.observer) {}

void ExpertShardService::set_identity(ShardIdentity identity) {
  absl::MutexLock lock(&mu_);
  identity_ = std::move(identity);
}

absl::StatusOr<LayerWeights> ExpertShardService::LayerFor(const ShardPlacement& placement, int l) {
  std::vector<int32_t> local_to_logical;
  for (size_t j = 0; j < placement.hosted_slots().size(); ++j) {
    // A slot vacant in this layer (but not in all) is never routed: any expert can fill it.
    local_to_logical.push_back(std::max(placement.LogicalOfLocal(l, static_cast<int32_t>(j)), 0));
  }
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [version, snapshot] : snapshots_) {
      const ShardPlacement& other = *snapshot->placement;
      if (snapshot->layers.empty() || other.hosted_slots().size() != local_to_logical.size()) {
        continue;
      }
      bool same = true;
      for (size_t j = 0; j < local_to_logical.size() && same; ++j) {
        same = std::max(other.LogicalOfLocal(l, static_cast<int32_t>(j)), 0) == local_to_logical[j];
      }
      if (same) return snapshot->layers[l];
    }
  }
  absl::StatusOr<LayerWeights> layer = source_->LoadLayer(l, local_to_logical);
  if (!layer.ok()) return layer.status();
  if (absl::Status s = backend_->CheckSupported(**layer); !s.ok()) return s;
  if (absl::Status s = backend_->PrepareLayer(l, **layer); !s.ok()) return s;
  return layer;
}

absl::Status ExpertShardService::Activate(std::shared_ptr<const ShardPlacement> placement) {
  absl::MutexLock serialize(&activate_mu_);
  const ServedModel& model = source_->model();
  if (placement->num_layers() != model.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat("placement has ", placement->num_layers(),
                                                      " layers, model has ", model.num_layers));
  }
  auto snapshot = std::make_shared<Snapshot>();
  snapshot->placement = placement;
  // A shard left without slots (drained, or not given any yet) answers with zeros.
  if (!placement->hosted_slots().empty()) {
    for (int l = 0; l < model.num_layers; ++l) {
      absl::StatusOr<LayerWeights> layer = LayerFor(*placement, l);
      if (!layer.ok()) return layer.status();
      snapshot->layers.push_back(*std::move(layer));
    }
  }
  absl::MutexLock lock(&mu_);
  snapshots_[placement->version()] = std::move(snapshot);
  while (snapshots_.size() > kMaxSnapshots) snapshots_.erase(snapshots_.begin());
  LOG(INFO) << "map version " << placement->version() << " active: hosting "
            << placement->hosted_slots().size() << " of " << placement->num_physical()
            << " slots per layer; accepting " << snapshots_.size() << " version(s) from "
            << snapshots_.begin()->first;
  return absl::OkStatus();
}

uint64_t ExpertShardService::active_version() const {
  absl::MutexLock lock(&mu_);
  return snapshots_.empty() ? 0 : snapshots_.rbegin()->first;
}

bool ExpertShardService::Accepts(uint64_t map_version) const {
  absl::MutexLock lock(&mu_);
  return snapshots_.count(map_version) > 0;
}

void ExpertShardService::ReleaseBefore(uint64_t min_version) {
  absl::MutexLock lock(&mu_);
  while (snapshots_.size() > 1 && snapshots_.begin()->first < min_version) {
    LOG(INFO) << "map version " << snapshots_.begin()->first << " drained; freeing its weights";
    snapshots_.erase(snapshots_.begin());
  }
}

absl::StatusOr<std::shared_ptr<const ExpertShardService::Snapshot>> ExpertShardService::SnapshotFor(
    uint64_t map_version) const {
  absl::MutexLock lock(&mu_);
  if (snapshots_.empty()) return absl::UnavailableError("shard is loading weights; retry");
  if (map_version == 0) return snapshots_.rbegin()->second;
  auto it = snapshots_.find(map_version);
  if (it != snapshots_.end()) return it->second;
  return absl::FailedPreconditionError(absl::StrCat(
      "stale map version ", map_version, "; current map version is ", snapshots_.rbegin()->first));
}

absl::Status ExpertShardService::DoForward(const v1::ForwardRequest& request,
                                           v1::ForwardResponse* response, absl::Time deadline,
                                           const ForwardIo& io) {
  if (draining_.load()) return absl::UnavailableError("shard is draining");
  const ServedModel& model = source_->model();
  if (!request.model_fingerprint().empty() && request.model_fingerprint() != model.fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat("wrong model: request is for '",
                                                      request.model_fingerprint(),
                                                      "', shard serves '", model.fingerprint, "'"));
  }
  absl::StatusOr<std::shared_ptr<const Snapshot>> snapshot = SnapshotFor(request.map_version());
  if (!snapshot.ok()) return snapshot.status();
  const ShardPlacement& placement = *(*snapshot)->placement;
  if (io.device) {
    // The host must never read the payload: only formats used as they are, at an address their
    // element type may be read from (no staging copy).
    const v1::ActivationFormat format = request.hidden_states().format();
    const size_t align = format == v1::ACTIVATION_F32 ? 4 : 2;
    if ((format != v1::ACTIVATION_BF16 && format != v1::ACTIVATION_F32) ||
        !io.hidden_payload.has_value() ||
        reinterpret_cast<uintptr_t>(io.hidden_payload->data()) % align != 0 || !io.zero_device) {
      return absl::InvalidArgumentError(
          "hidden_states: device memory is taken only as F32 or BF16 at an aligned address");
    }
  }
  absl::StatusOr<StagedRequest> staged =
      StageForwardRequest(request, model, placement, io.hidden_payload);
  if (!staged.ok()) return staged.status();
  load_.Record(placement, staged->layer, staged->physical_ids.view());
  const std::vector<LayerWeights>& layers = (*snapshot)->layers;
  // The backend writes the output in its wire dtype straight into its final place (the response,
  // a raw frame's buffer, a shared-memory range). A shard hosting no slot has no route to
  // compute: its output is zeros.
  bool zeroed = false;
  absl::StatusOr<absl::Span<uint8_t>> out_bytes =
      OutputBytes(staged->out_dtype, staged->num_tokens, model.hidden, io,
                  response->mutable_output(), &zeroed);
  if (!out_bytes.ok()) return out_bytes.status();
  const TensorView out{staged->out_dtype, {staged->num_tokens, model.hidden}, out_bytes->data()};
  const bool compute =
      staged->num_tokens > 0 && !layers.empty() && layers[staged->layer] != nullptr;
  if (compute) {
    WorkItem item{staged->layer,
                  layers[staged->layer].get(),
                  staged->hidden,
                  staged->local_ids.view(),
                  staged->weights.view(),
                  staged->shared_mask.NumElements() > 0 ? staged->shared_mask.view() : TensorView{},
                  out,
                  io.device,
                  io.device};
    item.deadline = deadline;
    if (absl::Status s = executor_.Run(item); !s.ok()) return s;
  } else if (!zeroed && !out_bytes->empty()) {
    if (io.device) {
      if (absl::Status s = io.zero_device(*out_bytes); !s.ok()) return s;
    } else {
      std::memset(out_bytes->data(), 0, out_bytes->size());
    }
  }
  response->set_request_id(request.request_id());
  response->set_map_version(placement.version());
  response->set_batch_tokens(static_cast<uint32_t>(staged->num_tokens));
  if (request.return_routing() && staged->routed_ids.NumElements() > 0) {
    ToWire(staged->routed_ids.view(), response->mutable_topk_ids());
    ToWire(staged->routed_weights.view(), response->mutable_topk_weights());
  }
  return absl::OkStatus();
}

void ExpertShardService::Observe(const v1::ForwardRequest& request,
                                 const v1::ForwardResponse& response, const absl::Status& status,
                                 absl::Time start) const {
  if (observer_ == nullptr) return;
  // The output is [T, H]: its first dimension is the number of tokens served.
  const int64_t tokens =
      status.ok() && response.output().shape_size() > 0 ? response.output().shape(0) : 0;
  observer_->OnForward(request.layer(), tokens, status.code(), absl::Now() - start);
}

absl::Status ExpertShardService::ServeForward(const v1::ForwardRequest& request,
                                              v1::ForwardResponse* response,
                                              const ForwardIo& io, absl::Time deadline) {
  const absl::Time start = absl::Now();
  const absl::Status status = DoForward(request, response, deadline, io);
  Observe(request, *response, status, start);
  return status;
}

absl::StatusOr<AdmissionController::Ticket> ExpertShardService::AdmitCaller(
    const std::string& identity) {
  if (admission_ == nullptr) return AdmissionController::Ticket();
  return admission_->Admit(identity);
}

grpc::Status ExpertShardService::Forward(grpc::ServerContext* ctx,
                                         const v1::ForwardRequest* request,
                                         v1::ForwardResponse* response) {
  absl::StatusOr<AdmissionController::Ticket> ticket = AdmitCaller(CallerIdentity(*ctx));
  if (!ticket.ok()) return ToGrpcStatus(ticket.status());
  const absl::Time start = absl::Now();
  const absl::Status status = DoForward(*request, response, absl::FromChrono(ctx->deadline()));
  Observe(*request, *response, status, start);
  return ToGrpcStatus(status);
}

grpc::Status ExpertShardService::ForwardStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ForwardResponse, v1::ForwardRequest>* stream) {
  v1::ForwardRequest request;
  while (stream->Read(&request)) {
    v1::ForwardResponse response;
    absl::StatusOr<AdmissionController::Ticket> ticket = AdmitCaller(CallerIdentity(*ctx));
    if (!ticket.ok()) return ToGrpcStatus(ticket.status());
    const absl::Time start = absl::Now();
    const absl::Status s = DoForward(request, &response, absl::FromChrono(ctx->deadline()));
    Observe(request, response, s, start);
    // A bad request ends the stream with its status; the shard itself keeps serving.
    if (!s.ok()) {
      return ToGrpcStatus(absl::Status(
          s.code(), absl::StrCat("request_id ", request.request_id(), ": ", s.message())));
    }
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status ExpertShardService::GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                                         v1::ShardInfo* info) {
  const ServedModel& model = source_->model();
  info->set_backend(std::string(backend_->name()));
  info->set_device(backend_->device());
  info->set_model_fingerprint(model.fingerprint);
  info->set_num_layers(model.num_layers);
  info->set_num_experts(model.num_experts);
  info->set_hidden_size(static_cast<uint32_t>(model.hidden));
  info->set_intermediate_size(static_cast<uint32_t>(model.intermediate));
  info->set_top_k(model.top_k);
  absl::MutexLock lock(&mu_);
  info->set_shard_id(identity_.shard_id);
  info->set_address(identity_.address);
  if (!snapshots_.empty()) {
    const Snapshot& current = *snapshots_.rbegin()->second;
    // The proto documents lower-case names ("mxfp4"); WeightFormatName is upper-case.
    if (!current.layers.empty()) {
      info->set_weight_format(absl::AsciiStrToLower(WeightFormatName(current.layers[0]->format)));
    }
    for (int32_t s : current.placement->hosted_slots()) info->add_hosted_slots(s);
    info->set_map_version(current.placement->version());
    info->set_ready(true);
  }
  return grpc::Status::OK;
}

grpc::Status ExpertShardService::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                          v1::ShardStats* out) {
  const ExecutorStats s = executor_.stats();
  out->set_requests(s.requests);
  out->set_tokens(s.tokens);
  out->set_batches(s.batches);
  out->set_merged_batches(s.merged_batches);
  out->set_max_batch_tokens(s.max_batch_tokens);
  out->set_errors(s.errors);
  out->set_compute_seconds(s.compute_seconds);
  out->set_expired(s.expired);
  out->set_rejected(admission_ != nullptr ? admission_->stats().rejected : 0);
  return grpc::Status::OK;
}

v1::LoadDelta ExpertShardService::TakeLoadDelta() {
  std::vector<LoadCounter::Delta> deltas = load_.Take();
  const ExecutorStats s = executor_.TakeStatsDelta();
  v1::LoadDelta out;
  // The newest version's counts at the top level, older versions' (a switch in progress) beside.
  for (size_t i = 0; i < deltas.size(); ++i) {
    const LoadCounter::Delta& d = deltas[deltas.size() - 1 - i];
    v1::LoadDelta* into = i == 0 ? &out : out.add_other_versions();
    into->set_num_layers(d.num_layers);
    into->set_num_physical(d.num_physical);
    into->set_map_version(d.map_version);
    into->mutable_slot_counts()->Assign(d.counts.begin(), d.counts.end());
  }
  out.set_requests(s.requests);
  out.set_tokens(s.tokens);
  out.set_batches(s.batches);
  out.set_merged_batches(s.merged_batches);
  return out;
}

absl::Status ExpertShardService::HandOffLoad(
    absl::FunctionRef<absl::Status(v1::LoadDelta)> send) {
  absl::MutexLock lock(&handoff_mu_);
  return send(TakeLoadDelta());
}

grpc::Status ExpertShardService::CollectLoad(grpc::ServerContext*, const v1::CollectLoadRequest*,
                                             v1::LoadDelta* response) {
  absl::MutexLock lock(&handoff_mu_);
  *response = TakeLoadDelta();
  return grpc::Status::OK;
}

}  // namespace moe
