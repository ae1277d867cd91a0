#include "server/shard/raw_forward.h"

#include <string>
#include <utility>

#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/method_handler.h"
#include "moe/v1/shard.pb.h"
#include "server/common/raw_frame.h"
#include "server/common/status.h"

namespace moe {
namespace {

void DeleteString(void* p) { delete static_cast<std::string*>(p); }

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
  std::string payload;
  if (absl::Status s = DecodeRawFrame(frame, &request, &payload); !s.ok()) return s;
  if (!request.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty in a ForwardRaw header (the payload follows it)");
  }
  request.mutable_hidden_states()->mutable_data()->set_data(std::move(payload));
  v1::ForwardResponse response;
  if (absl::Status s = shard_->ServeForward(request, &response); !s.ok()) return s;
  // The output string moves to the heap and the response slice owns it from here.
  auto* output = new std::string(std::move(*response.mutable_output()->mutable_data()));
  response.mutable_output()->clear_data();
  *out = EncodeRawFrame(response, grpc::Slice(output->data(), output->size(), &DeleteString,
                                              output));
  return absl::OkStatus();
}

}  // namespace moe
