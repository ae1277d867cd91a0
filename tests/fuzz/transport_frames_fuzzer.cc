// Fuzz target transport_frames: the framings a shard and a client decode besides plain protobuf.
// The first input byte picks the framing, the rest is what arrived:
//   0: a ForwardRaw frame (server/common/raw_frame.h), delivered in up to three gRPC slices cut
//      where bytes 1-2 say -> DecodeRawFrame -> StageForwardRequest with the payload beside the
//      header, under every fixture placement;
//   1: a TCP channel request stream (server/common/tcp_channel_frame.h) as the shard reads it:
//      prefix checks, header, payload, then the same staging; frames until one is refused or the
//      bytes run out (a short frame is a closed connection);
//   2: a TCP channel response stream as the client reads it: prefix checks, error frames turned
//      into statuses, answers parsed as ForwardResponse.
// Accepted frames must satisfy the length arithmetic of their format and the fixture's staging
// invariants; refusals must carry the documented code and a message. Nothing may crash or
// allocate more than a length the checks let through.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "moe/v1/shard.pb.h"
#include "server/common/raw_frame.h"
#include "server/common/tcp_channel_frame.h"
#include "tests/fuzz/fuzz_fixture.h"

namespace {

// The shard's payload limit in this harness (moe_shard's default is 256 MiB): small, so that the
// fuzzer's inputs reach both sides of it.
constexpr uint64_t kMaxPayload = 1 << 16;

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "transport_frames_fuzzer: %s\n", what);
    std::abort();
  }
}

void ExpectRefusal(const absl::Status& s, absl::StatusCode code, const char* what) {
  Expect(s.code() == code, what);
  Expect(!s.message().empty(), "a refusal without a message");
}

void RawFrame(const uint8_t* data, size_t size) {
  if (size < 2) return;
  // Two cut points inside the frame: gRPC hands large messages over in pieces.
  const size_t frame_size = size - 2;
  const uint8_t* frame = data + 2;
  size_t cut[2] = {frame_size == 0 ? 0 : data[0] % (frame_size + 1),
                   frame_size == 0 ? 0 : data[1] % (frame_size + 1)};
  if (cut[0] > cut[1]) std::swap(cut[0], cut[1]);
  grpc::Slice slices[3] = {
      grpc::Slice(frame, cut[0]),
      grpc::Slice(frame + cut[0], cut[1] - cut[0]),
      grpc::Slice(frame + cut[1], frame_size - cut[1]),
  };
  const grpc::ByteBuffer buffer(slices, 3);
  moe::v1::ForwardRequest request;
  moe::RawPayload payload;
  const absl::Status s = moe::DecodeRawFrame(buffer, &request, &payload);
  if (!s.ok()) {
    ExpectRefusal(s, absl::StatusCode::kInvalidArgument, "a bad raw frame is not INVALID_ARGUMENT");
    return;
  }
  uint32_t header_len = 0;
  for (int i = 0; i < 4; ++i) header_len |= uint32_t{frame[i]} << (8 * i);
  Expect(payload.size() == frame_size - 4 - header_len, "raw payload length is not the rest");
  const absl::string_view whole = payload.Contiguous();
  Expect(whole.size() == payload.size(), "Contiguous() has the wrong length");
  Expect(whole.empty() || std::memcmp(whole.data(), frame + 4 + header_len, whole.size()) == 0,
         "Contiguous() differs from the frame's bytes");
  std::string copied;
  Expect(moe::DecodeRawFrame(buffer, &request, &copied).ok(), "the copying decoder disagrees");
  Expect(copied == whole, "the copying decoder returned other bytes");
  moe::fuzz::StageEverywhere(request, whole);
}

void TcpRequests(const uint8_t* data, size_t size) {
  size_t at = 0;
  while (size - at >= moe::kTcpPrefixBytes) {
    const moe::TcpFramePrefix prefix = moe::DecodeTcpPrefix(data + at);
    at += moe::kTcpPrefixBytes;
    const absl::Status framing = moe::CheckTcpRequestPrefix(prefix, kMaxPayload);
    if (!framing.ok()) {
      ExpectRefusal(framing,
                    prefix.word != moe::kTcpRequestMagic ? absl::StatusCode::kInvalidArgument
                                                         : absl::StatusCode::kResourceExhausted,
                    "a refused request prefix has the wrong code");
      return;  // the shard answers and closes
    }
    Expect(prefix.header_len <= moe::kTcpMaxHeaderBytes && prefix.payload_len <= kMaxPayload,
           "a prefix over the limits was accepted");
    if (size - at < uint64_t{prefix.header_len} + prefix.payload_len) return;  // short frame
    moe::v1::ForwardRequest request;
    const bool parsed = request.ParseFromArray(data + at, static_cast<int>(prefix.header_len));
    at += prefix.header_len;
    const absl::string_view payload(reinterpret_cast<const char*>(data + at),
                                    static_cast<size_t>(prefix.payload_len));
    at += prefix.payload_len;
    // A header that does not parse is refused and the connection keeps serving.
    if (parsed) moe::fuzz::StageEverywhere(request, payload);
  }
}

void TcpResponses(const uint8_t* data, size_t size) {
  size_t at = 0;
  while (size - at >= moe::kTcpPrefixBytes) {
    const moe::TcpFramePrefix prefix = moe::DecodeTcpPrefix(data + at);
    at += moe::kTcpPrefixBytes;
    const absl::Status framing = moe::CheckTcpResponsePrefix(prefix);
    if (!framing.ok()) {
      ExpectRefusal(framing, absl::StatusCode::kInternal,
                    "a refused response prefix is not INTERNAL");
      return;  // the client marks the channel broken
    }
    Expect(prefix.header_len <= moe::kTcpMaxHeaderBytes, "a response header over the limit");
    if (size - at < prefix.header_len) return;
    const char* header = reinterpret_cast<const char*>(data + at);
    at += prefix.header_len;
    if (prefix.word != 0) {
      Expect(prefix.payload_len == 0, "an error frame with a payload was accepted");
      const absl::Status carried =
          moe::TcpErrorStatus(prefix, std::string(header, prefix.header_len));
      Expect(!carried.ok() && static_cast<uint32_t>(carried.code()) == prefix.word,
             "an error frame did not become its status");
      continue;
    }
    moe::v1::ForwardResponse response;
    if (!response.ParseFromArray(header, static_cast<int>(prefix.header_len))) return;
    if (size - at < prefix.payload_len) return;
    at += static_cast<size_t>(prefix.payload_len);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (data[0] % 3) {
    case 0:
      RawFrame(data + 1, size - 1);
      break;
    case 1:
      TcpRequests(data + 1, size - 1);
      break;
    default:
      TcpResponses(data + 1, size - 1);
      break;
  }
  return 0;
}
