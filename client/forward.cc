// MoeClient::ForwardOnce: one attempt of a dispatched forward under one map version.
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "client/client.h"
#include "client/dispatch.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "kernels/formats.h"
#include "server/common/raw_frame.h"
#include "server/common/status.h"
#include "server/common/wire.h"

namespace moe {
namespace {

void SetTensor(v1::Tensor* t, DType dtype, std::initializer_list<int64_t> shape,
               std::string bytes) {
  t->set_dtype(ToWireDType(dtype));
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_data() = std::move(bytes);
}

// Rows `rows` of a row-major [T, C] tensor, concatenated.
std::string Rows(const TensorView& src, const std::vector<int64_t>& rows) {
  const int64_t row_bytes = src.dim(0) > 0 ? src.NumBytes() / src.dim(0) : 0;
  std::string out(rows.size() * row_bytes, '\0');
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.data() + i * row_bytes,
                static_cast<const char*>(src.data) + rows[i] * row_bytes, row_bytes);
  }
  return out;
}

std::string HiddenRows(const TensorView& hidden, const std::vector<int64_t>& rows, DType dtype) {
  if (dtype == DType::kF32) return Rows(hidden, rows);
  const int64_t h = hidden.dim(1);
  std::string out(rows.size() * h * sizeof(uint16_t), '\0');
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* src = hidden.As<const float>() + rows[i] * h;
    for (int64_t j = 0; j < h; ++j) dst[i * h + j] = FloatToBf16(src[j]);
  }
  return out;
}

void DeleteString(void* p) { delete static_cast<std::string*>(p); }

// Adds a shard's [n, H] output (F32 or BF16) into the rows it answers for. `data`: the output's
// bytes when they came outside the message (a raw frame's payload).
absl::Status Accumulate(const v1::Tensor& wire, const std::vector<int64_t>& rows, int64_t h,
                        float* out, std::optional<absl::string_view> data = std::nullopt) {
  absl::StatusOr<TensorView> view =
      data.has_value() ? ViewOf(wire, "output", *data) : ViewOf(wire, "output");
  if (!view.ok()) return view.status();
  const int64_t n = static_cast<int64_t>(rows.size());
  if (absl::Status s = CheckTensorOneOf(*view, "output", {DType::kF32, DType::kBF16}, {n, h});
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + rows[i] * h;
    for (int64_t j = 0; j < h; ++j) {
      dst[j] += view->dtype == DType::kF32 ? view->As<const float>()[i * h + j]
                                           : Bf16ToFloat(view->As<const uint16_t>()[i * h + j]);
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct MoeClient::ShardCall {
  int rank = 0;
  std::vector<int64_t> tokens;  // rows of the caller's batch
  grpc::ClientContext ctx;
  v1::ForwardRequest request;
  v1::ForwardResponse response;
  // How the request travels: protobuf Forward, ForwardRaw frames, a TCP channel, or not at all
  // (no TCP channel could be opened to a shard that serves them: `status` says why).
  enum class Via { kProto, kRaw, kTcp, kUnreached } via = Via::kProto;
  ShardStubs* stubs = nullptr;
  grpc::ByteBuffer raw_request, raw_response;  // kRaw
  // kTcp: the channel (back to the pool after the answer), the hidden-state bytes sent beside
  // the header, the output bytes.
  std::unique_ptr<TcpChannel> tcp;
  std::string tcp_payload, tcp_output;
  absl::Status status;
};

absl::StatusOr<ForwardResult> MoeClient::ForwardOnce(
    const MapState& state, int layer, const TensorView& hidden, const TensorView& topk_ids,
    const TensorView& topk_weights, const ForwardOptions& options, absl::Time deadline) {
  if (layer < 0 || layer >= static_cast<int>(state.layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", state.layers.size(), ")"));
  }
  if (absl::Status s = CheckTensor(hidden, "hidden", DType::kF32, {kAnyDim, kAnyDim}); !s.ok()) {
    return s;
  }
  const int64_t t_count = hidden.dim(0), h = hidden.dim(1);
  if (absl::Status s = CheckTensor(topk_weights, "topk_weights", DType::kF32,
                                   {t_count, topk_ids.rank() == 2 ? topk_ids.dim(1) : kAnyDim});
      !s.ok()) {
    return s;
  }
  const v1::ClusterMap& map = state.map;
  absl::StatusOr<DispatchPlan> plan = PlanDispatch(
      state.layers[layer], absl::MakeConstSpan(map.slot_to_rank().data(), map.slot_to_rank_size()),
      map.shards_size(), topk_ids, options.is_padding, options.shared_experts,
      state.shared_fallback_rank);
  if (!plan.ok()) return plan.status();
  const std::vector<int32_t> lost = ExpertsOnLostRanks(
      state.layers[layer], absl::MakeConstSpan(map.slot_to_rank().data(), map.slot_to_rank_size()),
      state.serving, *plan, topk_ids);
  if (!lost.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "layer ", layer, ": experts ", absl::StrJoin(lost, ","), " have ", kNoLiveReplica,
        " (their shard was removed; the survivors are loading them); map version ", map.version()));
  }
  const int64_t k = topk_ids.dim(1);
  const bool fall_back = options.tcp_channel == TcpChannelUse::kAuto;
  const bool use_tcp = options.tcp_channel == TcpChannelUse::kAlways ||
                       (fall_back && (!encrypted_ || tcp_tls_ != nullptr));
  std::vector<std::unique_ptr<ShardCall>> calls;
  for (int rank = 0; rank < map.shards_size(); ++rank) {
    std::vector<int64_t>& rows = plan->tokens_by_rank[rank];
    if (rows.empty()) continue;
    auto call = std::make_unique<ShardCall>();
    call->rank = rank;
    call->tokens = std::move(rows);
    const int64_t n = static_cast<int64_t>(call->tokens.size());
    v1::ForwardRequest& req = call->request;
    req.set_model_fingerprint(map.model().fingerprint());
    req.set_layer(layer);
    req.set_map_version(map.version());
    req.set_output_dtype(ToWireDType(options.wire_output_dtype));
    req.mutable_hidden_states()->set_format(
        options.wire_hidden_dtype == DType::kF32 ? v1::ACTIVATION_F32 : v1::ACTIVATION_BF16);
    SetTensor(req.mutable_hidden_states()->mutable_data(), options.wire_hidden_dtype, {n, h},
              HiddenRows(hidden, call->tokens, options.wire_hidden_dtype));
    SetTensor(req.mutable_topk_ids(), DType::kI32, {n, k}, Rows(topk_ids, call->tokens));
    SetTensor(req.mutable_topk_weights(), DType::kF32, {n, k}, Rows(topk_weights, call->tokens));
    std::string indices(n * sizeof(int64_t), '\0');
    std::memcpy(indices.data(), call->tokens.data(), indices.size());
    SetTensor(req.mutable_token_indices(), DType::kI64, {n}, std::move(indices));
    if (options.is_padding.present()) {
      SetTensor(req.mutable_is_padding(), DType::kBool, {n},
                Rows(options.is_padding, call->tokens));
    }
    if (options.shared_experts) {
      std::string mask(n, '\0');
      for (int64_t i = 0; i < n; ++i) mask[i] = plan->shared_rank[call->tokens[i]] == rank;
      SetTensor(req.mutable_shared_mask(), DType::kBool, {n}, std::move(mask));
    }
    call->stubs = ShardStub(map.shards(rank).address());
    // Under TLS, kAuto keeps large requests on gRPC (kTlsChannelMaxAutoPayload).
    if (use_tcp && !(fall_back && encrypted_ &&
                     req.hidden_states().data().data().size() > kTlsChannelMaxAutoPayload)) {
      absl::Status no_channel;
      call->tcp = TakeTcpChannel(call->stubs, deadline, fall_back, &no_channel);
      if (call->tcp != nullptr) {
        call->via = ShardCall::Via::kTcp;
        call->tcp_payload = std::move(*req.mutable_hidden_states()->mutable_data()->mutable_data());
        req.mutable_hidden_states()->mutable_data()->clear_data();
      } else if (!fall_back && no_channel.code() != absl::StatusCode::kUnimplemented) {
        call->via = ShardCall::Via::kUnreached;  // answered below; the caller retries
        call->status = no_channel;
      }
    }
    if (call->via == ShardCall::Via::kProto && (options.raw_transport || use_tcp)) {
      call->via = ShardCall::Via::kRaw;
      // The hidden-state bytes leave the message and travel as their own slice (owned by it).
      auto* payload =
          new std::string(std::move(*req.mutable_hidden_states()->mutable_data()->mutable_data()));
      req.mutable_hidden_states()->mutable_data()->clear_data();
      call->raw_request = EncodeRawFrame(
          req, grpc::Slice(payload->data(), payload->size(), &DeleteString, payload));
    }
    call->ctx.set_deadline(absl::ToChronoTime(deadline));
    calls.push_back(std::move(call));
  }
  // gRPC calls first, all but the last on gRPC's threads; then every TCP request goes out; then
  // the last gRPC call runs on this thread (no hand-off to and from a callback thread on the
  // critical path of a one-shard step); then the TCP answers are read. All shards work at once.
  ShardCall* on_this_thread = nullptr;
  for (auto& call : calls) {
    if (call->via == ShardCall::Via::kProto || call->via == ShardCall::Via::kRaw) {
      on_this_thread = call.get();
    }
  }
  int async_calls = 0;
  for (auto& call : calls) {
    async_calls += call.get() != on_this_thread &&
                   (call->via == ShardCall::Via::kProto || call->via == ShardCall::Via::kRaw);
  }
  absl::BlockingCounter pending(async_calls);
  for (auto& call : calls) {
    if (call.get() == on_this_thread) continue;
    auto done = [&pending, c = call.get()](grpc::Status s) {
      c->status = FromGrpcStatus(s);
      pending.DecrementCount();
    };
    if (call->via == ShardCall::Via::kRaw) {
      call->stubs->raw->UnaryCall(&call->ctx, kForwardRawMethod, grpc::StubOptions(),
                                  &call->raw_request, &call->raw_response, std::move(done));
    } else if (call->via == ShardCall::Via::kProto) {
      call->stubs->stub->async()->Forward(&call->ctx, &call->request, &call->response,
                                          std::move(done));
    }
  }
  for (auto& call : calls) {
    if (call->via != ShardCall::Via::kTcp) continue;
    call->status = call->tcp->Send(call->request, call->tcp_payload, deadline);
  }
  if (on_this_thread != nullptr) {
    ShardCall& c = *on_this_thread;
    static const grpc::internal::RpcMethod* const raw_method =
        new grpc::internal::RpcMethod(kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC);
    c.status = FromGrpcStatus(
        c.via == ShardCall::Via::kRaw
            ? grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
                  c.stubs->channel.get(), *raw_method, &c.ctx, c.raw_request, &c.raw_response)
            : c.stubs->stub->Forward(&c.ctx, c.request, &c.response));
  }
  for (auto& call : calls) {
    if (call->via != ShardCall::Via::kTcp) continue;
    if (call->status.ok()) {
      absl::StatusOr<v1::ForwardResponse> r = call->tcp->Receive(&call->tcp_output, deadline);
      if (r.ok()) {
        call->response = *std::move(r);
      } else {
        call->status = r.status();
      }
    }
    ReturnTcpChannel(call->stubs, std::move(call->tcp));
  }
  pending.Wait();
  ForwardResult result;
  result.output = HostTensor(DType::kF32, {t_count, h});
  result.map_version = map.version();
  result.shards_called = static_cast<int>(calls.size());
  for (auto& call : calls) {
    if (!call->status.ok()) {
      return absl::Status(call->status.code(),
                          absl::StrCat("shard ", call->rank, " (", map.shards(call->rank).address(),
                                       "): ", call->status.message()));
    }
    std::optional<absl::string_view> payload;
    RawPayload output;
    if (call->via == ShardCall::Via::kRaw) {
      if (absl::Status s = DecodeRawFrame(call->raw_response, &call->response, &output); !s.ok()) {
        return absl::InternalError(absl::StrCat("shard ", call->rank, " (",
                                                map.shards(call->rank).address(),
                                                "): bad ForwardRaw response: ", s.message()));
      }
      payload = output.Contiguous();
    } else if (call->via == ShardCall::Via::kTcp) {
      payload = call->tcp_output;
    }
    if (absl::Status s = Accumulate(call->response.output(), call->tokens, h,
                                    result.output.data<float>(), payload);
        !s.ok()) {
      return s;
    }
  }
  return result;
}

}  // namespace moe
