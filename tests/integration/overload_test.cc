// Overload behaviour: with --max-queue-size 1 and a 1 s queue delay, a burst
// of concurrent requests is partly refused with RESOURCE_EXHAUSTED; a request
// whose client deadline passes while it waits in the queue fails with
// DEADLINE_EXCEEDED and is dropped without being computed, as is one its
// client cancels (CANCELLED); a deadline centuries away is no deadline at
// all; and the server keeps serving correct answers afterwards.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/async_results.h"
#include "tests/integration/cancelled_call.h"
#include "tests/integration/raw_grpc.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::Tensor;

constexpr int64_t kHidden = 512;
constexpr absl::Duration kQueueDelay = absl::Seconds(1);

// Sends `calls` copies of `input` at once and returns each call's status once
// all have completed (a failure if some never complete within 25 s).
std::vector<absl::Status> Burst(Client& client, const Tensor& input, int calls) {
  const std::shared_ptr<AsyncResults> results = AsyncResults::Create(calls);
  for (int i = 0; i < calls; ++i) {
    client.AsyncInfer("demo", input, absl::Now() + absl::Seconds(20), results->Callback(i));
  }
  const auto done = results->Wait(absl::Seconds(25));
  EXPECT_TRUE(done.ok()) << done.status();
  std::vector<absl::Status> statuses;
  if (done.ok()) {
    for (const auto& result : *done) statuses.push_back(result.status());
  }
  return statuses;
}

class OverloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
        {"--max-queue-size=1",
         "--max-queue-delay-us=" + std::to_string(absl::ToInt64Microseconds(kQueueDelay)),
         "--batch-delay-when-idle"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server_->grpc_target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = client->release();
  }
  static void TearDownTestSuite() {
    delete client_;
    delete server_;
    client_ = nullptr;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(client_, nullptr) << "the server did not start"; }

  // One [1, 2, hidden] request, checked against the reference.
  static void ExpectGoodRequestServed() {
    const std::vector<float> x = RandomBf16ExactValues(2 * kHidden, 77);
    absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 2, kHidden}, "BF16");
    ASSERT_TRUE(input.ok());
    absl::StatusOr<Tensor> output = client_->Infer("demo", *input, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_TRUE(
        MatchesReference(*output, {1, 2, kHidden}, "BF16", DemoReference(0, 4).Run(x, 1, 2)));
  }

  // Requests executed so far (the layerserve_batch_size histogram's sum).
  static absl::StatusOr<double> ExecutedRequests() {
    absl::StatusOr<std::string> metrics = HttpGet(server_->metrics_port(), "/metrics");
    if (!metrics.ok()) return metrics.status();
    absl::StatusOr<double> sum = MetricSum(*metrics, "layerserve_batch_size_sum");
    if (absl::IsNotFound(sum.status())) return 0.0;  // no execution yet
    return sum;
  }

  // After a request was dropped from the queue unrun (its batching time
  // passed): a good request is served, and exactly one request, that one,
  // has been computed since `executed_before` (ExecutedRequests()).
  static void ExpectOnlyAGoodRequestComputedSince(double executed_before, const char* why) {
    absl::SleepFor(kQueueDelay + absl::Milliseconds(300));
    ExpectGoodRequestServed();
    // Metrics may be recorded just after the reply is sent: allow a moment.
    absl::StatusOr<double> executed_after = ExecutedRequests();
    for (const absl::Time give_up = absl::Now() + absl::Seconds(2);
         executed_after.ok() && *executed_after < executed_before + 1 && absl::Now() < give_up;
         executed_after = ExecutedRequests()) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(executed_after.ok()) << executed_after.status();
    EXPECT_EQ(*executed_after - executed_before, 1) << why;
  }

  static ServerProcess* server_;
  static Client* client_;
};

ServerProcess* OverloadTest::server_ = nullptr;
Client* OverloadTest::client_ = nullptr;

TEST_F(OverloadTest, FullQueueIsResourceExhausted) {
  constexpr int kCalls = 16;
  const std::vector<float> x = RandomBf16ExactValues(kHidden, 3);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 1, kHidden}, "FP32");
  ASSERT_TRUE(input.ok());
  const std::vector<absl::Status> results = Burst(*client_, *input, kCalls);
  ASSERT_FALSE(HasFailure());
  int ok = 0, exhausted = 0;
  for (const absl::Status& status : results) {
    if (status.ok()) {
      ++ok;
    } else if (absl::IsResourceExhausted(status)) {
      ++exhausted;
      EXPECT_NE(std::string(status.message()).find("queue"), std::string::npos)
          << "RESOURCE_EXHAUSTED message does not mention the queue: " << status;
    } else {
      ADD_FAILURE() << "unexpected status " << status;
    }
  }
  std::fprintf(stderr, "[test] burst of %d: %d OK, %d RESOURCE_EXHAUSTED\n", kCalls, ok, exhausted);
  EXPECT_GE(ok, 1) << "the request that fit in the queue must run";
  EXPECT_GE(exhausted, 1) << "a queue of one cannot take a burst of " << kCalls;
  ExpectGoodRequestServed();
}

// --max-queue-bytes reaches the batcher: with room for one request's bytes
// and a long queue delay, the rest of a burst is refused for bytes, not count.
TEST(QueueBytesFlagTest, ByteLimitRefusesABurst) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
      {"--max-queue-size=1000", "--max-queue-bytes=4096",
       "--max-queue-delay-us=" + std::to_string(absl::ToInt64Microseconds(kQueueDelay)),
       "--batch-delay-when-idle"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int kCalls = 8;
  const std::vector<float> x = RandomBf16ExactValues(2 * kHidden, 5);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 2, kHidden}, "FP32");  // 4096 bytes
  ASSERT_TRUE(input.ok());
  const std::vector<absl::Status> results = Burst(**client, *input, kCalls);
  ASSERT_FALSE(HasFailure());
  int ok = 0, for_bytes = 0;
  for (const absl::Status& status : results) {
    if (status.ok()) ++ok;
    if (absl::IsResourceExhausted(status) &&
        std::string(status.message()).find("bytes") != std::string::npos) {
      ++for_bytes;
    }
  }
  EXPECT_GE(ok, 1);
  EXPECT_GE(for_bytes, 1) << "a queue of 4096 bytes cannot take a burst of " << kCalls
                          << " x 4096 bytes";
}

TEST_F(OverloadTest, DeadlineExpiresWhileQueued) {
  absl::StatusOr<double> executed_before = ExecutedRequests();
  ASSERT_TRUE(executed_before.ok()) << executed_before.status();

  const std::vector<float> x = RandomBf16ExactValues(kHidden, 4);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 1, kHidden}, "FP32");
  ASSERT_TRUE(input.ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<Tensor> doomed = client_->Infer("demo", *input, start + absl::Milliseconds(100));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(doomed.status().code(), absl::StatusCode::kDeadlineExceeded) << doomed.status();
  EXPECT_LT(waited, kQueueDelay) << "the call outlived its deadline";

  // Let the server reach the doomed request's batching time, when it must
  // drop it instead of computing it; the queue (size 1) is free afterwards.
  ExpectOnlyAGoodRequestComputedSince(
      *executed_before,
      "only the good request should have been computed; the expired one must be dropped");
}

// A call the client cancels while it waits in the queue is dropped there
// (the server sees the cancellation before the batch forms) and counted as
// CANCELLED, not computed.
TEST_F(OverloadTest, CancelledWhileQueuedIsDropped) {
  absl::StatusOr<double> executed_before = ExecutedRequests();
  ASSERT_TRUE(executed_before.ok()) << executed_before.status();

  auto stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server_->grpc_target(), grpc::InsecureChannelCredentials()));
  const std::vector<float> x = RandomBf16ExactValues(kHidden, 5);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 1, kHidden}, "FP32");
  ASSERT_TRUE(input.ok());
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", *input);
  // Cancelled well inside the 1 s queue delay.
  const std::optional<grpc::Status> status =
      InferCancelledAfter(*stub, request, absl::Milliseconds(100), absl::Seconds(20));
  ASSERT_TRUE(status.has_value()) << "the cancelled call never completed";
  EXPECT_EQ(status->error_code(), grpc::StatusCode::CANCELLED) << status->error_message();

  ExpectOnlyAGoodRequestComputedSince(
      *executed_before, "the cancelled request must be dropped from the queue, not computed");
  absl::StatusOr<std::string> metrics = HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_NE(metrics->find("code=\"CANCELLED\""), std::string::npos)
      << "the server should count the dropped call as CANCELLED";
}

// A legal grpc-timeout far in the future (grpc-java's largest, 2562047H,
// i.e. 2^63 ns; or anything from 239 years on) must mean "practically no
// deadline": the request waits its queue delay and runs. Such deadlines lie
// past 2262, where a nanosecond system_clock overflows. gRPC C++ clients cap
// the header they send at 27000H, so it is written by hand.
TEST_F(OverloadTest, FarFutureDeadlineIsNoDeadline) {
  const Tensor input{"FP32", {1, 2, kHidden}, std::string(2 * kHidden * 4, '\0')};
  const std::string body = GrpcFrame(Client::MakeInferRequest("demo", input).SerializeAsString());
  for (const std::string timeout : {"2562047H", "2100000H", "99999999H", "27000H"}) {
    SCOPED_TRACE(timeout);
    absl::StatusOr<RawGrpcReply> reply =
        RawGrpcCall(server_->grpc_port(), "/inference.GRPCInferenceService/ModelInfer",
                    {.headers = {{"grpc-timeout", timeout}}, .body = body});
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->grpc_status, 0) << reply->grpc_message;
    inference::ModelInferResponse response;
    ASSERT_GT(reply->data.size(), 5u);
    ASSERT_TRUE(response.ParseFromString(reply->data.substr(5)));
    EXPECT_EQ(response.raw_output_contents(0).size(), input.data.size());
  }
}

}  // namespace
}  // namespace layerserve::integration
