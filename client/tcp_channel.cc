#include "client/tcp_channel.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "moe/v1/tcp.grpc.pb.h"
#include "server/common/status.h"
#include "server/common/tcp_channel_frame.h"

namespace moe {
namespace {

// Largest answer Receive takes into a string (the shards' message limit is 256 MiB).
constexpr uint64_t kMaxReceiveBytes = uint64_t{1} << 30;

// A connected blocking TCP socket to host:port with TCP_NODELAY, within `deadline`.
absl::StatusOr<int> Connect(const std::string& host, uint32_t port, absl::Time deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("tcp channel: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                          a->ai_protocol);
    if (fd < 0) continue;
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int64_t ms = std::max<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()), 0);
      int err = ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 600000))) == 1) {
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      freeaddrinfo(found);
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("tcp channel: cannot connect to ", host, ":", port, ": ", error));
}

// Reads a response's error message (prefix already read) and turns it into the status.
absl::Status ReadError(TcpStream& stream, const TcpFramePrefix& prefix, absl::Time deadline) {
  if (absl::Status s = CheckTcpResponsePrefix(prefix); !s.ok()) return s;
  std::string message(prefix.header_len, '\0');
  if (absl::Status s = stream.ReadExactly(message.data(), message.size(), deadline); !s.ok()) {
    return s;
  }
  return TcpErrorStatus(prefix, std::move(message));
}

// Reads and drops `n` bytes.
absl::Status Discard(TcpStream& stream, uint64_t n, absl::Time deadline) {
  std::vector<uint8_t> sink(std::min<uint64_t>(n, uint64_t{1} << 20));
  while (n > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, sink.size()));
    if (absl::Status s = stream.ReadExactly(sink.data(), take, deadline); !s.ok()) return s;
    n -= take;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpChannel>> TcpChannel::Open(
    grpc::ChannelInterface* channel, const std::string& host, absl::Duration timeout,
    std::shared_ptr<const TlsContext> tls, bool require_tls) {
  const absl::Time deadline = absl::Now() + timeout;
  // The stub only borrows the channel.
  v1::TcpChannelShard::Stub stub(
      std::shared_ptr<grpc::ChannelInterface>(channel, [](grpc::ChannelInterface*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::OpenTcpChannelResponse opened;
  if (grpc::Status s = stub.OpenTcpChannel(&ctx, v1::OpenTcpChannelRequest(), &opened); !s.ok()) {
    if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      return absl::UnimplementedError(
          "tcp channel: the shard does not serve TCP channels (moe_shard --tcp_channel)");
    }
    return FromGrpcStatus(s);
  }
  if (opened.ticket().size() != kTcpChannelTicketBytes || opened.port() == 0 ||
      opened.port() > 65535) {
    return absl::InternalError("tcp channel: malformed OpenTcpChannel answer");
  }
  if (require_tls && !opened.tls()) {
    return absl::FailedPreconditionError(
        "tcp channel: the shard's channels are plaintext and this client's calls use TLS");
  }
  if (opened.tls() && tls == nullptr) {
    return absl::FailedPreconditionError(
        "tcp channel: the shard's channels speak TLS and this client has no CA to verify them "
        "with");
  }
  absl::StatusOr<int> fd = Connect(host, opened.port(), deadline);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<TcpStream> stream;
  if (opened.tls()) {
    absl::StatusOr<std::unique_ptr<TcpStream>> secured =
        TcpStream::ConnectTls(*fd, *tls, host, deadline);
    if (!secured.ok()) {
      close(*fd);
      return secured.status();
    }
    stream = *std::move(secured);
  } else {
    stream = std::make_unique<TcpStream>(*fd);
  }
  std::unique_ptr<TcpChannel> result(new TcpChannel(*fd, std::move(stream)));
  TcpStream& s0 = *result->stream_;
  char hello[kTcpHelloBytes];
  std::memcpy(hello, kTcpChannelMagic, sizeof(kTcpChannelMagic));
  std::memcpy(hello + sizeof(kTcpChannelMagic), opened.ticket().data(), kTcpChannelTicketBytes);
  iovec iov{hello, sizeof(hello)};
  if (absl::Status s = s0.WriteAll(&iov, 1, deadline); !s.ok()) return s;
  uint8_t raw[kTcpPrefixBytes];
  if (absl::Status s = s0.ReadExactly(raw, sizeof(raw), deadline); !s.ok()) return s;
  const TcpFramePrefix prefix = DecodeTcpPrefix(raw);
  if (prefix.word != 0) return ReadError(s0, prefix, deadline);
  if (prefix.header_len != 0 || prefix.payload_len != 0) {
    return absl::InternalError("tcp channel: malformed hello answer from the shard");
  }
  return result;
}

TcpChannel::~TcpChannel() {
  stream_.reset();  // before the socket it uses
  close(fd_);
}

void TcpChannel::set_spin(absl::Duration spin) {
  absl::MutexLock lock(&mu_);
  spin_ = std::max(spin, absl::ZeroDuration());
}

absl::Status TcpChannel::ReadPrefix(uint8_t* raw, absl::Time deadline) {
  size_t got = 0;
  if (spin_ > absl::ZeroDuration() && (last_wait_ <= spin_ || ++unpolled_ >= 16)) {
    unpolled_ = 0;
    absl::StatusOr<size_t> spun = stream_->ReceiveSpinning(raw, kTcpPrefixBytes, spin_);
    if (!spun.ok()) return spun.status();
    got = *spun;
  }
  absl::Status s = stream_->ReadExactly(raw + got, kTcpPrefixBytes - got, deadline);
  last_wait_ = absl::Now() - sent_at_;
  return s;
}

bool TcpChannel::broken() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

namespace {

bool BreaksTheStream(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kInternal;
}

const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

}  // namespace

template <typename T>
T TcpChannel::Checked(T result) {
  if (BreaksTheStream(StatusOf(result))) broken_ = true;
  return result;
}

absl::StatusOr<v1::ForwardResponse> TcpChannel::Forward(const v1::ForwardRequest& header,
                                                        absl::string_view hidden_payload,
                                                        absl::Span<uint8_t> output,
                                                        absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Checked(SendLocked(header, hidden_payload, deadline)); !s.ok()) return s;
  return Checked(ReceiveLocked(
      [output](uint64_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
        if (bytes == output.size()) return output;
        return absl::InvalidArgumentError(
            absl::StrCat("output: buffer of ", output.size(), " bytes, the answer has ", bytes));
      },
      deadline));
}

absl::Status TcpChannel::Send(const v1::ForwardRequest& header, absl::string_view hidden_payload,
                              absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return Checked(SendLocked(header, hidden_payload, deadline));
}

absl::StatusOr<v1::ForwardResponse> TcpChannel::Receive(std::string* output,
                                                        absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return Checked(ReceiveLocked(
      [output](uint64_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
        if (bytes > kMaxReceiveBytes) {
          return absl::ResourceExhaustedError(
              absl::StrCat("tcp channel: an answer of ", bytes, " bytes is over the client's ",
                           kMaxReceiveBytes, "-byte limit"));
        }
        output->resize(bytes);
        return absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(output->data()), bytes);
      },
      deadline));
}

absl::Status TcpChannel::SendLocked(const v1::ForwardRequest& header,
                                    absl::string_view hidden_payload, absl::Time deadline) {
  if (broken_) {
    return absl::UnavailableError("tcp channel: broken by an earlier failure; open a new one");
  }
  if (awaiting_) {
    return absl::FailedPreconditionError("tcp channel: the previous answer was not received");
  }
  if (!header.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty (the payload travels beside the header)");
  }
  if (!header.SerializeToString(&scratch_)) {
    return absl::InvalidArgumentError("tcp channel: request header does not serialize");
  }
  if (scratch_.size() > kTcpMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tcp channel: request header of ",
                                                   scratch_.size(), " bytes exceeds ",
                                                   kTcpMaxHeaderBytes));
  }
  uint8_t raw[kTcpPrefixBytes];
  EncodeTcpPrefix({kTcpRequestMagic, static_cast<uint32_t>(scratch_.size()), hidden_payload.size()},
                  raw);
  iovec iov[3] = {{raw, sizeof(raw)},
                  {scratch_.data(), scratch_.size()},
                  {const_cast<char*>(hidden_payload.data()), hidden_payload.size()}};
  if (absl::Status s = stream_->WriteAll(iov, 3, deadline); !s.ok()) return s;
  awaiting_ = true;
  sent_at_ = absl::Now();
  return absl::OkStatus();
}

absl::StatusOr<v1::ForwardResponse> TcpChannel::ReceiveLocked(const OutputSink& sink,
                                                              absl::Time deadline) {
  if (broken_) {
    return absl::UnavailableError("tcp channel: broken by an earlier failure; open a new one");
  }
  if (!awaiting_) return absl::FailedPreconditionError("tcp channel: no request was sent");
  awaiting_ = false;
  uint8_t raw[kTcpPrefixBytes];
  if (absl::Status s = ReadPrefix(raw, deadline); !s.ok()) return s;
  const TcpFramePrefix prefix = DecodeTcpPrefix(raw);
  if (absl::Status s = CheckTcpResponsePrefix(prefix); !s.ok()) return s;
  if (prefix.word != 0) return ReadError(*stream_, prefix, deadline);
  scratch_.resize(prefix.header_len);
  if (absl::Status s = stream_->ReadExactly(scratch_.data(), scratch_.size(), deadline);
      !s.ok()) {
    return s;
  }
  v1::ForwardResponse response;
  if (!response.ParseFromString(scratch_)) {
    return absl::InternalError("tcp channel: response header does not parse");
  }
  absl::StatusOr<absl::Span<uint8_t>> output = sink(prefix.payload_len);
  if (!output.ok()) {
    if (absl::Status s = Discard(*stream_, prefix.payload_len, deadline); !s.ok()) return s;
    return output.status();
  }
  if (absl::Status s = stream_->ReadExactly(output->data(), output->size(), deadline);
      !s.ok()) {
    return s;
  }
  return response;
}

}  // namespace moe
