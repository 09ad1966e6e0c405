// Many concurrent requests: 64 threads sharing one Client (the blocking
// call) and 128 AsyncInfer calls in flight at once all get correct answers,
// and /metrics shows that the server ran them in batches of more than one
// request. The server gets a 20 ms queue delay so concurrent requests meet in
// the queue even on a slow, busy machine.
#include <gtest/gtest.h>

#include <latch>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "tests/integration/async_results.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"
#include "tests/integration/server_suite.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::Tensor;

constexpr int64_t kHidden = 512;
constexpr int kDistinctInputs = 8;  // seq_len 1..8; each used by many requests

struct Case {
  std::vector<int64_t> shape;
  Tensor input;
  std::vector<double> expected;
};

class ConcurrencyTest : public ServerSuite<ConcurrencyTest> {
 public:
  static std::vector<std::string> ServerArgs() { return {"--max-queue-delay-us=20000"}; }

 protected:
  static void SetUpTestSuite() {
    ServerSuite::SetUpTestSuite();
    if (HasFatalFailure()) return;
    const DemoReference reference(0, 4);
    cases_ = new std::vector<Case>();
    for (int i = 0; i < kDistinctInputs; ++i) {
      const int64_t seq_len = i + 1;
      const std::vector<float> x = RandomBf16ExactValues(seq_len * kHidden, 500 + i);
      absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, seq_len, kHidden}, "FP32");
      ASSERT_TRUE(input.ok());
      cases_->push_back({{1, seq_len, kHidden}, *input, reference.Run(x, 1, seq_len)});
    }
  }
  static void TearDownTestSuite() {
    delete cases_;
    cases_ = nullptr;
    ServerSuite::TearDownTestSuite();
  }
  void SetUp() override { ASSERT_NE(cases_, nullptr) << "suite set-up failed"; }

  // layerserve_batch_size histogram: executions and requests executed.
  static void ExpectBatchedExecutions() {
    absl::StatusOr<std::string> metrics = HttpGet(server_->metrics_port(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    absl::StatusOr<double> executions = MetricSum(*metrics, "layerserve_batch_size_count");
    absl::StatusOr<double> requests = MetricSum(*metrics, "layerserve_batch_size_sum");
    ASSERT_TRUE(executions.ok()) << executions.status();
    ASSERT_TRUE(requests.ok()) << requests.status();
    std::fprintf(stderr, "[test] %g requests ran in %g executions\n", *requests, *executions);
    EXPECT_GT(*executions, 0);
    EXPECT_GT(*requests, *executions) << "no execution held more than one request";
    // The same fact through the buckets: not every execution is in le="1".
    absl::StatusOr<double> single =
        MetricSum(*metrics, "layerserve_batch_size_bucket", {"le=\"1\""});
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_LT(*single, *executions);
  }

  static std::vector<Case>* cases_;
};

std::vector<Case>* ConcurrencyTest::cases_ = nullptr;

TEST_F(ConcurrencyTest, SixtyFourThreadsAllCorrectAndBatched) {
  constexpr int kThreads = 64;
  std::vector<absl::StatusOr<Tensor>> results(kThreads, absl::UnknownError("not run"));
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      results[t] = client_->Infer("demo", (*cases_)[t % kDistinctInputs].input,
                                  absl::Now() + absl::Seconds(45));
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(testing::Message() << "thread " << t);
    ASSERT_TRUE(results[t].ok()) << results[t].status();
    const Case& c = (*cases_)[t % kDistinctInputs];
    EXPECT_TRUE(MatchesReference(*results[t], c.shape, "FP32", c.expected));
  }
  ExpectBatchedExecutions();
}

TEST_F(ConcurrencyTest, OneHundredTwentyEightAsyncCallsAllCorrect) {
  constexpr int kCalls = 128;
  const std::shared_ptr<AsyncResults> collector = AsyncResults::Create(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    client_->AsyncInfer("demo", (*cases_)[i % kDistinctInputs].input,
                        absl::Now() + absl::Seconds(45), collector->Callback(i));
  }
  const auto waited = collector->Wait(absl::Seconds(50));
  ASSERT_TRUE(waited.ok()) << waited.status();
  const std::vector<absl::StatusOr<Tensor>>& results = *waited;
  for (int i = 0; i < kCalls; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    const Case& c = (*cases_)[i % kDistinctInputs];
    EXPECT_TRUE(MatchesReference(*results[i], c.shape, "FP32", c.expected));
  }
  ExpectBatchedExecutions();
}

}  // namespace
}  // namespace layerserve::integration
