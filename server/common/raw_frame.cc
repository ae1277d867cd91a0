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

  // The unread bytes, as ranges inside the slices.
  void Rest(std::vector<absl::string_view>* pieces) const {
    for (size_t i = index_; i < slices_.size(); ++i) {
      const size_t from = i == index_ ? offset_ : 0;
      if (slices_[i].size() > from) {
        pieces->emplace_back(reinterpret_cast<const char*>(slices_[i].begin()) + from,
                             slices_[i].size() - from);
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

absl::string_view RawPayload::Contiguous() {
  if (pieces_.size() == 1) return pieces_[0];
  if (size_ == 0) return absl::string_view();
  if (copy_ == nullptr) {
    copy_.reset(new char[size_]);  // uninitialized: CopyTo writes every byte
    CopyTo(copy_.get());
  }
  return absl::string_view(copy_.get(), size_);
}

void RawPayload::CopyTo(void* dst) const {
  auto* out = static_cast<char*>(dst);
  for (absl::string_view piece : pieces_) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
}

absl::Status DecodeRawFrame(const grpc::ByteBuffer& frame, google::protobuf::MessageLite* header,
                            RawPayload* payload) {
  std::vector<grpc::Slice>& slices = payload->slices_;
  slices.clear();
  payload->pieces_.clear();
  payload->copy_.reset();
  payload->size_ = 0;
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
  payload->size_ = rest - header_len;
  cursor.Rest(&payload->pieces_);
  return absl::OkStatus();
}

absl::Status DecodeRawFrame(const grpc::ByteBuffer& frame, google::protobuf::MessageLite* header,
                            std::string* payload) {
  RawPayload raw;
  if (absl::Status s = DecodeRawFrame(frame, header, &raw); !s.ok()) return s;
  payload->resize(raw.size());
  raw.CopyTo(payload->data());
  return absl::OkStatus();
}

}  // namespace moe
