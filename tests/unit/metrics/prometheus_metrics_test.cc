// Tests for PrometheusMetrics (observer callbacks -> exposition text) and
// MetricsHttpServer (a live scrape over HTTP).
#include "server/metrics/prometheus_metrics.h"

#include <httplib.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/metrics/exposition.h"

namespace layerserve {
namespace {

using ::layerserve::testing::Exposition;
using ::layerserve::testing::ParseExposition;
using Labels = std::map<std::string, std::string>;

constexpr char kModel[] = "demo";

Exposition Parse(const PrometheusMetrics& metrics) {
  const std::string text = metrics.Serialize();
  Exposition e = ParseExposition(text);
  EXPECT_TRUE(e.errors.empty()) << "unparsed line: " << e.errors.front() << "\nin:\n" << text;
  return e;
}

TEST(PrometheusMetricsTest, EveryFamilyIsExposedWithItsType) {
  PrometheusMetrics metrics(kModel);
  const Exposition e = Parse(metrics);
  const std::map<std::string, std::string> expected = {
      {"layerserve_requests_total", "counter"},
      {"layerserve_request_duration_seconds", "histogram"},
      {"layerserve_queue_duration_seconds", "histogram"},
      {"layerserve_compute_duration_seconds", "histogram"},
      {"layerserve_batch_size", "histogram"},
      {"layerserve_batch_tokens", "histogram"},
      {"layerserve_queue_depth", "gauge"},
      {"layerserve_inflight_requests", "gauge"},
  };
  for (const auto& [name, type] : expected) {
    auto it = e.types.find(name);
    ASSERT_NE(it, e.types.end()) << "missing family " << name;
    EXPECT_EQ(it->second, type) << name;
  }
  // Before any traffic: the OK series exists at zero, histograms are empty.
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "OK"}}), 0.0);
  EXPECT_EQ(e.Find("layerserve_request_duration_seconds_count", {{"model", kModel}}), 0.0);
  EXPECT_EQ(e.Find("layerserve_queue_depth", {{"model", kModel}}), 0.0);
}

TEST(PrometheusMetricsTest, BucketBoundsSpanTheDocumentedRanges) {
  PrometheusMetrics metrics(kModel);
  const Exposition e = Parse(metrics);
  for (const char* family :
       {"layerserve_request_duration_seconds", "layerserve_queue_duration_seconds",
        "layerserve_compute_duration_seconds"}) {
    const std::vector<double> bounds = e.BucketBounds(family, {{"model", kModel}});
    ASSERT_GE(bounds.size(), 10u) << family;
    EXPECT_DOUBLE_EQ(bounds.front(), 50e-6) << family;
    EXPECT_DOUBLE_EQ(bounds.back(), 10.0) << family;
    for (size_t i = 1; i < bounds.size(); ++i) {
      EXPECT_LT(bounds[i - 1], bounds[i]) << family << " bucket " << i;
      // No gap wider than a decade, so every latency lands in a useful bucket.
      EXPECT_LE(bounds[i] / bounds[i - 1], 10.0) << family << " bucket " << i;
    }
  }
  std::vector<double> sizes, tokens;
  for (double b = 1; b <= 1024; b *= 2) sizes.push_back(b);
  for (double b = 1; b <= 65536; b *= 2) tokens.push_back(b);
  EXPECT_EQ(e.BucketBounds("layerserve_batch_size", {{"model", kModel}}), sizes);
  EXPECT_EQ(e.BucketBounds("layerserve_batch_tokens", {{"model", kModel}}), tokens);
}

TEST(PrometheusMetricsTest, RequestsAreCountedByCodeAndTimed) {
  PrometheusMetrics metrics(kModel);
  metrics.OnRequestFinished(
      {.model = kModel, .code = "OK", .duration_seconds = 0.003, .tokens = 8});
  metrics.OnRequestFinished(
      {.model = kModel, .code = "OK", .duration_seconds = 0.004, .tokens = 8});
  metrics.OnRequestFinished(
      {.model = kModel, .code = "INVALID_ARGUMENT", .duration_seconds = 20e-6, .tokens = 0});
  // A name the server does not serve must not become a label value.
  metrics.OnRequestFinished(
      {.model = "made-up-name", .code = "NOT_FOUND", .duration_seconds = 1e-5, .tokens = 0});

  const Exposition e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "OK"}}), 2.0);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "INVALID_ARGUMENT"}}),
            1.0);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", "other"}, {"code", "NOT_FOUND"}}), 1.0);
  for (const auto& s : e.samples) {
    auto it = s.labels.find("model");
    if (it != s.labels.end())
      EXPECT_NE(it->second, "made-up-name") << "label leaked into " << s.name;
  }

  const Labels model = {{"model", kModel}};
  const char* family = "layerserve_request_duration_seconds";
  EXPECT_EQ(e.Find("layerserve_request_duration_seconds_count", model), 3.0);
  EXPECT_NEAR(*e.Find("layerserve_request_duration_seconds_sum", model), 0.00702, 1e-12);
  EXPECT_EQ(e.BucketCount(family, model, 50e-6), 1.0);   // the 20 us failure
  EXPECT_EQ(e.BucketCount(family, model, 2.5e-3), 1.0);  // 3 ms and 4 ms are above
  EXPECT_EQ(e.BucketCount(family, model, 5e-3), 3.0);
  EXPECT_EQ(e.BucketCount(family, model, 10.0), 3.0);
  EXPECT_EQ(
      e.Find("layerserve_request_duration_seconds_bucket", {{"model", kModel}, {"le", "+Inf"}}),
      3.0);
}

TEST(PrometheusMetricsTest, BatchesAndQueueFillTheirHistograms) {
  PrometheusMetrics metrics(kModel);
  metrics.OnBatchExecuted({.requests = 3, .tokens = 100, .compute_seconds = 0.0004, .ok = true});
  metrics.OnBatchExecuted({.requests = 1, .tokens = 1, .compute_seconds = 0.02, .ok = false});
  metrics.OnBatchExecuted({.requests = 2000, .tokens = 100000, .compute_seconds = 30, .ok = true});
  metrics.OnDequeued({.queue_seconds = 60e-6});
  metrics.OnDequeued({.queue_seconds = 0.2});

  const Exposition e = Parse(metrics);
  const Labels model = {{"model", kModel}};
  EXPECT_EQ(e.Find("layerserve_batch_size_count", model), 3.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_size", model, 1), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_size", model, 2), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_size", model, 4), 2.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_size", model, 1024), 2.0);  // 2000 only in +Inf
  EXPECT_EQ(e.Find("layerserve_batch_size_sum", model), 2004.0);

  EXPECT_EQ(e.BucketCount("layerserve_batch_tokens", model, 64), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_tokens", model, 128), 2.0);
  EXPECT_EQ(e.BucketCount("layerserve_batch_tokens", model, 65536), 2.0);
  EXPECT_EQ(e.Find("layerserve_batch_tokens_bucket", {{"model", kModel}, {"le", "+Inf"}}), 3.0);

  EXPECT_EQ(e.BucketCount("layerserve_compute_duration_seconds", model, 500e-6), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_compute_duration_seconds", model, 25e-3), 2.0);
  EXPECT_EQ(e.BucketCount("layerserve_compute_duration_seconds", model, 10.0), 2.0);
  EXPECT_EQ(e.Find("layerserve_compute_duration_seconds_count", model), 3.0);

  EXPECT_EQ(e.BucketCount("layerserve_queue_duration_seconds", model, 50e-6), 0.0);
  EXPECT_EQ(e.BucketCount("layerserve_queue_duration_seconds", model, 100e-6), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_queue_duration_seconds", model, 250e-3), 2.0);
}

TEST(PrometheusMetricsTest, GaugesHoldTheLastValue) {
  PrometheusMetrics metrics(kModel);
  metrics.OnQueueDepth(7);
  metrics.OnQueueDepth(5);
  metrics.OnInflight(3);
  metrics.OnInflight(1);
  const Exposition e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_queue_depth", {{"model", kModel}}), 5.0);
  EXPECT_EQ(e.Find("layerserve_inflight_requests", {{"model", kModel}}), 1.0);
}

TEST(PrometheusMetricsTest, KernelTimesAndGpuMemoryFromTheCudaBackend) {
  PrometheusMetrics metrics(kModel);
  metrics.OnKernelTime("attention", 40e-6);
  metrics.OnKernelTime("attention", 3e-3);
  metrics.OnKernelTime("gemm_qkv", 20e-6);
  metrics.SetGpuMemoryUsedBytes(int64_t{3} << 30);
  const Exposition e = Parse(metrics);
  const Labels attention = {{"model", kModel}, {"op", "attention"}};
  EXPECT_EQ(e.Find("layerserve_kernel_duration_seconds_count", attention), 2.0);
  EXPECT_EQ(e.BucketCount("layerserve_kernel_duration_seconds", attention, 50e-6), 1.0);
  EXPECT_EQ(
      e.Find("layerserve_kernel_duration_seconds_count", {{"model", kModel}, {"op", "gemm_qkv"}}),
      1.0);
  EXPECT_EQ(e.Find("layerserve_gpu_memory_used_bytes", {{"model", kModel}}),
            static_cast<double>(int64_t{3} << 30));
}

TEST(PrometheusMetricsTest, ConcurrentCallbacksLoseNothing) {
  PrometheusMetrics metrics(kModel);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      const char* code = t % 2 == 0 ? "OK" : "UNAVAILABLE";
      for (int i = 0; i < kPerThread; ++i) {
        metrics.OnRequestFinished({.model = kModel, .code = code, .duration_seconds = 1e-3});
        metrics.OnBatchExecuted({.requests = 1, .tokens = 8, .compute_seconds = 1e-3});
        if (i % 100 == 0) metrics.Serialize();  // scrapes race with updates
      }
    });
  }
  for (auto& t : threads) t.join();
  const Exposition e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "OK"}}),
            kThreads / 2 * kPerThread);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", kModel}, {"code", "UNAVAILABLE"}}),
            kThreads / 2 * kPerThread);
  EXPECT_EQ(e.Find("layerserve_batch_tokens_count", {{"model", kModel}}), kThreads * kPerThread);
}

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
