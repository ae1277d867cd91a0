// Raw-buffer framing of the ForwardRaw method: a Forward whose multi-megabyte tensor travels as
// raw bytes next to a small protobuf header, so that neither side copies it through a protobuf
// `bytes` field (the sender wraps its own memory in a slice; the receiver copies it once).
//
// Method: kForwardRawMethod, unary, registered beside moe.v1.ExpertShard (same server and port).
// Frame (request and response alike), one gRPC message:
//
//   [u32 little-endian header_len][header_len bytes: serialized protobuf header][payload bytes]
//
// Request header: a moe.v1.ForwardRequest whose hidden_states.data carries dtype and shape but
// an empty `data`; the payload is exactly those data bytes (T * H * element size for F32/BF16).
// Response header: a moe.v1.ForwardResponse whose output carries dtype and shape but an empty
// `data`; the payload is the output bytes. Every other field (scales, topk ids...) stays inside
// the header. The receiver rejects, with INVALID_ARGUMENT, a frame shorter than the prefix, a
// header_len beyond the frame, a header that does not parse, a header that carries the payload
// field itself; payload length vs shape is then checked like any Forward (request.h).
// Message-size limit: the shard accepts frames up to its max receive size (256 MiB in moe_shard),
// RESOURCE_EXHAUSTED beyond; clients must raise their channel's receive limit the same way.
//
// Callers: server/shard/raw_forward (server side), client/raw_forward (client side).
// Thread-safety: stateless functions. Ownership: EncodeRawFrame keeps a reference to `payload`
// (the slice), never a copy.
#ifndef MOE_SERVER_COMMON_RAW_FRAME_H_
#define MOE_SERVER_COMMON_RAW_FRAME_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace moe {

inline constexpr char kForwardRawMethod[] = "/moe.v1.ExpertShard/ForwardRaw";
inline constexpr size_t kRawFramePrefixBytes = 4;

// The frame of `header` followed by `payload` (two or three slices; `payload` is referenced).
grpc::ByteBuffer EncodeRawFrame(const google::protobuf::MessageLite& header, grpc::Slice payload);

// The payload of a received frame, not copied: references to the frame's slices (which stay
// alive as long as this object) and the byte ranges in them.
class RawPayload {
 public:
  size_t size() const { return size_; }
  // Whether the payload lies in one slice (Contiguous() then copies nothing).
  bool in_one_piece() const { return pieces_.size() <= 1; }
  // The payload as one contiguous range: the slice memory itself when the payload lies in one
  // slice (what gRPC delivers for most frames it did not have to reassemble), else one copy
  // (made on the first call, kept).
  absl::string_view Contiguous();
  // Copies the payload to `dst` (size() bytes).
  void CopyTo(void* dst) const;

 private:
  friend absl::Status DecodeRawFrame(const grpc::ByteBuffer&, google::protobuf::MessageLite*,
                                     RawPayload*);
  std::vector<grpc::Slice> slices_;
  std::vector<absl::string_view> pieces_;
  size_t size_ = 0;
  std::unique_ptr<char[]> copy_;
};

// Parses `frame` into `header` and references its payload in `payload`. INVALID_ARGUMENT naming
// the defect for any malformed frame.
absl::Status DecodeRawFrame(const grpc::ByteBuffer& frame, google::protobuf::MessageLite* header,
                            RawPayload* payload);
// The same, copying the payload into `payload`.
absl::Status DecodeRawFrame(const grpc::ByteBuffer& frame, google::protobuf::MessageLite* header,
                            std::string* payload);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_RAW_FRAME_H_
