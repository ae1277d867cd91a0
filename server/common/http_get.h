// A minimal HTTP/1.0 GET client over plain sockets for tests: every step (connect, send, receive)
// is bound by one deadline, the response size is capped, and the server must close the connection
// after the response (HTTP/1.0 without keep-alive), so no chunked or pipelined parsing is needed.
//
// Callers: metrics and dashboard tests. Thread-safety: stateless; safe from any thread.
// Ownership: nothing is kept between calls.
#ifndef MOE_SERVER_COMMON_HTTP_GET_H_
#define MOE_SERVER_COMMON_HTTP_GET_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moe::testing {

struct HttpResponse {
  int status = 0;       // from the status line, e.g. 200
  std::string headers;  // the raw header block, status line excluded
  std::string body;
};

// Sends `request_target` (e.g. "/metrics") to `host`:`port` (a numeric address or a name).
// DEADLINE_EXCEEDED when the deadline passes, UNAVAILABLE when the connection fails,
// RESOURCE_EXHAUSTED above `max_bytes`, INTERNAL for a malformed response.
absl::StatusOr<HttpResponse> HttpGet(absl::string_view host, int port,
                                     absl::string_view request_target, absl::Time deadline,
                                     size_t max_bytes = 64 << 20);

// Sends `raw` verbatim and returns everything the server answers until it closes (for tests of
// malformed requests). Same errors as HttpGet.
absl::StatusOr<std::string> HttpExchange(absl::string_view host, int port, absl::string_view raw,
                                         absl::Time deadline, size_t max_bytes = 1 << 20);

// The value of header `name` (case-insensitive) in `headers`, or "" when absent.
std::string HeaderValue(const HttpResponse& response, absl::string_view name);

}  // namespace moe::testing

#endif  // MOE_SERVER_COMMON_HTTP_GET_H_
