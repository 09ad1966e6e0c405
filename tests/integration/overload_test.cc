// Overload behaviour: with --max-queue-size 1 and a 1 s queue delay, a burst
// of concurrent requests is partly refused with RESOURCE_EXHAUSTED; a request
// whose client deadline passes while it waits in the queue fails with
// DEADLINE_EXCEEDED and is dropped without being computed, as is one its
// client cancels (CANCELLED); a deadline centuries away is no deadline at
// all; and the server keeps serving correct answers afterwards. Streams whose
// clients never read their replies hold a bounded backlog each, and a
// bystander is served beside them.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/async_results.h"
#include "tests/integration/cancelled_call.h"
#include "tests/integration/raw_grpc.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"
#include "tests/integration/server_suite.h"

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

class OverloadTest : public ServerSuite<OverloadTest> {
 public:
  static std::vector<std::string> ServerArgs() {
    return {"--max-queue-size=1",
            "--max-queue-delay-us=" + std::to_string(absl::ToInt64Microseconds(kQueueDelay)),
            "--batch-delay-when-idle"};
  }

 protected:
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
};

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

// Issue 40, finding 1: a stream whose client never reads its replies made
// the server read every request the client sent (and compute it, and keep its
// reply), so memory grew without bound and a bystander was refused. Each
// stream here offers 2 000 requests of 128 KiB (250 MiB) without reading a
// reply. The server must stop reading each stream once it holds its bound of
// unwritten replies (StreamInferCall::kMaxUnwritten), so flow control holds
// every client's writes back, its RSS grows by a bounded amount per stream,
// and a bystander's request is served meanwhile. What a held stream costs is
// its backlog (16 requests and replies, 4 MiB here) and gRPC's receive
// buffer for it, which its flow-control window estimator lets grow to tens
// of MiB on loopback: ~50 MiB a stream measured, against the whole 250 MiB
// (and more as long as the client sends) before.
TEST(StreamBackpressureTest, StreamsWhoseRepliesAreNotReadHoldABoundedBacklog) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<float> small = RandomBf16ExactValues(2 * kHidden, 78);
  absl::StatusOr<Tensor> bystander_input = client::FloatsToTensor(small, {1, 2, kHidden}, "BF16");
  ASSERT_TRUE(bystander_input.ok());
  ASSERT_TRUE((*client)->Infer("demo", *bystander_input, absl::Now() + absl::Seconds(20)).ok());
  absl::StatusOr<int64_t> rss_before = ProcStatusKb((*server)->pid(), "VmRSS");
  ASSERT_TRUE(rss_before.ok()) << rss_before.status();

  constexpr int kStreams = 4;
  constexpr int kRequests = 2000;
  constexpr int64_t kTokens = 64;  // 128 KiB of FP32
  absl::StatusOr<Tensor> big = client::FloatsToTensor(RandomBf16ExactValues(kTokens * kHidden, 79),
                                                      {1, kTokens, kHidden}, "FP32");
  ASSERT_TRUE(big.ok());
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", *big);
  struct Stream {
    std::unique_ptr<inference::GRPCInferenceService::Stub> stub;
    grpc::ClientContext context;
    std::unique_ptr<
        grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>>
        stream;
    std::atomic<int> written{0};
    std::thread writer;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < kStreams; ++s) {
    auto st = std::make_unique<Stream>();
    // A connection each: one connection's window does not hold the others back.
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", s);  // no channel sharing between the stubs
    st->stub = inference::GRPCInferenceService::NewStub(grpc::CreateCustomChannel(
        (*server)->grpc_target(), grpc::InsecureChannelCredentials(), args));
    st->stream = st->stub->ModelStreamInfer(&st->context);
    Stream* raw = st.get();
    st->writer = std::thread([raw, &request] {
      for (int i = 0; i < kRequests; ++i) {
        if (!raw->stream->Write(request)) return;  // cancelled below
        raw->written.fetch_add(1);
      }
    });
    streams.push_back(std::move(st));
  }
  // Until the writes stop moving (held back) or all are sent (not held back).
  const auto total = [&] {
    int n = 0;
    for (const auto& st : streams) n += st->written.load();
    return n;
  };
  int last = -1;
  absl::Time moved = absl::Now();
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up && total() < kStreams * kRequests) {
    if (total() != last) {
      last = total();
      moved = absl::Now();
    } else if (absl::Now() - moved > absl::Seconds(2)) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::StatusOr<int64_t> rss_held = ProcStatusKb((*server)->pid(), "VmRSS");
  ASSERT_TRUE(rss_held.ok()) << rss_held.status();
  // Held, it stays held: the clients keep trying to write, the server's
  // memory does not follow. It may still compute what its backlogs hold (8
  // MiB of replies at most), more slowly on a loaded machine, so its RSS
  // must settle (grow less than 4 MiB in a second) within 20 s, not at once.
  int64_t rss_later = *rss_held;
  bool settled = false;
  for (const absl::Time settle_by = absl::Now() + absl::Seconds(20); absl::Now() < settle_by;) {
    absl::SleepFor(absl::Seconds(1));
    absl::StatusOr<int64_t> rss = ProcStatusKb((*server)->pid(), "VmRSS");
    ASSERT_TRUE(rss.ok()) << rss.status();
    settled = *rss - rss_later < 4 * 1024;
    rss_later = *rss;
    if (settled) break;
  }
  // A bystander on its own connection is served while the streams are held.
  absl::StatusOr<Tensor> bystander =
      (*client)->Infer("demo", *bystander_input, absl::Now() + absl::Seconds(60));
  EXPECT_TRUE(bystander.ok()) << bystander.status();
  if (bystander.ok()) {
    EXPECT_TRUE(MatchesReference(*bystander, {1, 2, kHidden}, "BF16",
                                 DemoReference(0, 4).Run(small, 1, 2)));
  }
  for (auto& st : streams) st->context.TryCancel();
  for (auto& st : streams) st->writer.join();

  const int64_t offered_kb = int64_t{kStreams} * kRequests * 128;
  const int64_t growth_kb = *rss_held - *rss_before;
  std::printf(
      "[test] %d streams offered %lld KiB without reading; the clients got %d of %d requests out; "
      "server RSS %lld -> %lld KiB (+%lld), settled at %lld KiB\n",
      kStreams, static_cast<long long>(offered_kb), total(), kStreams * kRequests,
      static_cast<long long>(*rss_before), static_cast<long long>(*rss_held),
      static_cast<long long>(growth_kb), static_cast<long long>(rss_later));
  for (int s = 0; s < kStreams; ++s) {
    EXPECT_LT(streams[s]->written.load(), kRequests)
        << "stream " << s << ": the server read all it was sent";
  }
  // The streams' backlogs and gRPC's receive buffers (~50 MiB a stream
  // measured), far below the 250 MiB a stream offered; and flat.
  EXPECT_LT(growth_kb, kStreams * 100 * 1024);
  EXPECT_TRUE(settled) << "the server's memory still grows while the streams are held";
  EXPECT_LT(rss_later - *rss_before, kStreams * 100 * 1024);
}

}  // namespace
}  // namespace layerserve::integration
