#include "client/raw_forward.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "server/common/raw_frame.h"
#include "server/common/status.h"

namespace moe {

namespace {

// Sends the frame and returns the response frame.
absl::StatusOr<grpc::ByteBuffer> Call(grpc::ChannelInterface* channel, grpc::ClientContext* ctx,
                                      const v1::ForwardRequest& header,
                                      absl::string_view hidden_payload) {
  if (!header.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty in a ForwardRaw header (pass the payload apart)");
  }
  // A static slice: gRPC reads the caller's memory in place and never frees it; the call is
  // blocking, so the memory outlives every use.
  const grpc::ByteBuffer request = EncodeRawFrame(
      header, grpc::Slice(hidden_payload.data(), hidden_payload.size(), grpc::Slice::STATIC_SLICE));
  static const grpc::internal::RpcMethod* const method =
      new grpc::internal::RpcMethod(kForwardRawMethod, grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::ByteBuffer response;
  const grpc::Status status =
      grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(channel, *method, ctx,
                                                                             request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace

absl::StatusOr<RawForwardReply> ForwardRaw(grpc::ChannelInterface* channel,
                                           grpc::ClientContext* ctx,
                                           const v1::ForwardRequest& header,
                                           absl::string_view hidden_payload) {
  absl::StatusOr<grpc::ByteBuffer> response = Call(channel, ctx, header, hidden_payload);
  if (!response.ok()) return response.status();
  RawForwardReply reply;
  if (absl::Status s = DecodeRawFrame(*response, &reply.header, &reply.output); !s.ok()) {
    return absl::InternalError(absl::StrCat("shard sent a bad ForwardRaw response: ", s.message()));
  }
  return reply;
}

absl::StatusOr<v1::ForwardResponse> ForwardRawInto(grpc::ChannelInterface* channel,
                                                   grpc::ClientContext* ctx,
                                                   const v1::ForwardRequest& header,
                                                   absl::string_view hidden_payload,
                                                   absl::Span<uint8_t> output) {
  absl::StatusOr<grpc::ByteBuffer> response = Call(channel, ctx, header, hidden_payload);
  if (!response.ok()) return response.status();
  v1::ForwardResponse reply;
  RawPayload payload;
  if (absl::Status s = DecodeRawFrame(*response, &reply, &payload); !s.ok()) {
    return absl::InternalError(absl::StrCat("shard sent a bad ForwardRaw response: ", s.message()));
  }
  if (payload.size() != output.size()) {
    return absl::InvalidArgumentError(absl::StrCat("output buffer of ", output.size(),
                                                   " bytes; the shard's output has ",
                                                   payload.size()));
  }
  payload.CopyTo(output.data());
  return reply;
}

}  // namespace moe
