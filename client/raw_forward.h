// Client side of the raw-buffer Forward (framing: server/common/raw_frame.h): the hidden-states
// payload is sent as a slice over the caller's memory (never copied into a protobuf), and the
// output payload is copied once out of the received slices.
//
// Callers: tools and benchmarks talking to one shard (bench/rpc_bench); the channel must allow
// messages as large as the output (grpc::ChannelArguments::SetMaxReceiveMessageSize).
// Thread-safety: ForwardRaw may be called concurrently on one channel.
#ifndef MOE_CLIENT_RAW_FORWARD_H_
#define MOE_CLIENT_RAW_FORWARD_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/shard.pb.h"

namespace moe {

struct RawForwardReply {
  v1::ForwardResponse header;  // output has dtype and shape; its data is in `output`
  std::string output;          // the output tensor's bytes
};

// Sends `header` (a ForwardRequest whose hidden_states.data has dtype and shape but no data)
// followed by `hidden_payload` (those data bytes) over `channel`.
// REQUIRES: `hidden_payload` stays valid until the call returns; `ctx` has a deadline.
// INVALID_ARGUMENT when the header carries data itself; otherwise the shard's status.
absl::StatusOr<RawForwardReply> ForwardRaw(grpc::ChannelInterface* channel,
                                           grpc::ClientContext* ctx,
                                           const v1::ForwardRequest& header,
                                           absl::string_view hidden_payload);

// The same, copying the output bytes straight from the received slices into `output` (the
// caller's buffer, e.g. its next layer's input), whose size must equal the output's byte count
// (INVALID_ARGUMENT otherwise, `output` untouched). Returns the response header.
absl::StatusOr<v1::ForwardResponse> ForwardRawInto(grpc::ChannelInterface* channel,
                                                   grpc::ClientContext* ctx,
                                                   const v1::ForwardRequest& header,
                                                   absl::string_view hidden_payload,
                                                   absl::Span<uint8_t> output);

}  // namespace moe

#endif  // MOE_CLIENT_RAW_FORWARD_H_
