// The metrics endpoint under slow and hostile clients (docs/security.md):
// scrapes keep answering while many connections drip their requests a byte
// at a time or send nothing, and request bodies and oversized header blocks
// are refused without the server reading (or holding) them. The hostile
// clients are raw sockets (raw_http.h), so that they can do what no HTTP
// library would. Each of the first three tests failed before the endpoint
// read heads itself (httplib 0.11.4's own loop): no scrape answered, 127 MB
// of a body buffered, a 4 MiB head parsed and answered 200.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "server/metrics/metrics_http.h"
#include "server/metrics/prometheus_metrics.h"
#include "tests/unit/metrics/raw_http.h"

namespace layerserve {
namespace {

using ::layerserve::testing::Answer;
using ::layerserve::testing::Connect;
using ::layerserve::testing::Exchange;
using ::layerserve::testing::Fd;
using ::layerserve::testing::Get;
using Clock = std::chrono::steady_clock;

constexpr char kModel[] = "demo";

// A /proc/self/status field in kB ("VmRSS", "VmHWM"), or -1.
int64_t ProcStatusKb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atoll(line.c_str() + field.size() + 1);
  }
  return -1;
}

// Starts VmHWM (peak resident memory) over at the current VmRSS.
bool ResetPeakRss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

// Clients that open a connection and then hold it: every other one sends a
// request one byte every half second (and never finishes it), the others
// send nothing. Each keeps its connection until destroyed.
class SlowClients {
 public:
  SlowClients(int port, int count) {
    for (int i = 0; i < count; ++i) {
      Fd fd = Connect(port);
      EXPECT_GE(fd.get(), 0) << "slow client " << i << " could not connect";
      (i % 2 == 0 ? dripping_ : silent_).push_back(std::move(fd));
    }
    dripper_ = std::thread([this] {
      // Long enough that no client finishes it while a test runs.
      const std::string request =
          "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + std::string(1000, 'a');
      for (size_t at = 0; at < request.size() && !stop_.load(); ++at) {
        for (const Fd& fd : dripping_) send(fd.get(), &request[at], 1, MSG_NOSIGNAL);
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    });
  }
  ~SlowClients() {
    stop_.store(true);
    dripper_.join();
  }

 private:
  std::vector<Fd> dripping_;
  std::vector<Fd> silent_;
  std::atomic<bool> stop_{false};
  std::thread dripper_;
};

// Fifty connections that hold their requests open must not keep scrapes
// from being answered.
TEST(MetricsHttpHostileClientsTest, SlowClientsDoNotStarveScrapes) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  SlowClients slow(port, 50);
  // Time for the server to take up every slow connection (and, with a pool of
  // a few threads that each serve one connection, to be stuck on them).
  std::this_thread::sleep_for(std::chrono::seconds(2));
  int answered = 0;
  for (int i = 0; i < 5; ++i) {
    const Answer scrape = Get(port, "/metrics", 3.0);
    if (scrape.status == 200) ++answered;
    EXPECT_EQ(scrape.status, 200) << "scrape " << i << " after " << scrape.seconds << " s";
  }
  EXPECT_EQ(answered, 5) << "scrapes answered within 3 s under 50 slow clients";
}

// A body of 512 MiB is announced: the server answers 413 at once, without
// reading it, and its memory does not grow with what the client sends.
TEST(MetricsHttpHostileClientsTest, LargeBodyIsRefusedUnread) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(ResetPeakRss()) << "cannot write /proc/self/clear_refs";
  const int64_t rss_before_kb = ProcStatusKb("VmRSS");
  // The client sends at most 64 MiB (enough to see a server that buffers it)
  // until the server answers.
  const Answer answer = Exchange((*server)->port(),
                                 "POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 "Content-Length: 536870912\r\n\r\n",
                                 int64_t{64} << 20, 3.0);
  const int64_t growth_kb = ProcStatusKb("VmHWM") - rss_before_kb;
  EXPECT_EQ(answer.status, 413) << "after " << answer.seconds << " s, " << answer.bytes_sent
                                << " bytes sent";
  EXPECT_LT(answer.seconds, 2.0);
  EXPECT_LT(growth_kb, 8 * 1024) << "peak RSS grew by " << growth_kb << " kB while the client sent "
                                 << answer.bytes_sent << " bytes";
}

// A request head of 4 MiB (short header lines, each under any per-line
// limit) is refused with 431 instead of being parsed.
TEST(MetricsHttpHostileClientsTest, HugeHeaderBlockIsRefused) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  std::string head = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  for (int i = 0; head.size() < (size_t{4} << 20); ++i) {
    head += "X-Filler-" + std::to_string(i) + ": " + std::string(100, 'a') + "\r\n";
  }
  head += "\r\n";
  const Answer answer = Exchange((*server)->port(), head, 0, 3.0);
  EXPECT_EQ(answer.status, 431) << "after " << answer.seconds << " s, " << answer.bytes_sent
                                << " bytes sent";
  EXPECT_LT(answer.seconds, 2.0);
}

// A head just under max_head_bytes is still served.
TEST(MetricsHttpHostileClientsTest, HeadUnderTheLimitIsServed) {
  PrometheusMetrics metrics(kModel);
  const MetricsHttpLimits limits;
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics, {}, limits);
  ASSERT_TRUE(server.ok()) << server.status();
  std::string head = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  const std::string filler = "X-Filler: " + std::string(100, 'a') + "\r\n";
  while (head.size() + filler.size() + 2 <= limits.max_head_bytes) head += filler;
  head += "\r\n";
  EXPECT_EQ(Exchange((*server)->port(), head, 0, 3.0).status, 200) << head.size() << " bytes";
}

// Every way of announcing a body gets 413 before any of it is read; a GET
// that says its body is empty is served; a POST that announces nothing is
// answered at once (httplib alone waits for its body until the client closes).
TEST(MetricsHttpHostileClientsTest, BodiesAreRefusedInEveryForm) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const auto send = [port](const std::string& method, const std::string& headers) {
    return Exchange(port, method + " /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + "\r\n",
                    0, 3.0);
  };
  for (const std::string headers :
       {"Content-Length: 10\r\n", "Transfer-Encoding: chunked\r\n",
        "Expect: 100-continue\r\nContent-Length: 10\r\n", "Content-Length: abc\r\n"}) {
    SCOPED_TRACE(headers);
    const Answer answer = send("GET", headers);
    EXPECT_EQ(answer.status, 413) << answer.reply;
    EXPECT_TRUE(answer.closed);
    EXPECT_LT(answer.seconds, 2.0);
  }
  EXPECT_EQ(send("GET", "Content-Length: 0\r\n").status, 200);
  const Answer post = send("POST", "");
  EXPECT_EQ(post.status, 404) << post.reply;
  EXPECT_LT(post.seconds, 2.0);
}

// Past max_connections, each new connection evicts the oldest one that is
// still sending its head: the scrape gets in, the oldest slow clients are
// closed, the newest are not.
TEST(MetricsHttpHostileClientsTest, MoreSlowClientsThanTheCapEvictTheOldest) {
  PrometheusMetrics metrics(kModel);
  constexpr int kCap = 8;
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics, {}, {.max_connections = kCap});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  constexpr int kSilent = 30;
  std::vector<Fd> silent;
  for (int i = 0; i < kSilent; ++i) silent.push_back(Connect(port));
  const Answer scrape = Get(port, "/metrics", 3.0);
  EXPECT_EQ(scrape.status, 200) << "after " << scrape.seconds << " s";
  // The scrape evicted one more: kCap - 1 silent clients are still held.
  const auto closed_within = [](const Fd& fd, int timeout_ms) {
    pollfd p = {.fd = fd.get(), .events = POLLIN, .revents = 0};
    char byte;
    return poll(&p, 1, timeout_ms) == 1 && recv(fd.get(), &byte, 1, 0) <= 0;
  };
  for (int i = 0; i < kSilent; ++i) {
    const bool evicted = i < kSilent - (kCap - 1);
    EXPECT_EQ(closed_within(silent[i], evicted ? 2000 : 0), evicted) << "silent client " << i;
  }
}

// A head still coming in at head_timeout is answered 408 and closed, though
// the client sent a byte every 50 ms (a timeout per read would never fire).
TEST(MetricsHttpHostileClientsTest, SlowHeadGets408AtTheDeadline) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics, {},
                                         {.head_timeout = std::chrono::milliseconds(300)});
  ASSERT_TRUE(server.ok()) << server.status();
  Fd fd = Connect((*server)->port());
  const std::string request = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(1000, 'a');
  const Clock::time_point start = Clock::now();
  std::string reply;
  bool closed = false;
  for (size_t at = 0; at < request.size() && !closed; ++at) {
    send(fd.get(), &request[at], 1, MSG_NOSIGNAL);
    pollfd p = {.fd = fd.get(), .events = POLLIN, .revents = 0};
    while (!closed && poll(&p, 1, 50) == 1) {
      char buffer[512];
      const ssize_t n = recv(fd.get(), buffer, sizeof(buffer), 0);
      if (n > 0) reply.append(buffer, static_cast<size_t>(n));
      closed = n == 0 || (n < 0 && errno != EAGAIN);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(closed);
  EXPECT_EQ(reply.rfind("HTTP/1.1 408 ", 0), 0u) << reply;
  EXPECT_GE(seconds, 0.25);
  EXPECT_LT(seconds, 2.0);
}

// Stop() ends held connections at once instead of waiting out their
// deadlines.
TEST(MetricsHttpHostileClientsTest, StopEndsSlowConnectionsPromptly) {
  PrometheusMetrics metrics(kModel);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  SlowClients slow((*server)->port(), 20);
  ASSERT_EQ(Get((*server)->port(), "/healthz").status, 200);  // the slow ones are held by now
  const Clock::time_point start = Clock::now();
  (*server)->Stop();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 1.0);
}

}  // namespace
}  // namespace layerserve
