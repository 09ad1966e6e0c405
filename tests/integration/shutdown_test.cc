// Graceful shutdown: requests waiting in the queue (a 3 s queue delay keeps
// them there) when SIGTERM arrives all complete with correct answers, new
// work is refused with UNAVAILABLE, and the process exits with status 0.
// Under load from many clients, every call is answered or refused with
// UNAVAILABLE (never CANCELLED by the server's stop).
#include <gtest/gtest.h>
#include <signal.h>

#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "tests/integration/async_results.h"
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
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
      {"--max-queue-delay-us=3000000", "--batch-delay-when-idle", "--drain-timeout-s=20"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();

  const std::vector<float> x = RandomBf16ExactValues(kSeqLen * kHidden, 11);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, kSeqLen, kHidden}, "FP16");
  ASSERT_TRUE(input.ok());
  const std::vector<double> expected = DemoReference(0, 4).Run(x, 1, kSeqLen);

  const std::shared_ptr<AsyncResults> collector = AsyncResults::Create(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    (*client)->AsyncInfer("demo", *input, absl::Now() + absl::Seconds(30), collector->Callback(i));
  }
  absl::StatusOr<double> queued = WaitForQueueDepth(**server, kCalls, absl::Seconds(2));
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_EQ(*queued, kCalls) << "the requests were not all queued before SIGTERM";
  ASSERT_EQ(collector->Pending(), kCalls)
      << "requests finished before SIGTERM; the test proves nothing";

  (*server)->Signal(SIGTERM);
  // New work during the drain is refused (or the server has already gone):
  // UNAVAILABLE either way.
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<Tensor> late = (*client)->Infer("demo", *input, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();

  const auto waited = collector->Wait(absl::Seconds(25));
  ASSERT_TRUE(waited.ok()) << waited.status();
  const std::vector<absl::StatusOr<Tensor>>& results = *waited;
  for (int i = 0; i < kCalls; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_TRUE(MatchesReference(*results[i], {1, kSeqLen, kHidden}, "FP16", expected));
  }
  absl::StatusOr<int> exit_code = (*server)->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// One client of the load: sends a call, and another each time one succeeds,
// until a call fails; a refused client goes away, as one behind a load
// balancer would. Counts the final codes of all its calls.
class ClientLoop {
 public:
  ClientLoop(Client* client, const Tensor* input) : client_(client), input_(input) {}

  void Send() {
    client_->AsyncInfer("demo", *input_, absl::Now() + absl::Seconds(10),
                        [this](absl::StatusOr<Tensor> result) {
                          const absl::StatusCode code = result.status().code();
                          {
                            absl::MutexLock lock(&mu_);
                            ++codes_[code];
                            if (code != absl::StatusCode::kOk) done_ = true;
                          }
                          if (code == absl::StatusCode::kOk) Send();
                        });
  }
  bool AwaitDone(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  }
  std::map<absl::StatusCode, int> codes() {
    absl::MutexLock lock(&mu_);
    return codes_;
  }

 private:
  Client* const client_;
  const Tensor* const input_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::map<absl::StatusCode, int> codes_ ABSL_GUARDED_BY(mu_);
};

// The load: 64 clients, each on its own connection, calling without
// pause; SIGTERM 0.5 to 1.5 s in. Before the fix the server's stop cancelled
// the calls gRPC had received but not yet handed to the service, 6 to 54 per
// run; every call must be answered (OK) or refused (UNAVAILABLE).
TEST(ShutdownTest, SigtermUnderLoadAnswersOrRefusesEveryCall) {
  constexpr int kRuns = 4;
  constexpr int kClients = 64;
  const std::vector<float> x = RandomBf16ExactValues(kSeqLen * kHidden, 12);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, kSeqLen, kHidden}, "FP32");
  ASSERT_TRUE(input.ok());
  std::mt19937 random(2024);
  std::map<absl::StatusCode, int> total;
  for (int run = 0; run < kRuns; ++run) {
    SCOPED_TRACE(testing::Message() << "run " << run);
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start({"--drain-timeout-s=10"});
    ASSERT_TRUE(server.ok()) << server.status();
    // Loops first, so they are destroyed last: each Client's destructor waits
    // for its completions, which call back into its loop.
    std::vector<std::unique_ptr<ClientLoop>> loops;
    std::vector<std::unique_ptr<Client>> clients;
    for (int i = 0; i < kClients; ++i) {
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Connect((*server)->grpc_target(), /*dedicated_connection=*/true);
      ASSERT_TRUE(client.ok()) << client.status();
      clients.push_back(*std::move(client));
      loops.push_back(std::make_unique<ClientLoop>(clients.back().get(), &*input));
    }
    for (auto& loop : loops) loop->Send();
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(500, 1500)(random)));
    (*server)->Signal(SIGTERM);
    for (int i = 0; i < kClients; ++i) {
      ASSERT_TRUE(loops[i]->AwaitDone(absl::Seconds(20))) << "client " << i << " never ended";
    }
    std::map<absl::StatusCode, int> codes;
    for (auto& loop : loops) {
      for (const auto& [code, count] : loop->codes()) codes[code] += count;
    }
    std::string summary;
    for (const auto& [code, count] : codes) {
      absl::StrAppend(&summary, " ", absl::StatusCodeToString(code), "=", count);
      total[code] += count;
    }
    std::cerr << "run " << run << ":" << summary << std::endl;
    EXPECT_GT(codes[absl::StatusCode::kOk], 0) << "no call succeeded before SIGTERM";
    for (const auto& [code, count] : codes) {
      EXPECT_TRUE(code == absl::StatusCode::kOk || code == absl::StatusCode::kUnavailable)
          << count << " calls ended with " << absl::StatusCodeToString(code);
    }
    absl::StatusOr<int> exit_code = (*server)->WaitForExit(absl::Seconds(20));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0);
  }
  std::string summary;
  for (const auto& [code, count] : total) {
    absl::StrAppend(&summary, " ", absl::StatusCodeToString(code), "=", count);
  }
  std::cerr << "all runs:" << summary << std::endl;
}

}  // namespace
}  // namespace layerserve::integration
