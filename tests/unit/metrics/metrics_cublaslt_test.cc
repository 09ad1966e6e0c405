// Proves that /metrics works in a process that has libcublasLt loaded.
//
// libcublasLt carries a ~94 KB static TLS block, which glibc carves out of
// every thread's stack; prometheus-cpp's civetweb Exposer starts its threads
// with 100 KB stacks, which then cannot be created and the endpoint dies.
// MetricsHttpServer uses default-sized threads. This binary links cuBLASLt and
// calls into it first (cublasLtGetVersion needs no GPU), so the library and
// its TLS are really in the process when the server starts and is scraped.
#include <cublasLt.h>
#include <httplib.h>
#include <pthread.h>

#include <fstream>
#include <iostream>
#include <string>

#include "gtest/gtest.h"
#include "server/metrics/metrics_http.h"
#include "server/metrics/prometheus_metrics.h"
#include "tests/unit/metrics/exposition.h"

namespace layerserve {
namespace {

constexpr size_t kCivetwebStackBytes = 100 * 1024;

bool LibraryIsMapped(const std::string& needle) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(needle) != std::string::npos) return true;
  }
  return false;
}

// The trap itself: with cuBLASLt's TLS in the process, a thread with the
// 100 KB stack civetweb asks for cannot even be created.
TEST(MetricsWithCublasLtTest, SmallStackThreadsFailWithCublasLtLoaded) {
  ASSERT_GT(cublasLtGetVersion(), 0u);
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, kCivetwebStackBytes), 0);
  pthread_t thread;
  const int rc = pthread_create(
      &thread, &attr, [](void*) -> void* { return nullptr; }, nullptr);
  if (rc == 0) pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
  EXPECT_NE(rc, 0) << "a 100 KB-stack thread started although cuBLASLt is loaded";
}

TEST(MetricsWithCublasLtTest, ScrapeSucceedsWithCublasLtLoaded) {
  const size_t version = cublasLtGetVersion();
  ASSERT_GT(version, 0u);
  ASSERT_TRUE(LibraryIsMapped("libcublasLt.so"))
      << "cuBLASLt is not loaded; the test proves nothing";

  PrometheusMetrics metrics("demo");
  metrics.OnRequestFinished({.model = "demo", .code = "OK", .duration_seconds = 0.002});
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();

  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  // Several scrapes, each served on a thread of its own.
  for (int i = 0; i < 8; ++i) {
    auto res = client.Get("/metrics");
    ASSERT_TRUE(res) << "scrape " << i << " failed: " << httplib::to_string(res.error());
    ASSERT_EQ(res->status, 200);
    const auto e = testing::ParseExposition(res->body);
    ASSERT_TRUE(e.errors.empty()) << e.errors.front();
    EXPECT_EQ(e.Find("layerserve_requests_total", {{"model", "demo"}, {"code", "OK"}}), 1.0);
  }
  (*server)->Stop();
  std::cout << "cuBLASLt " << version << " loaded; /metrics served\n";
}

}  // namespace
}  // namespace layerserve
