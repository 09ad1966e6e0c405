// Tests for PrometheusMetrics: observer callbacks -> exposition text. (The
// live scrape over HTTP: metrics_http_test.cc.)
#include "server/metrics/prometheus_metrics.h"

#include <atomic>
#include <map>
#include <optional>
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
      {"layerserve_request_compute_seconds", "histogram"},
      {"layerserve_reply_wait_seconds", "histogram"},
      {"layerserve_batch_stage_seconds", "histogram"},
      {"layerserve_batch_size", "histogram"},
      {"layerserve_batch_tokens", "histogram"},
      {"layerserve_queue_depth", "gauge"},
      {"layerserve_inflight_requests", "gauge"},
      {"layerserve_rejections_total", "counter"},
      {"layerserve_request_tokens", "histogram"},
      {"process_cpu_seconds_total", "counter"},
      {"process_resident_memory_bytes", "gauge"},
      {"process_virtual_memory_bytes", "gauge"},
      {"process_open_fds", "gauge"},
      {"process_max_fds", "gauge"},
      {"process_start_time_seconds", "gauge"},
      {"process_threads", "gauge"},
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
        "layerserve_compute_duration_seconds", "layerserve_request_compute_seconds",
        "layerserve_reply_wait_seconds"}) {
    const std::vector<double> bounds = e.BucketBounds(family, {{"model", kModel}});
    ASSERT_GE(bounds.size(), 10u) << family;
    EXPECT_DOUBLE_EQ(bounds.front(), 50e-6) << family;
    EXPECT_DOUBLE_EQ(bounds.back(), 10.0) << family;
    for (size_t i = 1; i < bounds.size(); ++i) {
      EXPECT_LT(bounds[i - 1], bounds[i]) << family << " bucket " << i;
      // Ten steps a decade, so interpolation inside a bucket stays close.
      EXPECT_LE(bounds[i] / bounds[i - 1], 1.3) << family << " bucket " << i;
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

TEST(PrometheusMetricsTest, RequestsThatRanReportTheirBatchesComputeAndReplyWait) {
  PrometheusMetrics metrics(kModel);
  // Two requests of one 1 ms batch, one computed in two pieces, and one
  // refused before it ran: only those that ran are observed, each with its
  // own batches' time, however many requests shared them.
  metrics.OnBatchExecuted({.requests = 2, .tokens = 2, .compute_seconds = 0.001});
  metrics.OnRequestFinished({.model = kModel,
                             .code = "OK",
                             .duration_seconds = 0.003,
                             .tokens = 1,
                             .compute_seconds = 0.001});
  metrics.OnRequestFinished({.model = kModel,
                             .code = "OK",
                             .duration_seconds = 0.003,
                             .tokens = 1,
                             .compute_seconds = 0.001});
  metrics.OnRequestFinished({.model = kModel,
                             .code = "OK",
                             .duration_seconds = 0.009,
                             .tokens = 512,
                             .compute_seconds = 0.0035,
                             .reply_wait_seconds = 0.0002});
  metrics.OnRequestFinished(
      {.model = kModel, .code = "RESOURCE_EXHAUSTED", .duration_seconds = 20e-6, .tokens = 1});

  const Exposition e = Parse(metrics);
  const Labels model = {{"model", kModel}};
  EXPECT_EQ(e.Find("layerserve_request_compute_seconds_count", model), 3.0);
  EXPECT_NEAR(*e.Find("layerserve_request_compute_seconds_sum", model), 0.0055, 1e-12);
  // So does each one's wait for a reply thread, zero or not.
  EXPECT_EQ(e.Find("layerserve_reply_wait_seconds_count", model), 3.0);
  EXPECT_NEAR(*e.Find("layerserve_reply_wait_seconds_sum", model), 0.0002, 1e-12);
  EXPECT_EQ(e.Find("layerserve_compute_duration_seconds_count", model), 1.0);
  EXPECT_EQ(e.Find("layerserve_request_duration_seconds_count", model), 4.0);
}

// histogram_quantile as Prometheus computes it: find the bucket where the
// rank falls and interpolate linearly inside it.
double HistogramQuantile(const Exposition& e, const char* family, const Labels& labels, double q) {
  const std::vector<double> bounds = e.BucketBounds(family, labels);
  Labels inf = labels;
  inf["le"] = "+Inf";
  const double total = *e.Find(std::string(family) + "_bucket", inf);
  const double rank = q * total;
  double lower = 0, below = 0;
  for (double bound : bounds) {
    const double count = *e.BucketCount(family, labels, bound);
    if (count >= rank) return lower + (bound - lower) * (rank - below) / (count - below);
    lower = bound;
    below = count;
  }
  return bounds.back();
}

// Latencies spread over 10-12 ms: a 1-2.5-5 series put them all in the
// (10 ms, 25 ms] bucket and reported a p99 of 24.9 ms, the bucket's edge.
TEST(PrometheusMetricsTest, P99DoesNotSnapToABucketEdge) {
  PrometheusMetrics metrics(kModel);
  std::vector<double> latencies;
  for (int i = 0; i < 1000; ++i) latencies.push_back(10e-3 + 2e-3 * i / 999.0);
  for (double l : latencies) {
    metrics.OnRequestFinished({.model = kModel, .code = "OK", .duration_seconds = l, .tokens = 1});
  }
  const double exact = latencies[989];  // nearest rank
  const double p99 = HistogramQuantile(Parse(metrics), "layerserve_request_duration_seconds",
                                       {{"model", kModel}}, 0.99);
  EXPECT_NEAR(p99, exact, 0.1 * exact) << "p99 " << p99 * 1e3 << " ms, exact " << exact * 1e3;
}

TEST(PrometheusMetricsTest, RejectionsAreCountedByReason) {
  PrometheusMetrics metrics(kModel);
  const auto rejected = [](const Exposition& e, const std::string& model, const char* reason) {
    return e.Find("layerserve_rejections_total", {{"model", model}, {"reason", reason}});
  };
  // Every reason has a series from the start, so rate() has a zero; an
  // unknown model is only ever counted under model="other".
  Exposition e = Parse(metrics);
  for (const char* reason : {"resource_exhausted", "invalid", "unknown_session", "session_state",
                             "unavailable", "deadline", "cancelled"}) {
    EXPECT_EQ(rejected(e, kModel, reason), 0.0) << reason;
  }
  EXPECT_EQ(rejected(e, "other", "unknown_model"), 0.0);
  EXPECT_EQ(rejected(e, kModel, "unknown_model"), std::nullopt);
  EXPECT_EQ(rejected(e, "other", "unauthenticated"), 0.0);
  EXPECT_EQ(rejected(e, kModel, "unauthenticated"), std::nullopt);
  for (const char* code :
       {"RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAVAILABLE",
        "DEADLINE_EXCEEDED", "CANCELLED", "NOT_FOUND", "FAILED_PRECONDITION", "FAILED_PRECONDITION",
        "FAILED_PRECONDITION", "OK", "INTERNAL"}) {
    metrics.OnRequestFinished({.model = kModel, .code = code, .duration_seconds = 1e-3});
  }
  metrics.OnRequestFinished({.model = {}, .code = "NOT_FOUND", .duration_seconds = 1e-5});
  // A call refused for want of the bearer token, of any RPC.
  metrics.OnRequestFinished({.model = {}, .code = "UNAUTHENTICATED"});
  metrics.OnRequestFinished({.model = {}, .code = "UNAUTHENTICATED"});
  e = Parse(metrics);
  EXPECT_EQ(rejected(e, kModel, "resource_exhausted"), 2.0);
  EXPECT_EQ(rejected(e, kModel, "invalid"), 1.0);
  EXPECT_EQ(rejected(e, kModel, "unavailable"), 1.0);
  EXPECT_EQ(rejected(e, kModel, "deadline"), 1.0);
  EXPECT_EQ(rejected(e, kModel, "cancelled"), 1.0);
  // NOT_FOUND for the served model can only be the session table's.
  EXPECT_EQ(rejected(e, kModel, "unknown_session"), 1.0);
  EXPECT_EQ(rejected(e, kModel, "session_state"), 3.0);
  EXPECT_EQ(rejected(e, kModel, "unknown_model"), std::nullopt);
  EXPECT_EQ(rejected(e, "other", "unknown_model"), 1.0);
  EXPECT_EQ(rejected(e, "other", "unknown_session"), std::nullopt);
  EXPECT_EQ(rejected(e, "other", "unauthenticated"), 2.0);
  EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", "other"}, {"code", "UNAUTHENTICATED"}}),
            2.0);
  double total = 0;
  for (const auto& sample : e.samples) {
    if (sample.name == "layerserve_rejections_total") total += sample.value;
  }
  EXPECT_EQ(total, 13.0) << "OK and INTERNAL are no rejections";
  for (bool served : {true, false}) {
    EXPECT_EQ(RejectionReason("INTERNAL", served), "");
    EXPECT_EQ(RejectionReason("OK", served), "");
    EXPECT_EQ(RejectionReason("UNKNOWN", served), "");
    EXPECT_EQ(RejectionReason("FAILED_PRECONDITION", served), "session_state");
  }
  EXPECT_EQ(RejectionReason("NOT_FOUND", true), "unknown_session");
  EXPECT_EQ(RejectionReason("NOT_FOUND", false), "unknown_model");
  EXPECT_EQ(RejectionReason("UNAUTHENTICATED", false), "unauthenticated");
}

TEST(PrometheusMetricsTest, TokensPerRequest) {
  PrometheusMetrics metrics(kModel);
  for (int64_t tokens : {1, 8, 8, 300, 100000}) {
    metrics.OnRequestFinished(
        {.model = kModel, .code = "OK", .duration_seconds = 1e-3, .tokens = tokens});
  }
  // Never parsed (0 tokens), or not this model's: not observed.
  metrics.OnRequestFinished({.model = kModel, .code = "INVALID_ARGUMENT", .tokens = 0});
  metrics.OnRequestFinished({.model = {}, .code = "NOT_FOUND", .tokens = 0});
  const Exposition e = Parse(metrics);
  const Labels model = {{"model", kModel}};
  EXPECT_EQ(e.Find("layerserve_request_tokens_count", model), 5.0);
  EXPECT_EQ(e.Find("layerserve_request_tokens_sum", model), 100317.0);
  EXPECT_EQ(e.BucketCount("layerserve_request_tokens", model, 1), 1.0);
  EXPECT_EQ(e.BucketCount("layerserve_request_tokens", model, 8), 3.0);
  EXPECT_EQ(e.BucketCount("layerserve_request_tokens", model, 512), 4.0);
  EXPECT_EQ(e.BucketCount("layerserve_request_tokens", model, 65536), 4.0);
}

TEST(PrometheusMetricsTest, BuildInfoAndLimits) {
  PrometheusMetrics metrics(kModel);
  Exposition e = Parse(metrics);
  // No series before they are set: a limit of 0 would fire every ratio alert.
  for (const auto& sample : e.samples) {
    EXPECT_NE(sample.name.rfind("layerserve_max_", 0), 0u) << sample.name;
    EXPECT_NE(sample.name, "layerserve_build_info");
  }
  metrics.SetBuildInfo({.version = "0.1.0", .backend = "cpu", .device = "cpu"});
  metrics.SetBuildInfo({.version = "0.2.0", .backend = "cuda", .device = "NVIDIA H100 \"SXM\""});
  metrics.SetLimits({.max_queue_size = 1024,
                     .max_queue_bytes = int64_t{1} << 30,
                     .max_batch_tokens = 8192,
                     .max_queue_delay_seconds = 500e-6});
  e = Parse(metrics);
  int build_series = 0;
  for (const auto& sample : e.samples) build_series += sample.name == "layerserve_build_info";
  EXPECT_EQ(build_series, 1) << "a second SetBuildInfo must replace the series";
  EXPECT_EQ(e.Find("layerserve_build_info",
                   {{"version", "0.2.0"}, {"backend", "cuda"}, {"device", "NVIDIA H100 \"SXM\""}}),
            1.0);
  const Labels model = {{"model", kModel}};
  EXPECT_EQ(e.Find("layerserve_max_queue_size", model), 1024.0);
  EXPECT_EQ(e.Find("layerserve_max_queue_bytes", model), static_cast<double>(int64_t{1} << 30));
  EXPECT_EQ(e.Find("layerserve_max_batch_tokens", model), 8192.0);
  EXPECT_DOUBLE_EQ(*e.Find("layerserve_max_queue_delay_seconds", model), 500e-6);
  EXPECT_EQ(e.types["layerserve_build_info"], "gauge");
  EXPECT_EQ(e.types["layerserve_max_batch_tokens"], "gauge");
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

// A batch's compute time split as its backend measured it: infer is what
// input and output leave of it.
TEST(PrometheusMetricsTest, BatchStagesSplitTheComputeTime) {
  PrometheusMetrics metrics(kModel);
  metrics.OnBatchExecuted({.requests = 4,
                           .tokens = 4,
                           .compute_seconds = 0.010,
                           .ok = true,
                           .input_seconds = 0.001,
                           .output_seconds = 0.002});
  const Exposition e = Parse(metrics);
  const auto stage = [](const char* name) -> Labels {
    return {{"model", kModel}, {"stage", name}};
  };
  EXPECT_DOUBLE_EQ(*e.Find("layerserve_batch_stage_seconds_sum", stage("input")), 0.001);
  EXPECT_DOUBLE_EQ(*e.Find("layerserve_batch_stage_seconds_sum", stage("infer")), 0.007);
  EXPECT_DOUBLE_EQ(*e.Find("layerserve_batch_stage_seconds_sum", stage("output")), 0.002);
  EXPECT_EQ(e.Find("layerserve_batch_stage_seconds_count", stage("infer")), 1.0);
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
  metrics.SetKernelTimingSampleEvery(16);
  const Exposition e = Parse(metrics);
  // The sampling factor, which the dashboard scales the sampled time by.
  EXPECT_EQ(e.Find("layerserve_kernel_timing_sample_every", {{"model", kModel}}), 16.0);
  const Labels attention = {{"model", kModel}, {"op", "attention"}};
  EXPECT_EQ(e.Find("layerserve_kernel_duration_seconds_count", attention), 2.0);
  EXPECT_EQ(e.BucketCount("layerserve_kernel_duration_seconds", attention, 50e-6), 1.0);
  EXPECT_EQ(
      e.Find("layerserve_kernel_duration_seconds_count", {{"model", kModel}, {"op", "gemm_qkv"}}),
      1.0);
  EXPECT_EQ(e.Find("layerserve_gpu_memory_used_bytes", {{"model", kModel}}),
            static_cast<double>(int64_t{3} << 30));
}

// Batches by how the CUDA backend launched them (BatchTimings::launch); a
// backend that does not say (the CPU backend) counts under no launch.
TEST(PrometheusMetricsTest, BatchLaunchesFromTheCudaBackend) {
  PrometheusMetrics metrics(kModel);
  for (const char* launch : {"direct", "captured", "replayed", "replayed", ""}) {
    metrics.OnBatchExecuted(
        {.requests = 1, .tokens = 1, .compute_seconds = 1e-3, .launch = launch});
  }
  const Exposition e = Parse(metrics);
  const auto launches = [&](const std::string& launch) {
    return e.Find("layerserve_batch_launches_total", {{"model", kModel}, {"launch", launch}});
  };
  EXPECT_EQ(launches("direct"), 1.0);
  EXPECT_EQ(launches("captured"), 1.0);
  EXPECT_EQ(launches("replayed"), 2.0);
  EXPECT_EQ(e.Find("layerserve_batch_tokens_count", {{"model", kModel}}), 5.0);
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

// --- sessions and the KV cache -----------------------------------------------------

bool IsSessionFamily(const std::string& name) {
  for (const char* prefix :
       {"layerserve_session", "layerserve_kv_cache", "layerserve_max_sessions"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// The families of a server whose backend keeps no KV cache: none, not zeros
// (a max_sessions of 0 would fire any "sessions near the limit" alert).
TEST(PrometheusMetricsTest, GemmRoutesAfterSetGemmRoutes) {
  PrometheusMetrics metrics(kModel);
  for (const auto& sample : Parse(metrics).samples) EXPECT_NE(sample.name, "layerserve_gemm_route");
  metrics.SetGemmRoutes({{.shape = "1x1", .precision = "bf16", .m_max = 8, .kernel = "v0"}});
  metrics.SetGemmRoutes(
      {{.shape = "6144x4096", .precision = "fp8-block", .m_max = 16, .kernel = "v6s2"},
       {.shape = "6144x4096", .precision = "fp8-block", .m_max = 4096, .kernel = "v0"},
       {.shape = "28672x4096", .gated = true, .precision = "bf16", .m_max = 16, .kernel = "v4"}});
  Exposition e = Parse(metrics);
  int series = 0;
  for (const auto& sample : e.samples) series += sample.name == "layerserve_gemm_route";
  EXPECT_EQ(series, 3) << "a second SetGemmRoutes must replace the series";
  EXPECT_EQ(e.Find("layerserve_gemm_route", {{"model", kModel},
                                             {"shape", "6144x4096"},
                                             {"gated", "false"},
                                             {"precision", "fp8-block"},
                                             {"m_max", "4096"},
                                             {"kernel", "v0"}}),
            1.0);
  EXPECT_EQ(e.Find("layerserve_gemm_route", {{"model", kModel},
                                             {"shape", "28672x4096"},
                                             {"gated", "true"},
                                             {"precision", "bf16"},
                                             {"m_max", "16"},
                                             {"kernel", "v4"}}),
            1.0);
  EXPECT_EQ(e.types["layerserve_gemm_route"], "gauge");
}

TEST(PrometheusMetricsTest, ExpertTokensPerLayerAfterSetExperts) {
  PrometheusMetrics metrics(kModel);
  // Not a mixture of experts: no family, and batches carry no counts.
  metrics.OnBatchExecuted({.requests = 1, .tokens = 4});
  EXPECT_FALSE(Parse(metrics).types.contains("layerserve_expert_tokens_total"));

  // Model layers 5 and 6 of 3 experts each.
  metrics.SetExperts(5, 2, 3);
  Exposition e = Parse(metrics);
  EXPECT_EQ(e.types["layerserve_expert_tokens_total"], "counter");
  const auto series = [&](const Exposition& x, int layer, int expert) {
    return x.Find(
        "layerserve_expert_tokens_total",
        {{"model", kModel}, {"layer", std::to_string(layer)}, {"expert", std::to_string(expert)}});
  };
  EXPECT_EQ(series(e, 6, 2), 0.0);  // every series from the first scrape
  const std::vector<int64_t> first = {4, 0, 2, 1, 1, 4};
  const std::vector<int64_t> second = {0, 3, 0, 2, 1, 0};
  metrics.OnBatchExecuted({.requests = 2, .tokens = 3, .expert_tokens = first});
  metrics.OnBatchExecuted({.requests = 1, .tokens = 3, .expert_tokens = second});
  // A failed batch's routing is not counted, nor counts of the wrong size.
  metrics.OnBatchExecuted({.requests = 1, .tokens = 3, .ok = false, .expert_tokens = first});
  const std::vector<int64_t> wrong = {1, 1};
  metrics.OnBatchExecuted({.requests = 1, .tokens = 1, .expert_tokens = wrong});
  e = Parse(metrics);
  EXPECT_EQ(series(e, 5, 0), 4.0);
  EXPECT_EQ(series(e, 5, 1), 3.0);
  EXPECT_EQ(series(e, 5, 2), 2.0);
  EXPECT_EQ(series(e, 6, 0), 3.0);
  EXPECT_EQ(series(e, 6, 1), 2.0);
  EXPECT_EQ(series(e, 6, 2), 4.0);
}

TEST(PrometheusMetricsTest, NoSessionFamiliesWithoutAKvCache) {
  PrometheusMetrics metrics(kModel);
  metrics.OnSessions({.sessions_open = 3, .blocks_used = 5, .blocks_capacity = 8, .freed_end = 2});
  const Exposition e = Parse(metrics);
  for (const auto& [name, type] : e.types) EXPECT_FALSE(IsSessionFamily(name)) << name;
  for (const auto& sample : e.samples) EXPECT_FALSE(IsSessionFamily(sample.name)) << sample.name;
}

TEST(PrometheusMetricsTest, SessionFamiliesAfterSetKvCache) {
  PrometheusMetrics metrics(kModel);
  metrics.SetKvCache(
      {.block_tokens = 16, .blocks = 4096, .bytes = int64_t{3} << 30, .max_sessions = 512});
  Exposition e = Parse(metrics);
  const std::map<std::string, std::string> expected = {
      {"layerserve_sessions_open", "gauge"},
      {"layerserve_sessions_in_flight", "gauge"},
      {"layerserve_kv_cache_blocks_used", "gauge"},
      {"layerserve_kv_cache_blocks", "gauge"},
      {"layerserve_kv_cache_block_tokens", "gauge"},
      {"layerserve_kv_cache_bytes", "gauge"},
      {"layerserve_max_sessions", "gauge"},
      {"layerserve_sessions_freed_total", "counter"},
      {"layerserve_session_steps_rejected_total", "counter"},
  };
  for (const auto& [name, type] : expected) {
    auto it = e.types.find(name);
    ASSERT_NE(it, e.types.end()) << "missing family " << name;
    EXPECT_EQ(it->second, type) << name;
  }
  for (const auto& [name, type] : e.types) {
    EXPECT_TRUE(!IsSessionFamily(name) || expected.contains(name)) << "undocumented " << name;
  }
  const Labels model = {{"model", kModel}};
  EXPECT_EQ(e.Find("layerserve_kv_cache_block_tokens", model), 16.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks", model), 4096.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_bytes", model), static_cast<double>(int64_t{3} << 30));
  EXPECT_EQ(e.Find("layerserve_max_sessions", model), 512.0);
  EXPECT_EQ(e.Find("layerserve_sessions_open", model), 0.0);
  EXPECT_EQ(e.Find("layerserve_sessions_in_flight", model), 0.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks_used", model), 0.0);
  // Every reason has a series from the start, so rate() has a zero.
  for (const char* reason : {"end", "idle_timeout", "reset"}) {
    EXPECT_EQ(e.Find("layerserve_sessions_freed_total", {{"model", kModel}, {"reason", reason}}),
              0.0)
        << reason;
  }
  EXPECT_EQ(e.Find("layerserve_session_steps_rejected_total",
                   {{"model", kModel}, {"reason", "kv_memory"}}),
            0.0);

  // A second call sets the configuration again, with no second series.
  metrics.SetKvCache({.block_tokens = 32, .blocks = 100, .bytes = 1000, .max_sessions = 8});
  e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_kv_cache_block_tokens", model), 32.0);
  EXPECT_EQ(e.Find("layerserve_max_sessions", model), 8.0);
  int series = 0;
  for (const auto& sample : e.samples) series += sample.name == "layerserve_kv_cache_bytes";
  EXPECT_EQ(series, 1);
}

TEST(PrometheusMetricsTest, SessionGaugesAndCountersFollowTheTable) {
  PrometheusMetrics metrics(kModel);
  // Reported before SetKvCache: dropped, but the counts are cumulative, so
  // the first report after it counts them.
  metrics.OnSessions({.freed_end = 1});
  metrics.SetKvCache({.block_tokens = 16, .blocks = 64, .bytes = 1 << 20, .max_sessions = 8});
  const Labels model = {{"model", kModel}};
  const auto freed = [](const Exposition& e, const char* reason) {
    return e.Find("layerserve_sessions_freed_total", {{"model", kModel}, {"reason", reason}});
  };
  const auto rejected = [](const Exposition& e) {
    return e.Find("layerserve_session_steps_rejected_total",
                  {{"model", kModel}, {"reason", "kv_memory"}});
  };

  metrics.OnSessions({.sessions_open = 3,
                      .sessions_in_flight = 2,
                      .blocks_used = 40,
                      .blocks_capacity = 64,
                      .freed_end = 2,
                      .freed_idle = 1,
                      .freed_reset = 0,
                      .rejected_no_blocks = 5});
  Exposition e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_sessions_open", model), 3.0);
  EXPECT_EQ(e.Find("layerserve_sessions_in_flight", model), 2.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks_used", model), 40.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks", model), 64.0);
  EXPECT_EQ(freed(e, "end"), 2.0);
  EXPECT_EQ(freed(e, "idle_timeout"), 1.0);
  EXPECT_EQ(freed(e, "reset"), 0.0);
  EXPECT_EQ(freed(e, "drain"), 0.0);
  EXPECT_EQ(rejected(e), 5.0);

  // The counters grow by the counts' growth, not by the counts.
  metrics.OnSessions({.sessions_open = 1,
                      .blocks_used = 10,
                      .blocks_capacity = 64,
                      .freed_end = 4,
                      .freed_idle = 1,
                      .freed_reset = 3,
                      .freed_drain = 2,
                      .rejected_no_blocks = 5});
  e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_sessions_open", model), 1.0);
  EXPECT_EQ(e.Find("layerserve_sessions_in_flight", model), 0.0);
  EXPECT_EQ(freed(e, "drain"), 2.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks_used", model), 10.0);
  EXPECT_EQ(freed(e, "end"), 4.0);
  EXPECT_EQ(freed(e, "idle_timeout"), 1.0);
  EXPECT_EQ(freed(e, "reset"), 3.0);
  EXPECT_EQ(rejected(e), 5.0);

  // A report taken before the last one and delivered after it (two threads
  // racing): its counts are behind, so neither counters nor gauges go back.
  metrics.OnSessions({.sessions_open = 3,
                      .sessions_in_flight = 3,
                      .blocks_used = 50,
                      .blocks_capacity = 64,
                      .freed_end = 3,
                      .freed_idle = 1,
                      .freed_reset = 3,
                      .rejected_no_blocks = 5});
  e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_sessions_open", model), 1.0);
  EXPECT_EQ(e.Find("layerserve_kv_cache_blocks_used", model), 10.0);
  EXPECT_EQ(freed(e, "end"), 4.0);
  EXPECT_EQ(freed(e, "reset"), 3.0);
}

TEST(PrometheusMetricsTest, ConcurrentSessionReportsCountEachFreeOnce) {
  PrometheusMetrics metrics(kModel);
  metrics.SetKvCache({.block_tokens = 16, .blocks = 64, .bytes = 1 << 20, .max_sessions = 8});
  // Each report carries the table's counts as they stood when it was taken;
  // threads deliver them in any order.
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  std::atomic<int64_t> table_freed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, &table_freed] {
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t freed = table_freed.fetch_add(1) + 1;
        metrics.OnSessions({.sessions_open = freed % 8,
                            .blocks_capacity = 64,
                            .freed_end = freed,
                            .freed_idle = freed / 2,
                            .rejected_no_blocks = freed / 3});
        if (i % 100 == 0) metrics.Serialize();  // scrapes race with updates
      }
    });
  }
  for (auto& t : threads) t.join();
  constexpr int64_t kTotal = kThreads * kPerThread;
  const Exposition e = Parse(metrics);
  EXPECT_EQ(e.Find("layerserve_sessions_freed_total", {{"model", kModel}, {"reason", "end"}}),
            static_cast<double>(kTotal));
  EXPECT_EQ(
      e.Find("layerserve_sessions_freed_total", {{"model", kModel}, {"reason", "idle_timeout"}}),
      static_cast<double>(kTotal / 2));
  EXPECT_EQ(e.Find("layerserve_session_steps_rejected_total",
                   {{"model", kModel}, {"reason", "kv_memory"}}),
            static_cast<double>(kTotal / 3));
  // The newest report (the one with the largest counts) set the gauges.
  EXPECT_EQ(e.Find("layerserve_sessions_open", {{"model", kModel}}),
            static_cast<double>(kTotal % 8));
}

}  // namespace
}  // namespace layerserve
