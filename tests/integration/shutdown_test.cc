// Graceful shutdown: requests waiting in the queue (a 3 s queue delay keeps
// them there) when SIGTERM arrives all complete with correct answers, new
// work is refused with UNAVAILABLE, and the process exits with status 0.
#include <gtest/gtest.h>
#include <signal.h>

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::Tensor;

constexpr int64_t kHidden = 512;
constexpr int64_t kSeqLen = 4;
constexpr int kCalls = 6;

// Waits until the server reports `depth` queued requests (the
// layerserve_queue_depth gauge) or `timeout` passes; the last value seen.
absl::StatusOr<double> WaitForQueueDepth(const ServerProcess& server, double depth,
                                         absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<std::string> metrics = HttpGet(server.metrics_port(), "/metrics");
    if (!metrics.ok()) return metrics.status();
    absl::StatusOr<double> queued = MetricSum(*metrics, "layerserve_queue_depth");
    if (!queued.ok() && !absl::IsNotFound(queued.status())) return queued.status();
    if ((queued.ok() && *queued >= depth) || absl::Now() >= give_up) return queued;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

TEST(ShutdownTest, SigtermDrainsQueuedRequestsAndExitsZero) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start({"--max-queue-delay-us=3000000", "--drain-timeout-s=20"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();

  const std::vector<float> x = RandomBf16ExactValues(kSeqLen * kHidden, 11);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, kSeqLen, kHidden}, "FP16");
  ASSERT_TRUE(input.ok());
  const std::vector<double> expected = DemoReference(0, 4).Run(x, 1, kSeqLen);

  absl::Mutex mu;
  int pending = kCalls;
  std::vector<absl::StatusOr<Tensor>> results(kCalls, absl::UnknownError("no reply"));
  for (int i = 0; i < kCalls; ++i) {
    (*client)->AsyncInfer("demo", *input, absl::Now() + absl::Seconds(30),
                          [&, i](absl::StatusOr<Tensor> result) {
                            absl::MutexLock lock(&mu);
                            results[i] = std::move(result);
                            --pending;
                          });
  }
  absl::StatusOr<double> queued = WaitForQueueDepth(**server, kCalls, absl::Seconds(2));
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_EQ(*queued, kCalls) << "the requests were not all queued before SIGTERM";
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(pending, kCalls) << "requests finished before SIGTERM; the test proves nothing";
  }

  (*server)->Signal(SIGTERM);
  // New work during the drain is refused (or the server has already gone):
  // UNAVAILABLE either way.
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<Tensor> late = (*client)->Infer("demo", *input, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();

  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](int* left) { return *left == 0; }, &pending),
                                    absl::Seconds(25)))
        << pending << " queued calls never completed";
  }
  for (int i = 0; i < kCalls; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_TRUE(MatchesReference(*results[i], {1, kSeqLen, kHidden}, "FP16", expected));
  }
  absl::StatusOr<int> exit_code = (*server)->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

}  // namespace
}  // namespace layerserve::integration
