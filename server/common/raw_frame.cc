#include "server/common/raw_frame.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

// Copies bytes out of a list of slices, front to back (a frame may be split anywhere).
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  // Copies the next `n` bytes to `dst`. REQUIRES: n <= bytes remaining.
  void Read(size_t n, void* dst) {
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      const grpc::Slice& s = slices_[index_];
      const size_t take = std::min(n, s.size() - offset_);
      std::memcpy(out, s.begin() + offset_, take);
      out += take;
      n -= take;
      offset_ += take;
      if (offset_ == s.size()) {
        ++index_;
        offset_ = 0;
      }
    }
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

}  // namespace

grpc::ByteBuffer EncodeRawFrame(const google::protobuf::MessageLite& header, grpc::Slice payload) {
  const size_t header_len = header.ByteSizeLong();
  grpc::Slice head(kRawFramePrefixBytes + header_len);
  auto* p = const_cast<uint8_t*>(head.begin());
  const uint32_t len32 = static_cast<uint32_t>(header_len);
  for (size_t i = 0; i < kRawFramePrefixBytes; ++i) p[i] = static_cast<uint8_t>(len32 >> (8 * i));
  header.SerializeWithCachedSizesToArray(p + kRawFramePrefixBytes);
  if (payload.size() == 0) return grpc::ByteBuffer(&head, 1);
  grpc::Slice slices[2] = {std::move(head), std::move(payload)};
  return grpc::ByteBuffer(slices, 2);
}

absl::Status DecodeRawFrame(const grpc::ByteBuffer& frame, google::protobuf::MessageLite* header,
                            std::string* payload) {
  std::vector<grpc::Slice> slices;
  if (grpc::Status s = frame.Dump(&slices); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("raw frame unreadable: ", s.error_message()));
  }
  const size_t total = frame.Length();
  if (total < kRawFramePrefixBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw frame of ", total,
                                                   " bytes is shorter than its 4-byte prefix"));
  }
  SliceCursor cursor(slices);
  uint8_t prefix[kRawFramePrefixBytes];
  cursor.Read(kRawFramePrefixBytes, prefix);
  uint64_t header_len = 0;
  for (size_t i = 0; i < kRawFramePrefixBytes; ++i) header_len |= uint64_t{prefix[i]} << (8 * i);
  const uint64_t rest = total - kRawFramePrefixBytes;
  if (header_len > rest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw frame header length ", header_len, " exceeds the ", rest, " bytes after the prefix"));
  }
  std::string header_bytes(header_len, '\0');
  cursor.Read(header_len, header_bytes.data());
  if (!header->ParseFromString(header_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw frame header (", header_len, " bytes) is not a valid ",
                     header->GetTypeName()));
  }
  payload->resize(rest - header_len);
  cursor.Read(payload->size(), payload->data());
  return absl::OkStatus();
}

}  // namespace moe
