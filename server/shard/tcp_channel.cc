#include "server/shard/tcp_channel.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/status.h"
#include "server/common/tcp_channel_frame.h"
#include "server/common/tcp_stream.h"

namespace moe {
namespace {

// Outstanding tickets at most (each OpenTcpChannel adds one until used or expired).
constexpr size_t kMaxTickets = 4096;
constexpr absl::Duration kHelloTimeout = absl::Seconds(10);
constexpr absl::Duration kErrorWriteTimeout = absl::Seconds(1);
constexpr absl::Duration kDrainTimeout = absl::Milliseconds(200);
constexpr size_t kDrainBytes = size_t{1} << 20;

// Sends a response frame: `status` with `header` and `payload` (OK), or its message (error).
absl::Status SendResponse(TcpStream& stream, const absl::Status& status, absl::string_view header,
                          absl::Span<const uint8_t> payload, absl::Time deadline) {
  const absl::string_view text = status.ok() ? header : status.message();
  uint8_t prefix[kTcpPrefixBytes];
  EncodeTcpPrefix({static_cast<uint32_t>(status.code()), static_cast<uint32_t>(text.size()),
                   status.ok() ? payload.size() : 0},
                  prefix);
  iovec iov[3] = {{prefix, sizeof(prefix)},
                  {const_cast<char*>(text.data()), text.size()},
                  {const_cast<uint8_t*>(payload.data()), status.ok() ? payload.size() : 0}};
  return stream.WriteAll(iov, 3, deadline);
}

// Reads and drops what the peer still sends, until it closes or a short while has passed.
absl::Status Drain(TcpStream& stream) {
  const absl::Time deadline = absl::Now() + kDrainTimeout;
  char sink[4096];
  for (size_t total = 0; total < kDrainBytes; total += sizeof(sink)) {
    if (absl::Status s = stream.ReadExactly(sink, sizeof(sink), deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SendError(TcpStream& stream, const absl::Status& status) {
  return SendResponse(stream, status, {}, {}, absl::Now() + kErrorWriteTimeout);
}

// A listening TCP socket on host:port (port 0: any), and the port it got.
absl::StatusOr<std::pair<int, int>> Listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                                 &found);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp channel: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      freeaddrinfo(found);
      const int got = bound.ss_family == AF_INET6
                          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      return std::make_pair(fd, got);
    }
    error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("tcp channel: cannot listen on ", host, ":", port, ": ", error));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpChannelService>> TcpChannelService::Start(
    ExpertShardService* shard, TcpChannelOptions options) {
  absl::StatusOr<std::pair<int, int>> listener = Listen(options.host, options.port);
  if (!listener.ok()) return listener.status();
  return std::unique_ptr<TcpChannelService>(
      new TcpChannelService(shard, std::move(options), listener->first, listener->second));
}

TcpChannelService::TcpChannelService(ExpertShardService* shard, TcpChannelOptions options,
                                     int listener, int port)
    : shard_(shard),
      options_(std::move(options)),
      listener_(listener),
      port_(port),
      pool_(shard->backend(), options_.buffers),
      max_spinning_(options_.max_spinning > 0
                        ? options_.max_spinning
                        : std::max(1, static_cast<int>(std::thread::hardware_concurrency() / 4))),
      polling_yields_(options_.polling_yields >= 0 ? options_.polling_yields > 0
                                                   : std::thread::hardware_concurrency() < 4),
      acceptor_([this] { AcceptLoop(); }) {}

size_t TcpChannelService::open_connections() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const Connection& c : connections_) n += c.done ? 0 : 1;
  return n;
}

grpc::Status TcpChannelService::OpenTcpChannel(grpc::ServerContext* ctx,
                                               const v1::OpenTcpChannelRequest*,
                                               v1::OpenTcpChannelResponse* response) {
  std::string ticket(kTcpChannelTicketBytes, '\0');
  if (getrandom(ticket.data(), ticket.size(), 0) != static_cast<ssize_t>(ticket.size())) {
    return ToGrpcStatus(absl::InternalError("tcp channel: no random bytes for a ticket"));
  }
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (stopping_) return ToGrpcStatus(absl::UnavailableError("tcp channel: shutting down"));
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    it = it->second.expiry <= now ? tickets_.erase(it) : std::next(it);
  }
  if (tickets_.size() >= kMaxTickets) {
    return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
        "tcp channel: ", kMaxTickets, " unused tickets are outstanding; connect with one first")));
  }
  tickets_[ticket] = {now + options_.ticket_ttl, ctx != nullptr ? CallerIdentity(*ctx) : ""};
  response->set_port(static_cast<uint32_t>(port_));
  response->set_ticket(ticket);
  response->set_tls(options_.tls != nullptr);
  response->set_ticket_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.ticket_ttl)));
  return grpc::Status::OK;
}

void TcpChannelService::AcceptLoop() {
  while (true) {
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    bool full = false;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        if (fd >= 0) close(fd);
        return;
      }
      if (fd < 0) {
        if (errno != EINTR && errno != ECONNABORTED) {
          LOG_EVERY_N(WARNING, 100) << "tcp channel: accept: " << std::strerror(errno);
          // Out of descriptors or memory: let a connection close before trying again.
          mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(50));
        }
        continue;
      }
      Reap();
      size_t open = 0;
      for (const Connection& c : connections_) open += c.done ? 0 : 1;
      full = open >= options_.max_connections;
      if (!full) {
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        Connection& c = connections_.emplace_back();
        c.fd = fd;
        c.thread = std::thread([this, &c] { Serve(&c); });
      }
    }
    if (full) {
      refused_.fetch_add(1);
      // Under TLS the refusal would need a handshake on this thread: the peer sees the close.
      TcpStream plain(fd);
      if (options_.tls == nullptr) {
        (void)SendError(plain, absl::ResourceExhaustedError(absl::StrCat(
                                   "tcp channel: the shard has ", options_.max_connections,
                                   " open connections; close one first")));
      }
      close(fd);
    }
  }
}

void TcpChannelService::Reap() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    it->thread.join();
    it = connections_.erase(it);
  }
}

void TcpChannelService::Serve(Connection* connection) {
  const int fd = connection->fd;
  std::unique_ptr<TcpStream> stream;
  absl::StatusOr<std::string> identity = absl::UnavailableError("no handshake");
  if (options_.tls != nullptr) {
    absl::StatusOr<std::unique_ptr<TcpStream>> secured =
        TcpStream::AcceptTls(fd, *options_.tls, absl::Now() + kHelloTimeout);
    if (secured.ok()) {
      stream = *std::move(secured);
    } else {
      LOG_EVERY_N(WARNING, 100) << "tcp channel: " << secured.status();
    }
  } else {
    stream = std::make_unique<TcpStream>(fd);
  }
  if (stream != nullptr) identity = Hello(*stream);
  if (!identity.ok()) refused_.fetch_add(1);
  if (identity.ok()) {
    LOG(INFO) << "tcp channel: connection opened" << (stream->tls() ? " (tls)" : "");
    uint64_t requests = 0;
    absl::Status s;
    ConnectionState state;
    while ((s = ServeOne(*stream, *identity, state)).ok()) ++requests;
    LOG(INFO) << "tcp channel: connection closed after " << requests << " request(s) ("
              << s.message() << ")";
  }
  // A close with unread input would reset the connection, and the peer could lose the error
  // response just sent: end the sending side, then drain briefly.
  shutdown(fd, SHUT_WR);
  if (stream != nullptr) (void)Drain(*stream);
  stream.reset();
  // Closed under the lock, so that Stop never shuts down a descriptor number reused since.
  absl::MutexLock lock(&mu_);
  close(fd);
  connection->fd = -1;
  connection->done = true;
}

absl::StatusOr<std::string> TcpChannelService::Hello(TcpStream& stream) {
  uint8_t hello[kTcpHelloBytes];
  if (absl::Status s = stream.ReadExactly(hello, sizeof(hello), absl::Now() + kHelloTimeout);
      !s.ok()) {
    return s;
  }
  absl::Status verdict;
  std::string identity;
  if (std::memcmp(hello, kTcpChannelMagic, sizeof(kTcpChannelMagic)) != 0) {
    verdict = absl::InvalidArgumentError("tcp channel: the connection did not start with the hello");
  } else {
    const std::string ticket(reinterpret_cast<const char*>(hello) + sizeof(kTcpChannelMagic),
                             kTcpChannelTicketBytes);
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end() || it->second.expiry <= absl::Now()) {
      verdict = absl::PermissionDeniedError(
          "tcp channel: unknown, used or expired ticket (OpenTcpChannel gives a new one)");
    } else {
      identity = it->second.identity;
    }
    if (it != tickets_.end()) tickets_.erase(it);  // single use, even when expired
  }
  if (!verdict.ok()) {
    (void)SendError(stream, verdict);
    return verdict;
  }
  if (absl::Status s =
          SendResponse(stream, absl::OkStatus(), {}, {}, absl::Now() + kErrorWriteTimeout);
      !s.ok()) {
    return s;
  }
  return identity;
}

absl::Status TcpChannelService::ServeOne(TcpStream& stream, const std::string& identity,
                                         ConnectionState& state) {
  uint8_t raw[kTcpPrefixBytes];
  size_t spun = 0;
  if (options_.spin > absl::ZeroDuration() &&
      (state.last_gap <= options_.spin || ++state.unspun >= 16)) {
    state.unspun = 0;
    // Polls only while a polling slot is free (and, where polling yields, no request is being
    // served).
    if (spinning_.fetch_add(1) < max_spinning_ && !(polling_yields_ && serving_.load() > 0)) {
      absl::StatusOr<size_t> got = stream.ReceiveSpinning(raw, sizeof(raw), options_.spin,
                                                          polling_yields_ ? &serving_ : nullptr);
      spinning_.fetch_sub(1);
      if (!got.ok()) return got.status();
      spun = *got;
    } else {
      spinning_.fetch_sub(1);
    }
  }
  // An idle connection waits here for its next request as long as it likes.
  if (absl::Status s =
          stream.ReadExactly(raw + spun, sizeof(raw) - spun, absl::InfiniteFuture());
      !s.ok()) {
    return s;
  }
  state.last_gap = absl::Now() - state.answered;
  // Counted from the prefix to the answer's last byte (pollers give way meanwhile).
  serving_.fetch_add(1);
  const absl::Cleanup served = [this] { serving_.fetch_sub(1); };
  const absl::Time deadline = absl::Now() + options_.frame_timeout;
  const TcpFramePrefix prefix = DecodeTcpPrefix(raw);
  absl::Status framing =
      CheckTcpRequestPrefix(prefix, static_cast<uint64_t>(options_.max_payload_bytes));
  HostBufferPool::Lease payload;
  if (framing.ok() && prefix.payload_len > 0) {
    payload = pool_.Acquire(static_cast<size_t>(prefix.payload_len));
    if (payload.empty()) {
      framing = absl::ResourceExhaustedError(absl::StrCat(
          "tcp channel: no host memory for a ", prefix.payload_len, "-byte payload"));
    }
  }
  if (!framing.ok()) {
    framing_errors_.fetch_add(1);
    (void)SendError(stream, framing);
    return framing;
  }
  std::string header(prefix.header_len, '\0');
  if (absl::Status s = stream.ReadExactly(header.data(), header.size(), deadline); !s.ok()) {
    return s;
  }
  if (absl::Status s = stream.ReadExactly(payload.data(), prefix.payload_len, deadline);
      !s.ok()) {
    return s;
  }
  // The frame is read whole, so an error answer leaves the connection in step.
  Answer answer;
  const absl::Status status =
      Handle(identity, header,
             absl::string_view(reinterpret_cast<const char*>(payload.data()),
                               static_cast<size_t>(prefix.payload_len)),
             answer);
  served_.fetch_add(1);
  absl::Status sent = SendResponse(stream, status, answer.header,
                                   absl::Span<const uint8_t>(answer.output.data(),
                                                             answer.output_bytes),
                                   deadline);
  state.answered = absl::Now();
  return sent;
}

absl::Status TcpChannelService::Handle(const std::string& identity, const std::string& header,
                                       absl::string_view payload, Answer& answer) {
  // The admission ticket is held until the answer is ready, not while it is sent.
  absl::StatusOr<AdmissionController::Ticket> admitted = shard_->AdmitCaller(identity);
  if (!admitted.ok()) return admitted.status();
  v1::ForwardRequest request;
  if (!request.ParseFromString(header)) {
    return absl::InvalidArgumentError(absl::StrCat("tcp channel: request header (", header.size(),
                                                   " bytes) is not a valid ForwardRequest"));
  }
  if (!request.hidden_states().data().data().empty()) {
    return absl::InvalidArgumentError(
        "hidden_states.data.data: must be empty in a tcp channel request (the payload follows "
        "the header)");
  }
  ForwardIo io;
  io.hidden_payload = payload;
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    answer.output_bytes = bytes;
    if (bytes == 0) return absl::Span<uint8_t>();
    answer.output = pool_.Acquire(bytes);
    if (answer.output.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tcp channel: no host memory for a ", bytes, "-byte output"));
    }
    return absl::Span<uint8_t>(answer.output.data(), bytes);
  };
  v1::ForwardResponse response;
  if (absl::Status s = shard_->ServeForward(request, &response, io); !s.ok()) return s;
  answer.header = response.SerializeAsString();
  if (answer.header.size() > kTcpMaxHeaderBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tcp channel: response header of ",
                                                     answer.header.size(), " bytes exceeds ",
                                                     kTcpMaxHeaderBytes));
  }
  return absl::OkStatus();
}

void TcpChannelService::Stop() {
  std::vector<std::thread*> threads;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    shutdown(listener_, SHUT_RDWR);  // wakes accept
    for (Connection& c : connections_) {
      if (!c.done) shutdown(c.fd, SHUT_RDWR);  // wakes a read; a request in the backend finishes
    }
  }
  acceptor_.join();
  close(listener_);
  {
    // No connection is added once the acceptor has stopped.
    absl::MutexLock lock(&mu_);
    for (Connection& c : connections_) threads.push_back(&c.thread);
  }
  for (std::thread* t : threads) t->join();
  absl::MutexLock lock(&mu_);
  connections_.clear();
}

}  // namespace moe
