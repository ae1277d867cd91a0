#include "server/common/tcp_channel_frame.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

void PutLe(uint64_t v, int bytes, uint8_t* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t GetLe(const uint8_t* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{in[i]} << (8 * i);
  return v;
}

}  // namespace

void EncodeTcpPrefix(const TcpFramePrefix& prefix, uint8_t out[kTcpPrefixBytes]) {
  PutLe(prefix.word, 4, out);
  PutLe(prefix.header_len, 4, out + 4);
  PutLe(prefix.payload_len, 8, out + 8);
}

TcpFramePrefix DecodeTcpPrefix(const uint8_t in[kTcpPrefixBytes]) {
  return {static_cast<uint32_t>(GetLe(in, 4)), static_cast<uint32_t>(GetLe(in + 4, 4)),
          GetLe(in + 8, 8)};
}

absl::Status WaitReady(int fd, short events, absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return absl::OkStatus();
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("tcp channel: deadline passed during the transfer");
    }
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
    const int n = poll(&p, 1, ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("tcp channel: poll: ", std::strerror(errno)));
    }
  }
}

absl::Status CheckTcpRequestPrefix(const TcpFramePrefix& prefix, uint64_t max_payload_bytes) {
  if (prefix.word != kTcpRequestMagic) {
    return absl::InvalidArgumentError(
        "tcp channel: frame does not start with the request magic (the stream is out of step)");
  }
  if (prefix.header_len > kTcpMaxHeaderBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tcp channel: request header of ",
                                                     prefix.header_len, " bytes exceeds ",
                                                     kTcpMaxHeaderBytes));
  }
  if (prefix.payload_len > max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tcp channel: payload of ", prefix.payload_len,
                                                     " bytes exceeds the ", max_payload_bytes,
                                                     "-byte limit"));
  }
  return absl::OkStatus();
}

absl::Status CheckTcpResponsePrefix(const TcpFramePrefix& prefix) {
  if (prefix.word == 0) {
    if (prefix.header_len > kTcpMaxHeaderBytes) {
      return absl::InternalError(absl::StrCat("tcp channel: response header of ",
                                              prefix.header_len, " bytes is over the limit"));
    }
    return absl::OkStatus();
  }
  // Status codes of absl (and gRPC): 1 (CANCELLED) .. 16 (UNAUTHENTICATED).
  if (prefix.word > 16 || prefix.header_len > kTcpMaxHeaderBytes || prefix.payload_len != 0) {
    return absl::InternalError("tcp channel: malformed error response from the shard");
  }
  return absl::OkStatus();
}

absl::Status TcpErrorStatus(const TcpFramePrefix& prefix, std::string message) {
  return absl::Status(static_cast<absl::StatusCode>(prefix.word), message);
}

absl::Status ReadExactly(int fd, void* dst, size_t n, absl::Time deadline) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    if (absl::Status s = WaitReady(fd, POLLIN, deadline); !s.ok()) return s;
    const ssize_t got = recv(fd, p, n, 0);
    if (got == 0) return absl::UnavailableError("tcp channel: connection closed by the peer");
    if (got < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("tcp channel: recv: ", std::strerror(errno)));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ReceiveSpinning(int fd, void* dst, size_t n, absl::Duration spin,
                                       const std::atomic<int>* yield_to) {
  if (spin <= absl::ZeroDuration()) return 0;
  auto* p = static_cast<uint8_t*>(dst);
  size_t got = 0;
  const absl::Time stop = absl::Now() + spin;
  while (got < n) {
    const ssize_t r = recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      return absl::UnavailableError("tcp channel: connection closed by the peer");
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("tcp channel: recv: ", std::strerror(errno)));
    } else if (absl::Now() >= stop ||
               (yield_to != nullptr && yield_to->load(std::memory_order_relaxed) > 0)) {
      break;
    }
  }
  return got;
}

absl::Status WriteAll(int fd, iovec* iov, int iov_count, absl::Time deadline) {
  while (iov_count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --iov_count;
      continue;
    }
    if (absl::Status s = WaitReady(fd, POLLOUT, deadline); !s.ok()) return s;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(iov_count, 64));
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("tcp channel: send: ", std::strerror(errno)));
    }
    while (sent > 0) {
      const size_t take = std::min(static_cast<size_t>(sent), iov->iov_len);
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + take;
      iov->iov_len -= take;
      sent -= static_cast<ssize_t>(take);
      if (iov->iov_len == 0) {
        ++iov;
        --iov_count;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
