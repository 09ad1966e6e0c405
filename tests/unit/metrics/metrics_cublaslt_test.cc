// Proves that /metrics works in a process that has libcublasLt loaded.
//
// libcublasLt carries a ~94 KB static TLS block, which glibc carves out of
// every thread's stack; prometheus-cpp's civetweb Exposer started its threads
// with 100 KB stacks, which then could not be created, and the endpoint died.
// MetricsHttpServer uses default-sized threads. This binary links cuBLASLt and
// calls into it first (cublasLtGetVersion needs no GPU), so the library and
// its TLS are really in the process when the server starts and is scraped,
// one scrape after another and several at once, each connection on a thread
// the endpoint starts.
#include <cublasLt.h>
#include <httplib.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/metrics/metrics_http.h"
#include "server/metrics/prometheus_metrics.h"
#include "tests/unit/metrics/exposition.h"

namespace layerserve {
namespace {

bool LibraryIsMapped(const std::string& needle) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(needle) != std::string::npos) return true;
  }
  return false;
}

// Connections open at once, each served on a thread of the endpoint's own:
// every one of those threads must start with cuBLASLt's TLS in the process.
TEST(MetricsWithCublasLtTest, ConcurrentScrapesSucceedWithCublasLtLoaded) {
  ASSERT_GT(cublasLtGetVersion(), 0u);
  ASSERT_TRUE(LibraryIsMapped("libcublasLt.so"))
      << "cuBLASLt is not loaded; the test proves nothing";
  PrometheusMetrics metrics("demo");
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  constexpr int kConnections = 4;
  constexpr int kScrapesEach = 4;
  std::atomic<int> served{0};
  std::vector<std::thread> scrapers;
  for (int c = 0; c < kConnections; ++c) {
    scrapers.emplace_back([&served, port] {
      httplib::Client client("127.0.0.1", port);
      client.set_connection_timeout(5);
      client.set_read_timeout(5);
      for (int i = 0; i < kScrapesEach; ++i) {
        auto res = client.Get("/metrics");
        if (res && res->status == 200) served.fetch_add(1);
      }
    });
  }
  for (std::thread& t : scrapers) t.join();
  (*server)->Stop();
  EXPECT_EQ(served.load(), kConnections * kScrapesEach)
      << "scrapes over " << kConnections << " connections at once failed with cuBLASLt loaded";
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
