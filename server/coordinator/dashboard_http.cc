#include "server/coordinator/dashboard_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "glog/logging.h"

namespace moe {
namespace {

const char* ReasonPhrase(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return "Unknown";
  }
}

HttpReply TextReply(int status, std::string body) {
  return HttpReply{status, "text/plain; charset=utf-8", std::move(body)};
}

absl::StatusOr<int> BindListener(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_str = absl::StrCat(port);
  if (getaddrinfo(host.c_str(), port_str.c_str(), &hints, &found) != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat("dashboard: cannot resolve ", host));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  // SO_REUSEADDR only lets a restarted coordinator rebind past TIME_WAIT; unlike SO_REUSEPORT it
  // never lets two live servers share the port.
  const bool ok = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
                  bind(fd, found->ai_addr, found->ai_addrlen) == 0 && listen(fd, 64) == 0;
  const int err = errno;
  freeaddrinfo(found);
  if (!ok) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("dashboard: cannot listen on ", host, ":", port, ": ", std::strerror(err)));
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

// One client connection through its phases: read the request head, write the reply, then read
// and discard until the peer closes (closing with unread input would reset the connection and
// could cut the reply short at the client).
struct Connection {
  enum class Phase { kReading, kWriting, kDraining };
  int fd = -1;
  Phase phase = Phase::kReading;
  std::string in;
  std::string out;
  size_t written = 0;
  absl::Time deadline;
};

// Moves `c` along after poll reported `revents` on it; true when it is finished (to be closed).
bool Advance(Connection& c, short revents, absl::Time now, const HttpHandler& handler,
             const HttpServerLimits& limits) {
  if (revents == 0) return false;
  char buf[4096];
  switch (c.phase) {
    case Connection::Phase::kReading: {
      const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n <= 0) return n == 0 || (errno != EAGAIN && errno != EINTR);
      c.in.append(buf, n);
      const size_t head_end = c.in.find("\r\n\r\n");
      if (head_end != std::string::npos && head_end + 4 <= limits.max_request_bytes) {
        c.out = AnswerHttpRequest(absl::string_view(c.in).substr(0, head_end + 4), handler);
        c.phase = Connection::Phase::kWriting;
      } else if (c.in.size() > limits.max_request_bytes) {
        c.out = FormatHttpResponse(TextReply(431, "request too large\n"), true);
        c.phase = Connection::Phase::kWriting;
      }
      return false;
    }
    case Connection::Phase::kWriting: {
      const ssize_t n =
          send(c.fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
      if (n < 0) return errno != EAGAIN && errno != EINTR;
      c.written += n;
      if (c.written == c.out.size()) {
        shutdown(c.fd, SHUT_WR);
        c.phase = Connection::Phase::kDraining;
        c.deadline = std::min(c.deadline, now + absl::Seconds(1));
      }
      return false;
    }
    case Connection::Phase::kDraining: {
      const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      return n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
    }
  }
  return true;
}

}  // namespace

std::string FormatHttpResponse(const HttpReply& reply, bool include_body) {
  std::string out = absl::StrCat("HTTP/1.1 ", reply.status, " ", ReasonPhrase(reply.status),
                                 "\r\nContent-Type: ", reply.content_type,
                                 "\r\nContent-Length: ", reply.body.size(),
                                 "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff"
                                 "\r\nConnection: close\r\n");
  if (reply.status == 405) absl::StrAppend(&out, "Allow: GET, HEAD\r\n");
  absl::StrAppend(&out, "\r\n");
  if (include_body) absl::StrAppend(&out, reply.body);
  return out;
}

std::string AnswerHttpRequest(absl::string_view request_head, const HttpHandler& handler) {
  const absl::string_view line = request_head.substr(0, request_head.find("\r\n"));
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.") ||
      !absl::StartsWith(parts[1], "/")) {
    return FormatHttpResponse(TextReply(400, "bad request line\n"), true);
  }
  const bool head = parts[0] == "HEAD";
  if (parts[0] != "GET" && !head) {
    return FormatHttpResponse(TextReply(405, "only GET and HEAD are served\n"), true);
  }
  const absl::string_view target = parts[1];
  const size_t q = target.find('?');
  const absl::string_view path = target.substr(0, q);
  const absl::string_view query = q == absl::string_view::npos ? "" : target.substr(q + 1);
  return FormatHttpResponse(handler(path, query), !head);
}

absl::StatusOr<std::unique_ptr<DashboardHttpServer>> DashboardHttpServer::Start(
    const HttpEndpointOptions& options, HttpHandler handler, HttpServerLimits limits) {
  CHECK_NE(options.port, kHttpPortOff) << "the caller decides whether the dashboard is on";
  if (absl::Status s = ValidateHttpEndpoint(options, "dashboard port"); !s.ok()) return s;
  absl::StatusOr<int> fd = BindListener(options.host, options.port);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<DashboardHttpServer> server(
      new DashboardHttpServer(*fd, BoundPort(*fd), std::move(handler), limits));
  if (server->port_ <= 0 || server->wake_read_ < 0) {
    return absl::UnavailableError("dashboard: listener has no port or no wake-up pipe");
  }
  if (!options.port_file.empty()) {
    if (absl::Status s = WriteHttpPortFile(options.port_file, server->port_); !s.ok()) return s;
  }
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  LOG(INFO) << "dashboard on http://" << options.host << ":" << server->port_ << "/";
  return server;
}

DashboardHttpServer::DashboardHttpServer(int listen_fd, int port, HttpHandler handler,
                                         HttpServerLimits limits)
    : listen_fd_(listen_fd), port_(port), handler_(std::move(handler)), limits_(limits) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
    wake_read_ = fds[0];
    wake_write_ = fds[1];
  }
}

DashboardHttpServer::~DashboardHttpServer() {
  Stop();
  close(listen_fd_);
  if (wake_read_ >= 0) close(wake_read_);
  if (wake_write_ >= 0) close(wake_write_);
}

void DashboardHttpServer::Stop() {
  if (!thread_.joinable()) return;
  const char byte = 1;
  (void)!write(wake_write_, &byte, 1);
  thread_.join();
}

void DashboardHttpServer::Loop() {
  std::vector<Connection> conns;
  while (true) {
    // Slot 0: wake-up pipe; slot 1: listener (only while under the connection limit).
    std::vector<pollfd> fds = {{wake_read_, POLLIN, 0}, {listen_fd_, 0, 0}};
    if (conns.size() < static_cast<size_t>(limits_.max_connections)) fds[1].events = POLLIN;
    absl::Time next_deadline = absl::InfiniteFuture();
    for (const Connection& c : conns) {
      fds.push_back(
          {c.fd, c.phase == Connection::Phase::kWriting ? short{POLLOUT} : short{POLLIN}, 0});
      next_deadline = std::min(next_deadline, c.deadline);
    }
    int timeout_ms = -1;
    if (next_deadline != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(next_deadline - absl::Now()) + 1));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      LOG(ERROR) << "dashboard: poll: " << std::strerror(errno);
      break;
    }
    if (fds[0].revents != 0) break;  // Stop()
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      if (now >= c.deadline || Advance(c, fds[i + 2].revents, now, handler_, limits_)) {
        close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(conns, [](const Connection& c) { return c.fd < 0; });
    if (fds[1].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) conns.push_back({.fd = fd, .deadline = now + limits_.io_timeout});
    }
  }
  for (Connection& c : conns) close(c.fd);
}

}  // namespace moe
