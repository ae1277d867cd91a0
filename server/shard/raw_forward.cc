#include "server/shard/raw_forward.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/method_handler.h"
#include "moe/v1/shard.pb.h"
#include "server/common/auth.h"
#include "server/common/raw_frame.h"
#include "server/common/status.h"

namespace moe {
namespace {

void ReturnLease(void* lease) { delete static_cast<HostBufferPool::Lease*>(lease); }

}  // namespace

RawForwardService::RawForwardService(ExpertShardService* shard, HostBufferPoolOptions pool)
    : shard_(shard), pool_(shard->backend(), pool) {
  // A sync unary method over ByteBuffer messages: gRPC hands the received slices over without
  // parsing them, and sends the response slices as they are.
  AddMethod(new grpc::internal::RpcServiceMethod(
      kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<RawForwardService, grpc::ByteBuffer, grpc::ByteBuffer>(
          [](RawForwardService* service, grpc::ServerContext* ctx, const grpc::ByteBuffer* req,
             grpc::ByteBuffer* resp) { return service->ForwardRaw(ctx, req, resp); },
          this)));
}

grpc::Status RawForwardService::ForwardRaw(grpc::ServerContext* ctx,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  // The same per-client quotas as Forward (a unit test may call without a context).
  absl::StatusOr<AdmissionController::Ticket> ticket =
      shard_->AdmitCaller(ctx != nullptr ? CallerIdentity(*ctx) : std::string());
  if (!ticket.ok()) return ToGrpcStatus(ticket.status());
  return ToGrpcStatus(Serve(*request, response,
                            ctx != nullptr ? absl::FromChrono(ctx->deadline())
                                           : absl::InfiniteFuture()));
}

absl::Status RawForwardService::Serve(const grpc::ByteBuffer& frame, grpc::ByteBuffer* out,
                                      absl::Time deadline) {
  v1::ForwardRequest request;
  RawPayload payload;
  if (absl::Status s = DecodeRawFrame(frame, &request, &payload); !s.ok()) return s;
  if (!request.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty in a ForwardRaw header (the payload follows it)");
  }
  ForwardIo io;
  // A payload gRPC delivered in pieces (any large one: <= 64 KiB slices) is gathered once into
  // a pooled buffer, which the backend has registered; one in a single slice is read in place.
  HostBufferPool::Lease gathered;
  if (payload.in_one_piece()) {
    io.hidden_payload = payload.Contiguous();
  } else {
    gathered = pool_.Acquire(payload.size());
    if (gathered.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ForwardRaw: no host memory for a ", payload.size(), "-byte payload"));
    }
    payload.CopyTo(gathered.data());
    io.hidden_payload =
        absl::string_view(reinterpret_cast<const char*>(gathered.data()), payload.size());
  }
  // The output goes straight into a pooled buffer that the response slice then owns (returned
  // to the pool when gRPC has sent it).
  HostBufferPool::Lease output;
  size_t output_bytes = 0;
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    output_bytes = bytes;
    if (bytes == 0) return absl::Span<uint8_t>();
    output = pool_.Acquire(bytes);
    if (output.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ForwardRaw: no host memory for a ", bytes, "-byte output"));
    }
    return absl::Span<uint8_t>(output.data(), bytes);
  };
  v1::ForwardResponse response;
  if (absl::Status s = shard_->ServeForward(request, &response, io, deadline); !s.ok()) return s;
  if (output.empty()) {
    *out = EncodeRawFrame(response, grpc::Slice());
    return absl::OkStatus();
  }
  uint8_t* const data = output.data();
  auto* owned = new HostBufferPool::Lease(std::move(output));
  *out = EncodeRawFrame(response, grpc::Slice(data, output_bytes, &ReturnLease, owned));
  return absl::OkStatus();
}

}  // namespace moe
