// DashboardHttpServer: a deliberately small HTTP/1.1 server for the coordinator's dashboard, on
// plain sockets. It answers GET and HEAD only, one request per connection (Connection: close),
// with the whole reply built by a handler; nothing else about HTTP is supported.
//
// Robustness limits: requests larger than max_request_bytes get 431; a connection that has not
// finished within io_timeout is dropped; at most max_connections are open at once (further ones
// wait in the listen backlog). All connections are multiplexed by one thread with poll(), so a
// client that connects and sends nothing (browsers pre-connect) cannot stall the others.
//
// Created by CoordinatorObservability. Thread-safety: the handler runs on the server's thread, one
// request at a time; Stop may be called from any thread. Ownership: owns its sockets and thread;
// the handler's captures must outlive the server.
#ifndef MOE_SERVER_COORDINATOR_DASHBOARD_HTTP_H_
#define MOE_SERVER_COORDINATOR_DASHBOARD_HTTP_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/common/metrics.h"

namespace moe {

struct HttpReply {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// Called with the request target split at '?': path (starting with '/') and query (no '?').
using HttpHandler = std::function<HttpReply(absl::string_view path, absl::string_view query)>;

struct HttpServerLimits {
  size_t max_request_bytes = 8192;
  absl::Duration io_timeout = absl::Seconds(5);
  int max_connections = 32;
};

class DashboardHttpServer {
 public:
  // Binds options.host:options.port (0: a free port), writes the port file if asked, and starts
  // serving. UNAVAILABLE when the address cannot be bound. REQUIRES: options.port != kHttpPortOff.
  static absl::StatusOr<std::unique_ptr<DashboardHttpServer>> Start(
      const HttpEndpointOptions& options, HttpHandler handler, HttpServerLimits limits = {});

  DashboardHttpServer(const DashboardHttpServer&) = delete;
  DashboardHttpServer& operator=(const DashboardHttpServer&) = delete;
  ~DashboardHttpServer();  // Stop()

  int port() const { return port_; }
  // Closes the listener and every connection and joins the thread; the handler is not called
  // after this returns. Idempotent.
  void Stop();

 private:
  DashboardHttpServer(int listen_fd, int port, HttpHandler handler, HttpServerLimits limits);
  void Loop();

  const int listen_fd_;
  const int port_;
  const HttpHandler handler_;
  const HttpServerLimits limits_;
  int wake_read_ = -1;  // the loop polls it; Stop writes to wake_write_
  int wake_write_ = -1;
  std::thread thread_;
};

// The reply to one raw request head (everything up to and including the blank line), exposed for
// tests: 405 for methods other than GET/HEAD, 400 for a malformed request line, otherwise the
// handler's reply. HEAD gets the headers only.
std::string AnswerHttpRequest(absl::string_view request_head, const HttpHandler& handler);

// A full HTTP/1.1 response with Content-Length and Connection: close.
std::string FormatHttpResponse(const HttpReply& reply, bool include_body);

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_DASHBOARD_HTTP_H_
