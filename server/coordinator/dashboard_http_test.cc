// The dashboard's HTTP server over real sockets: GET/HEAD, other methods, malformed and oversized
// requests, idle connections that must not block others, and Stop.
#include "server/coordinator/dashboard_http.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/common/http_get.h"

namespace moe {
namespace {

using ::moe::testing::HttpExchange;
using ::moe::testing::HttpGet;

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

HttpReply Echo(absl::string_view path, absl::string_view query) {
  if (path == "/missing") return {404, "text/plain", "no\n"};
  return {200, "text/html; charset=utf-8", absl::StrCat("path=", path, " query=", query)};
}

std::unique_ptr<DashboardHttpServer> StartEcho(HttpServerLimits limits = {}) {
  absl::StatusOr<std::unique_ptr<DashboardHttpServer>> server =
      DashboardHttpServer::Start({"127.0.0.1", 0, ""}, Echo, limits);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

TEST(DashboardHttpTest, AnswersGetWithTheHandlersReply) {
  auto server = StartEcho();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<testing::HttpResponse> r =
      HttpGet("127.0.0.1", server->port(), "/api/load?x=1&y=2", Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "path=/api/load query=x=1&y=2");
  EXPECT_EQ(testing::HeaderValue(*r, "content-type"), "text/html; charset=utf-8");
  EXPECT_EQ(testing::HeaderValue(*r, "Content-Length"), absl::StrCat(r->body.size()));
  EXPECT_EQ(testing::HeaderValue(*r, "Connection"), "close");

  r = HttpGet("127.0.0.1", server->port(), "/missing", Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 404);
}

TEST(DashboardHttpTest, HeadOtherMethodsAndMalformedRequests) {
  auto server = StartEcho();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  absl::StatusOr<std::string> head =
      HttpExchange("127.0.0.1", port, "HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n", Deadline());
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_TRUE(absl::StartsWith(*head, "HTTP/1.1 200 OK\r\n")) << *head;
  EXPECT_TRUE(absl::StrContains(*head, "Content-Length: 14\r\n")) << *head;  // "path=/x query="
  EXPECT_TRUE(absl::EndsWith(*head, "\r\n\r\n")) << "HEAD has no body: " << *head;

  absl::StatusOr<std::string> post =
      HttpExchange("127.0.0.1", port, "POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", Deadline());
  ASSERT_TRUE(post.ok()) << post.status();
  EXPECT_TRUE(absl::StartsWith(*post, "HTTP/1.1 405 Method Not Allowed\r\n")) << *post;
  EXPECT_TRUE(absl::StrContains(*post, "Allow: GET, HEAD\r\n"));

  for (const char* bad :
       {"GET\r\n\r\n", "GET noslash HTTP/1.1\r\n\r\n", "GET / FTP/1\r\n\r\n", "\r\n\r\n"}) {
    absl::StatusOr<std::string> r = HttpExchange("127.0.0.1", port, bad, Deadline());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(absl::StartsWith(*r, "HTTP/1.1 400 Bad Request\r\n")) << bad << " -> " << *r;
  }
}

TEST(DashboardHttpTest, OversizedRequestGets431) {
  auto server = StartEcho({.max_request_bytes = 256});
  ASSERT_NE(server, nullptr);
  const std::string big = absl::StrCat("GET /", std::string(1000, 'a'), " HTTP/1.1\r\n\r\n");
  absl::StatusOr<std::string> r = HttpExchange("127.0.0.1", server->port(), big, Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::StartsWith(*r, "HTTP/1.1 431 ")) << *r;
}

TEST(DashboardHttpTest, SilentConnectionsNeitherBlockOthersNorLiveForever) {
  auto server = StartEcho({.io_timeout = absl::Milliseconds(300)});
  ASSERT_NE(server, nullptr);
  // A client that connects and sends nothing (like a browser's pre-connect).
  const int idle = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(server->port());
  ASSERT_EQ(connect(idle, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // Served while the idle connection is still open.
  const absl::Time start = absl::Now();
  absl::StatusOr<testing::HttpResponse> r =
      HttpGet("127.0.0.1", server->port(), "/", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(250));
  // The idle one is closed by the server after io_timeout: recv sees EOF well before 5 s.
  timeval tv{5, 0};
  setsockopt(idle, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char byte;
  EXPECT_EQ(recv(idle, &byte, 1, 0), 0);
  close(idle);
}

TEST(DashboardHttpTest, StopClosesTheListener) {
  auto server = StartEcho();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  server->Stop();
  server->Stop();  // idempotent
  server.reset();
  absl::StatusOr<testing::HttpResponse> r = HttpGet("127.0.0.1", port, "/", Deadline());
  EXPECT_FALSE(r.ok());
}

TEST(DashboardHttpTest, AnswerHttpRequestDirectly) {
  EXPECT_TRUE(absl::StartsWith(AnswerHttpRequest("GET /a?b HTTP/1.0\r\n\r\n", Echo),
                               "HTTP/1.1 200 OK\r\n"));
  EXPECT_TRUE(absl::EndsWith(AnswerHttpRequest("GET /a?b HTTP/1.0\r\n\r\n", Echo),
                             "\r\n\r\npath=/a query=b"));
  EXPECT_EQ(FormatHttpResponse({503, "text/plain", "x"}, true),
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 1\r\n"
            "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n"
            "\r\nx");
}

}  // namespace
}  // namespace moe
