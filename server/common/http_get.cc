#include "server/common/http_get.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace moe::testing {
namespace {

// Closes the descriptor on every return path.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Waits until `fd` is ready for `events` or the deadline passes.
absl::Status WaitFor(int fd, short events, absl::Time deadline, absl::string_view what) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("HTTP ", what, ": deadline exceeded"));
    }
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
    const int r = poll(&p, 1, ms);
    if (r > 0) return absl::OkStatus();
    if (r < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("HTTP ", what, ": poll: ", std::strerror(errno)));
    }
  }
}

absl::StatusOr<int> Connect(absl::string_view host, int port, absl::Time deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string host_str(host), port_str = absl::StrCat(port);
  if (getaddrinfo(host_str.c_str(), port_str.c_str(), &hints, &found) != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int r = fd < 0 ? -1 : connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (r < 0 && errno != EINPROGRESS) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("connect ", host, ":", port, ": ", std::strerror(err)));
  }
  if (r < 0) {
    if (absl::Status s = WaitFor(fd, POLLOUT, deadline, "connect"); !s.ok()) {
      close(fd);
      return s;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      close(fd);
      return absl::UnavailableError(
          absl::StrCat("connect ", host, ":", port, ": ", std::strerror(err)));
    }
  }
  return fd;
}

absl::Status SendAll(int fd, absl::string_view data, absl::Time deadline) {
  while (!data.empty()) {
    if (absl::Status s = WaitFor(fd, POLLOUT, deadline, "send"); !s.ok()) return s;
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("HTTP send: ", std::strerror(errno)));
    }
    if (n > 0) data.remove_prefix(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReceiveUntilClose(int fd, absl::Time deadline, size_t max_bytes) {
  std::string out;
  std::vector<char> buf(64 << 10);
  while (true) {
    if (absl::Status s = WaitFor(fd, POLLIN, deadline, "receive"); !s.ok()) return s;
    const ssize_t n = recv(fd, buf.data(), buf.size(), 0);
    if (n == 0) return out;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      // A reset after a complete answer still carries the answer (servers that close early).
      if (errno == ECONNRESET && !out.empty()) return out;
      return absl::UnavailableError(absl::StrCat("HTTP receive: ", std::strerror(errno)));
    }
    out.append(buf.data(), n);
    if (out.size() > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("HTTP response over ", max_bytes, " bytes"));
    }
  }
}

}  // namespace

absl::StatusOr<std::string> HttpExchange(absl::string_view host, int port, absl::string_view raw,
                                         absl::Time deadline, size_t max_bytes) {
  absl::StatusOr<int> fd = Connect(host, port, deadline);
  if (!fd.ok()) return fd.status();
  Fd closer(*fd);
  if (absl::Status s = SendAll(*fd, raw, deadline); !s.ok()) return s;
  return ReceiveUntilClose(*fd, deadline, max_bytes);
}

absl::StatusOr<HttpResponse> HttpGet(absl::string_view host, int port,
                                     absl::string_view request_target, absl::Time deadline,
                                     size_t max_bytes) {
  const std::string request = absl::StrCat("GET ", request_target, " HTTP/1.0\r\nHost: ", host, ":",
                                           port, "\r\nConnection: close\r\n\r\n");
  absl::StatusOr<std::string> raw = HttpExchange(host, port, request, deadline, max_bytes);
  if (!raw.ok()) return raw.status();
  const size_t head_end = raw->find("\r\n\r\n");
  if (head_end == std::string::npos) {
    return absl::InternalError(absl::StrCat("HTTP response without a header end: ", *raw));
  }
  const absl::string_view head = absl::string_view(*raw).substr(0, head_end);
  const size_t line_end = head.find("\r\n");
  const absl::string_view status_line = head.substr(0, line_end);
  std::vector<absl::string_view> parts = absl::StrSplit(status_line, absl::MaxSplits(' ', 2));
  HttpResponse response;
  if (parts.size() < 2 || !absl::StartsWith(parts[0], "HTTP/1.") ||
      !absl::SimpleAtoi(parts[1], &response.status)) {
    return absl::InternalError(absl::StrCat("bad HTTP status line: ", status_line));
  }
  if (line_end != absl::string_view::npos)
    response.headers = std::string(head.substr(line_end + 2));
  response.body = raw->substr(head_end + 4);
  return response;
}

std::string HeaderValue(const HttpResponse& response, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(response.headers, "\r\n")) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    if (absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(line.substr(0, colon)), name)) {
      return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return "";
}

}  // namespace moe::testing
