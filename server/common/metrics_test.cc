// The metrics endpoint over real HTTP on port 0, the scrape-time family builders, and the
// test-side text-format parser and HTTP client.
#include "server/common/metrics.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/common/http_get.h"
#include "server/common/prometheus_text.h"

namespace moe {
namespace {

using ::moe::testing::HttpGet;
using ::moe::testing::ParsePrometheusText;
using ::moe::testing::PromScrape;

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

// A scrape-time family: two gauges and a counter, computed when scraped.
class FixedCollectable : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily g = GaugeFamily("test_balancedness", "per layer");
    AddSample(g, 0.5, {{"layer", "0"}});
    AddSample(g, 0.25, {{"layer", "1"}});
    prometheus::MetricFamily c = CounterFamily("test_routes_total", "routes");
    AddSample(c, 1234);
    return {g, c};
  }
};

TEST(MetricsEndpointTest, ServesRegistryAndScrapeTimeFamiliesOnAFreePort) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& requests =
      prometheus::BuildCounter().Name("test_requests_total").Help("requests").Register(*registry);
  requests.Add({{"layer", "3"}}).Increment(7);
  auto& latency = prometheus::BuildHistogram()
                      .Name("test_latency_seconds")
                      .Help("latency")
                      .Register(*registry)
                      .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.01, 0.1});
  latency.Observe(0.0005);
  latency.Observe(0.05);
  latency.Observe(5);
  auto fixed = std::make_shared<FixedCollectable>();

  const std::string port_file = absl::StrCat(std::getenv("TEST_TMPDIR"), "/metrics.port");
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
      MetricsEndpoint::Start({"127.0.0.1", 0, port_file}, {registry, fixed});
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);
  std::ifstream in(port_file);
  int from_file = 0;
  in >> from_file;
  EXPECT_EQ(from_file, port);

  absl::StatusOr<testing::HttpResponse> response =
      HttpGet("127.0.0.1", port, "/metrics", Deadline());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);
  absl::StatusOr<PromScrape> scrape = ParsePrometheusText(response->body);
  ASSERT_TRUE(scrape.ok()) << scrape.status() << "\n" << response->body;
  EXPECT_EQ(scrape->Value("test_requests_total", {{"layer", "3"}}), 7.0);
  EXPECT_EQ(scrape->types.at("test_requests_total"), "counter");
  EXPECT_EQ(scrape->Value("test_latency_seconds_bucket", {{"le", "0.001"}}), 1.0);
  EXPECT_EQ(scrape->Value("test_latency_seconds_bucket", {{"le", "0.1"}}), 2.0);
  EXPECT_EQ(scrape->Value("test_latency_seconds_bucket", {{"le", "+Inf"}}), 3.0);
  EXPECT_EQ(scrape->Value("test_latency_seconds_count"), 3.0);
  EXPECT_NEAR(*scrape->Value("test_latency_seconds_sum"), 5.0505, 1e-9);
  EXPECT_EQ(scrape->Value("test_balancedness", {{"layer", "1"}}), 0.25);
  EXPECT_EQ(scrape->types.at("test_balancedness"), "gauge");
  EXPECT_EQ(scrape->Value("test_routes_total"), 1234.0);
  EXPECT_EQ(scrape->types.at("test_routes_total"), "counter");

  // Scrape-time families follow the source: a second scrape sees new counts.
  requests.Add({{"layer", "3"}}).Increment(2);
  response = HttpGet("127.0.0.1", port, "/metrics", Deadline());
  ASSERT_TRUE(response.ok()) << response.status();
  scrape = ParsePrometheusText(response->body);
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(scrape->Value("test_requests_total", {{"layer", "3"}}), 9.0);
}

TEST(MetricsEndpointTest, BusyPortIsUnavailableAndBadPortIsInvalid) {
  // Hold a listening socket so the endpoint's bind must fail.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int busy = ntohs(addr.sin_port);
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
      MetricsEndpoint::Start({"127.0.0.1", busy, ""}, {});
  close(fd);
  ASSERT_FALSE(endpoint.ok());
  EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kUnavailable) << endpoint.status();

  EXPECT_EQ(ValidateHttpEndpoint({"127.0.0.1", 70000, ""}, "--metrics_port").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHttpEndpoint({"127.0.0.1", -2, ""}, "--metrics_port").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateHttpEndpoint({"127.0.0.1", kHttpPortOff, ""}, "--metrics_port").ok());
}

TEST(MetricsBuildersTest, ExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  const std::vector<double> b = ExponentialBuckets(1e-4, 10, 3);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_DOUBLE_EQ(b[2], 1e-2);
}

TEST(PrometheusTextTest, ParsesEscapesInfinitiesAndTimestamps) {
  absl::StatusOr<PromScrape> scrape = ParsePrometheusText(
      "# HELP a_total things\n"
      "# TYPE a_total counter\n"
      "a_total{path=\"/x\\\"y\\\\z\\n\",code=\"OK\",} 3 1700000000000\n"
      "b_bucket{le=\"+Inf\"} 4\n"
      "c Nan\n"
      "d -Inf\n\n");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  ASSERT_EQ(scrape->samples.size(), 4u);
  EXPECT_EQ(scrape->samples[0].labels.at("path"), "/x\"y\\z\n");
  EXPECT_EQ(scrape->Value("a_total", {{"code", "OK"}}), 3.0);
  EXPECT_EQ(scrape->types.at("a_total"), "counter");
  EXPECT_EQ(scrape->Value("b_bucket", {{"le", "+Inf"}}), 4.0);
  EXPECT_TRUE(std::isnan(scrape->samples[2].value));
  EXPECT_TRUE(std::isinf(scrape->samples[3].value) && scrape->samples[3].value < 0);
  EXPECT_FALSE(scrape->Value("a_total", {{"code", "NOT_FOUND"}}).has_value());
}

TEST(PrometheusTextTest, RejectsMalformedLines) {
  for (const char* bad : {"x{a=\"1\"", "x{a=1} 2", "x 1 2 3", "{a=\"b\"} 1", "x",
                          "x{a=\"1\",a=\"2\"} 1", "x{a=\"\\q\"} 1", "x abc"}) {
    EXPECT_FALSE(ParsePrometheusText(bad).ok()) << bad;
  }
}

TEST(HttpGetTest, RefusedConnectionIsUnavailable) {
  // Bind then close: the port is almost certainly free and nothing listens there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  absl::StatusOr<testing::HttpResponse> r =
      HttpGet("127.0.0.1", ntohs(addr.sin_port), "/", Deadline());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
}

}  // namespace
}  // namespace moe
