#include "server/shard/raw_forward.h"

#include <memory>
#include <string>
#include <utility>

#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/method_handler.h"
#include "moe/v1/shard.pb.h"
#include "server/common/raw_frame.h"
#include "server/common/status.h"

namespace moe {
namespace {

void DeleteTensor(void* p) { delete static_cast<HostTensor*>(p); }

}  // namespace

RawForwardService::RawForwardService(ExpertShardService* shard) : shard_(shard) {
  // A sync unary method over ByteBuffer messages: gRPC hands the received slices over without
  // parsing them, and sends the response slices as they are.
  AddMethod(new grpc::internal::RpcServiceMethod(
      kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<RawForwardService, grpc::ByteBuffer, grpc::ByteBuffer>(
          [](RawForwardService* service, grpc::ServerContext* ctx, const grpc::ByteBuffer* req,
             grpc::ByteBuffer* resp) { return service->ForwardRaw(ctx, req, resp); },
          this)));
}

grpc::Status RawForwardService::ForwardRaw(grpc::ServerContext*, const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return ToGrpcStatus(Serve(*request, response));
}

absl::Status RawForwardService::Serve(const grpc::ByteBuffer& frame, grpc::ByteBuffer* out) {
  v1::ForwardRequest request;
  RawPayload payload;
  if (absl::Status s = DecodeRawFrame(frame, &request, &payload); !s.ok()) return s;
  if (!request.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty in a ForwardRaw header (the payload follows it)");
  }
  // The output is converted straight into a (recycled) buffer the response slice then owns.
  std::unique_ptr<HostTensor> output;
  ForwardIo io;
  io.hidden_payload = payload.Contiguous();
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    output = std::make_unique<HostTensor>(
        HostTensor::Uninitialized(DType::kU8, {static_cast<int64_t>(bytes)}));
    return absl::Span<uint8_t>(output->data<uint8_t>(), bytes);
  };
  v1::ForwardResponse response;
  if (absl::Status s = shard_->ServeForward(request, &response, io); !s.ok()) return s;
  if (output == nullptr || output->NumElements() == 0) {
    *out = EncodeRawFrame(response, grpc::Slice());
    return absl::OkStatus();
  }
  const size_t bytes = static_cast<size_t>(output->NumElements());
  HostTensor* owned = output.release();
  *out = EncodeRawFrame(response, grpc::Slice(owned->data<uint8_t>(), bytes, &DeleteTensor, owned));
  return absl::OkStatus();
}

}  // namespace moe
