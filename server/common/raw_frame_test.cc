#include "server/common/raw_frame.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "moe/v1/shard.pb.h"

namespace moe {
namespace {

grpc::ByteBuffer FromPieces(const std::vector<std::string>& pieces) {
  std::vector<grpc::Slice> slices;
  for (const std::string& p : pieces) slices.emplace_back(p);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(RawFrameTest, RoundTripKeepsHeaderAndPayload) {
  v1::ForwardRequest header;
  header.set_layer(3);
  header.set_request_id(77);
  header.mutable_hidden_states()->mutable_data()->add_shape(2);
  const std::string payload = "abcdefghij";
  grpc::ByteBuffer frame = EncodeRawFrame(header, grpc::Slice(payload));
  EXPECT_EQ(frame.Length(), 4 + header.ByteSizeLong() + 10);
  v1::ForwardRequest parsed;
  std::string got;
  ASSERT_TRUE(DecodeRawFrame(frame, &parsed, &got).ok());
  EXPECT_EQ(parsed.layer(), 3u);
  EXPECT_EQ(parsed.request_id(), 77u);
  EXPECT_EQ(parsed.hidden_states().data().shape(0), 2);
  EXPECT_EQ(got, payload);
}

TEST(RawFrameTest, PrefixIsLittleEndianHeaderLength) {
  v1::ForwardRequest header;
  header.set_layer(1);  // serializes to 2 bytes: tag 0x10, value 0x01
  grpc::ByteBuffer frame = EncodeRawFrame(header, grpc::Slice(std::string("xy")));
  grpc::Slice flat;
  ASSERT_TRUE(frame.DumpToSingleSlice(&flat).ok());
  const std::string bytes(reinterpret_cast<const char*>(flat.begin()), flat.size());
  EXPECT_EQ(bytes, std::string("\x02\x00\x00\x00\x10\x01xy", 8));
}

TEST(RawFrameTest, PayloadSplitAcrossManySlices) {
  // Prefix, header and payload cut at odd places, as gRPC may deliver them.
  const std::string frame = std::string("\x02\x00\x00\x00\x10\x05", 6) + "0123456789";
  v1::ForwardRequest parsed;
  std::string got;
  ASSERT_TRUE(DecodeRawFrame(FromPieces({frame.substr(0, 1), frame.substr(1, 4),
                                         frame.substr(5, 3), frame.substr(8)}),
                             &parsed, &got)
                  .ok());
  EXPECT_EQ(parsed.layer(), 5u);
  EXPECT_EQ(got, "0123456789");
}

TEST(RawFrameTest, RejectsShortFrame) {
  v1::ForwardRequest parsed;
  std::string got;
  absl::Status s = DecodeRawFrame(FromPieces({std::string("\x01\x00", 2)}), &parsed, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "raw frame of 2 bytes is shorter than its 4-byte prefix");
}

TEST(RawFrameTest, RejectsHeaderLengthBeyondFrame) {
  v1::ForwardRequest parsed;
  std::string got;
  // 0xffffffff would overflow a 32-bit sum with the prefix; it must be compared, not added.
  absl::Status s =
      DecodeRawFrame(FromPieces({std::string("\xff\xff\xff\xff", 4) + "abc"}), &parsed, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "raw frame header length 4294967295 exceeds the 3 bytes after the prefix");
}

TEST(RawFrameTest, RejectsUnparsableHeader) {
  v1::ForwardRequest parsed;
  std::string got;
  // Tag 0x12 (field 2, length-delimited) claiming 100 bytes inside a 2-byte header.
  absl::Status s =
      DecodeRawFrame(FromPieces({std::string("\x02\x00\x00\x00\x12\x64", 6)}), &parsed, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "raw frame header (2 bytes) is not a valid moe.v1.ForwardRequest");
}

TEST(RawFrameTest, EmptyPayloadIsOneSlice) {
  v1::ForwardResponse header;
  header.set_request_id(9);
  grpc::ByteBuffer frame = EncodeRawFrame(header, grpc::Slice());
  v1::ForwardResponse parsed;
  std::string got = "stale";
  ASSERT_TRUE(DecodeRawFrame(frame, &parsed, &got).ok());
  EXPECT_EQ(parsed.request_id(), 9u);
  EXPECT_TRUE(got.empty());
}

}  // namespace
}  // namespace moe
