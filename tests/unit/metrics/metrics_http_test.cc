// Tests for MetricsHttpServer: live scrapes of /metrics and /healthz over
// HTTP, the bearer token, start and stop.
#include "server/metrics/metrics_http.h"

#include <httplib.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/metrics/prometheus_metrics.h"
#include "tests/unit/metrics/exposition.h"
#include "tests/unit/metrics/raw_http.h"

namespace layerserve {
namespace {

using ::layerserve::testing::Exposition;
using ::layerserve::testing::ParseExposition;

constexpr char kModel[] = "demo";

TEST(MetricsHttpServerTest, ServesMetricsAndHealthOverHttp) {
  PrometheusMetrics metrics(kModel);
  metrics.OnRequestFinished({.model = kModel, .code = "OK", .duration_seconds = 0.001});
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res) << "GET /metrics failed: " << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u)
      << res->get_header_value("Content-Type");
  Exposition e = ParseExposition(res->body);
  EXPECT_TRUE(e.errors.empty()) << e.errors.front();
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "OK"}}), 1.0);

  // A later scrape sees later updates.
  metrics.OnRequestFinished({.model = kModel, .code = "OK", .duration_seconds = 0.001});
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  e = ParseExposition(res->body);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "OK"}}), 2.0);

  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  res = client.Get("/nothing-here");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);

  (*server)->Stop();
  httplib::Client after("127.0.0.1", port);
  after.set_connection_timeout(2);
  EXPECT_FALSE(after.Get("/metrics")) << "still serving after Stop()";
}

// The process_* families, read from /proc at scrape time, in a live scrape.
TEST(MetricsHttpServerTest, ProcessFamiliesDescribeThisProcess) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  // Each scrape is a connection of its own, which both ends have closed when
  // Get returns (it reads until the server closes): the same sockets, one
  // pair, are open at each scrape.
  const int port = (*server)->port();
  const auto scrape = [port] {
    const testing::Answer answer = testing::Get(port, "/metrics");
    EXPECT_EQ(answer.status, 200);
    EXPECT_TRUE(answer.closed);
    Exposition e = ParseExposition(answer.Body());
    EXPECT_TRUE(e.errors.empty()) << e.errors.front();
    return e;
  };
  // Burn some CPU so the counter is visibly above zero: 50 ms by the process's
  // CPU clock (a loop timed by the wall clock gets less on a loaded machine).
  volatile double sink = 0;
  const std::clock_t busy_until = std::clock() + CLOCKS_PER_SEC / 20;
  while (std::clock() < busy_until) sink = sink + 1;

  const Exposition before = scrape();
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_GT(before.Find("process_cpu_seconds_total", {}).value_or(0), 0.02);
  const double start = before.Find("process_start_time_seconds", {}).value_or(0);
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 3600) << "the test process started over an hour ago?";
  EXPECT_GT(before.Find("process_resident_memory_bytes", {}).value_or(0), 1 << 20);
  EXPECT_GE(before.Find("process_virtual_memory_bytes", {}).value_or(0),
            before.Find("process_resident_memory_bytes", {}).value_or(0));
  EXPECT_GE(before.Find("process_threads", {}).value_or(0), 2.0);  // this one and the server's
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_EQ(before.Find("process_max_fds", {}), static_cast<double>(limit.rlim_cur));

  // Ten more open files show up in the next scrape.
  std::vector<FILE*> files;
  for (int i = 0; i < 10; ++i) files.push_back(std::fopen("/proc/self/stat", "r"));
  const Exposition after = scrape();
  for (FILE* f : files) std::fclose(f);
  EXPECT_EQ(after.Find("process_open_fds", {}).value_or(0) -
                before.Find("process_open_fds", {}).value_or(0),
            10.0);
  (*server)->Stop();
}

TEST(MetricsHttpServerTest, StopDoesNotWaitForIdleKeepAliveConnections) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  // Prometheus keeps its scrape connection open between scrapes.
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_keep_alive(true);
  client.set_read_timeout(5);
  ASSERT_TRUE(client.Get("/metrics"));
  const auto start = std::chrono::steady_clock::now();
  (*server)->Stop();
  const double stop_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(stop_seconds, 2.0) << "Stop() waited on an idle keep-alive connection";
}

TEST(MetricsHttpServerTest, BusyPortIsAnError) {
  PrometheusMetrics metrics(kModel);
  auto first = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsHttpServer::Start("127.0.0.1", (*first)->port(), &metrics);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_FALSE(MetricsHttpServer::Start("127.0.0.1", 70000, &metrics).ok());
  EXPECT_FALSE(MetricsHttpServer::Start("127.0.0.1", 0, nullptr).ok());
}

// With a token, what is not open answers 401 with a challenge and a message
// that quotes nothing sent; the right token, or an open path, gets through.
TEST(MetricsHttpServerTest, TokenGuardsWhatIsNotOpen) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start(
      "127.0.0.1", 0, &metrics,
      {.auth_token = "scrape-token", .metrics_open = false, .healthz_open = true});
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_read_timeout(5);

  httplib::Result refused = client.Get("/metrics");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->get_header_value("WWW-Authenticate"), "Bearer realm=\"layerserve\"");
  EXPECT_FALSE(absl::StrContains(refused->body, "layerserve_requests_total"));

  httplib::Result wrong = client.Get("/metrics", {{"Authorization", "Bearer guessed-token"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  EXPECT_FALSE(absl::StrContains(wrong->body, "guessed")) << wrong->body;

  httplib::Result scraped = client.Get("/metrics", {{"authorization", "Bearer scrape-token"}});
  ASSERT_TRUE(scraped);
  EXPECT_EQ(scraped->status, 200);
  EXPECT_TRUE(absl::StrContains(scraped->body, "layerserve_requests_total"));

  httplib::Result health = client.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  (*server)->Stop();
}

TEST(MetricsHttpServerTest, HttpsWithoutItsFilesIsAnError) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start(
      "127.0.0.1", 0, &metrics,
      {.tls_cert_file = "/no/such/cert.pem", .tls_key_file = "/no/such/key.pem"});
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(server.status().message(), "--tls-cert-file=/no/such/cert.pem"))
      << server.status();
  EXPECT_FALSE(
      MetricsHttpServer::Start("127.0.0.1", 0, &metrics, {.tls_cert_file = "/cert.pem"}).ok())
      << "a certificate without a key";
}

TEST(MetricsHttpServerTest, StopRightAfterStartDoesNotHang) {
  PrometheusMetrics metrics(kModel);
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
    ASSERT_TRUE(server.ok()) << server.status();
    (*server)->Stop();
    (*server)->Stop();  // idempotent; the destructor stops a third time
  }
}
}  // namespace
}  // namespace layerserve
