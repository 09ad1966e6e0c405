// Tests of the bench (client/bench.h): nearest-rank percentiles, its random
// inputs (bench_common.h), the option
// checks that run before any request is sent, and how a run treats failing
// requests (back-off, stop on a fatal status, the first message of each
// code kept) against an in-process fake
// server and a port nothing listens on.
#include "client/bench/bench.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/bench/bench_common.h"
#include "client/client.h"
#include "client/layerctl_cli.h"
#include "client/tensor.h"
#include "grpc_service.grpc.pb.h"

namespace layerserve::client {
namespace {

TEST(PercentileTest, NearestRank) {
  std::vector<double> samples;
  for (int i = 100; i >= 1; --i) samples.push_back(i);  // unsorted on purpose
  EXPECT_EQ(Percentile(samples, 50), 50);
  EXPECT_EQ(Percentile(samples, 90), 90);
  EXPECT_EQ(Percentile(samples, 99), 99);
  EXPECT_EQ(Percentile(samples, 100), 100);
  EXPECT_EQ(Percentile(samples, 0), 1);
  EXPECT_EQ(Percentile({7.0}, 99), 7);
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0}, 50), 2);
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0, 4.0}, 50), 2);
}

// Inputs larger than the pool of drawn values still look standard normal,
// differ from tensor to tensor and from repeat to repeat, and follow the seed.
TEST(RandomInputsTest, LargeTensorsAreStandardNormalAndDistinct) {
  const int64_t rows =
      3 * static_cast<int64_t>(kRandomInputPool) / 1024 + 5;  // three repeats and a part
  const std::vector<Tensor> inputs = RandomInputs({1, rows, 1024}, "FP32", 7, 2);
  ASSERT_EQ(inputs.size(), 2u);
  const absl::StatusOr<std::vector<float>> a = TensorToFloats(inputs[0]);
  const absl::StatusOr<std::vector<float>> b = TensorToFloats(inputs[1]);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), static_cast<size_t>(rows * 1024));
  double sum = 0, squares = 0;
  for (float v : *a) {
    sum += v;
    squares += double{v} * v;
  }
  const double mean = sum / static_cast<double>(a->size());
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(squares / static_cast<double>(a->size()) - mean * mean, 1.0, 0.01);
  EXPECT_NE(*a, *b);
  // The second repeat of the pool does not restart where the first did.
  const std::vector<float> first(a->begin(), a->begin() + 64);
  const std::vector<float> second(a->begin() + kRandomInputPool,
                                  a->begin() + kRandomInputPool + 64);
  EXPECT_NE(first, second);
  const absl::StatusOr<std::vector<float>> again =
      TensorToFloats(RandomInputs({1, rows, 1024}, "FP32", 7, 1)[0]);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a);
}

TEST(BenchOptionsTest, InconsistentOptionsFailBeforeConnecting) {
  // The address is never dialled: every case fails in the option checks.
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  BenchOptions base;
  base.model = "demo";
  base.hidden = 8;
  base.concurrency = 1;
  base.progress = false;

  BenchOptions both = base;
  both.rate_per_second = 10;
  BenchOptions neither = base;
  neither.concurrency = 0;
  BenchOptions no_model = base;
  no_model.model.clear();
  BenchOptions bad_datatype = base;
  bad_datatype.datatype = "INT8";
  BenchOptions zero_tokens = base;
  zero_tokens.tokens = 0;
  BenchOptions zero_duration = base;
  zero_duration.duration_seconds = 0;
  for (const BenchOptions& options :
       {both, neither, no_model, bad_datatype, zero_tokens, zero_duration}) {
    EXPECT_EQ(RunBench(**client, options).status().code(), absl::StatusCode::kInvalidArgument);
  }
  // Streams carry sessions only.
  BenchOptions streaming = base;
  streaming.streaming = true;
  const absl::Status status = RunBench(**client, streaming).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "--streaming")) << status;
  EXPECT_EQ(ExitStatusFor(status), kExitUsage);
}

TEST(BenchBackoffTest, DoublesFromOneMillisecondToOneSecond) {
  EXPECT_EQ(BenchBackoff(0), absl::Milliseconds(1));
  EXPECT_EQ(BenchBackoff(1), absl::Milliseconds(1));
  EXPECT_EQ(BenchBackoff(2), absl::Milliseconds(2));
  EXPECT_EQ(BenchBackoff(5), absl::Milliseconds(16));
  EXPECT_EQ(BenchBackoff(10), absl::Milliseconds(512));
  EXPECT_EQ(BenchBackoff(11), absl::Seconds(1));
  EXPECT_EQ(BenchBackoff(1000000), absl::Seconds(1));
}

TEST(BenchBackoffTest, RequestAndModelErrorsAreFatalLoadErrorsAreNot) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kUnimplemented, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kPermissionDenied, absl::StatusCode::kUnauthenticated}) {
    EXPECT_TRUE(IsFatalBenchStatus(code)) << absl::StatusCodeToString(code);
  }
  for (absl::StatusCode code :
       {absl::StatusCode::kUnavailable, absl::StatusCode::kResourceExhausted,
        absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kInternal,
        absl::StatusCode::kAborted, absl::StatusCode::kCancelled}) {
    EXPECT_FALSE(IsFatalBenchStatus(code)) << absl::StatusCodeToString(code);
  }
}

BenchOptions ClosedLoop(int concurrency, double duration_seconds) {
  BenchOptions options;
  options.model = "demo";
  options.hidden = 8;
  options.tokens = 2;
  options.concurrency = concurrency;
  options.duration_seconds = duration_seconds;
  options.timeout_seconds = 5;
  options.progress = false;
  return options;
}

// Nothing listens on the port, so every call fails at once with UNAVAILABLE
// (before back-off: hundreds of thousands of calls in a few seconds).
TEST(BenchFailureTest, BacksOffFromAServerThatRefuses) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  constexpr int kConcurrency = 4;
  absl::StatusOr<BenchReport> report = RunBench(**client, ClosedLoop(kConcurrency, 2.0));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests_ok, 0);
  EXPECT_EQ(report->errors_by_code["UNAVAILABLE"], report->requests_failed);
  // 1+2+...+512 ms then 1 s waits: ~12 calls per worker in 2 s; gRPC's own
  // reconnect back-off only makes it fewer.
  EXPECT_GT(report->requests_failed, 0);
  EXPECT_LE(report->requests_failed, kConcurrency * 16) << FormatBenchReport(*report);
}

// A ModelInfer service that answers every call with one status and counts
// the calls.
class FixedStatusService final : public inference::GRPCInferenceService::Service {
 public:
  explicit FixedStatusService(grpc::Status status) : status_(std::move(status)) {}
  grpc::Status ModelInfer(grpc::ServerContext*, const inference::ModelInferRequest*,
                          inference::ModelInferResponse*) override {
    calls_.fetch_add(1);
    return status_;
  }
  int calls() const { return calls_.load(); }

 private:
  const grpc::Status status_;
  std::atomic<int> calls_{0};
};

class FakeServer {
 public:
  explicit FakeServer(grpc::Status status) : service_(std::move(status)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() { server_->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int calls() const { return service_.calls(); }

 private:
  FixedStatusService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST(BenchFailureTest, StopsOnAFatalStatusInTheClosedLoop) {
  FakeServer server(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown model 'demo'"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<BenchReport> report = RunBench(**client, ClosedLoop(4, 30.0));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the run did not stop";
  ASSERT_EQ(report.status().code(), absl::StatusCode::kNotFound) << report.status();
  EXPECT_TRUE(absl::StrContains(report.status().message(), "unknown model 'demo'"));
  EXPECT_TRUE(IsCallStatus(report.status()));
  EXPECT_LE(server.calls(), 4);  // one per worker at most
}

// A load error is counted, and its message kept: the report says why.
TEST(BenchFailureTest, KeepsTheFirstMessageOfEachCode) {
  FakeServer server(
      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full: 9 requests waiting"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  absl::StatusOr<BenchReport> report = RunBench(**client, ClosedLoop(2, 0.5));
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_GT(report->requests_failed, 0);
  EXPECT_EQ(report->errors_by_code["RESOURCE_EXHAUSTED"], report->requests_failed);
  EXPECT_EQ(report->first_error_by_code,
            (std::map<std::string, std::string>{
                {"RESOURCE_EXHAUSTED", "queue full: 9 requests waiting"}}));
  const std::string text = FormatBenchReport(*report);
  EXPECT_TRUE(
      absl::StrContains(text, absl::StrCat("errors RESOURCE_EXHAUSTED: ", report->requests_failed,
                                           " (first: queue full: 9 requests waiting)\n")))
      << text;
  const std::string json = BenchReportJson(*report);
  for (const char* key : {"\"first_error_by_code\"", "\"queue full: 9 requests waiting\"",
                          "\"transport\": \"unary\""}) {
    EXPECT_TRUE(absl::StrContains(json, key)) << key << " missing from " << json;
  }
}

// --requests stops the closed loop after that many calls in all, long
// before the time is up, and the report measures the run up to then (not to
// the end of the 30 s window, which made its rates 30 s / run time too low).
TEST(BenchRequestsTest, TheClosedLoopStopsAfterTheRequestsAsked) {
  FakeServer server(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  BenchOptions options = ClosedLoop(2, 30.0);
  options.requests = 3;
  const absl::Time start = absl::Now();
  absl::StatusOr<BenchReport> report = RunBench(**client, options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the run did not stop";
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(server.calls(), 3);
  EXPECT_EQ(report->requests_failed, 3);
  EXPECT_LT(report->measured_seconds, 10.0);
}

// A Client may be destroyed as soon as its last AsyncInfer callback has been
// called: the destructor waits for completions still finishing, and each
// completion releases its gRPC state before calling back.
TEST(ClientLifetimeTest, DestroyedRightAfterTheLastCallback) {
  FakeServer server(grpc::Status(grpc::StatusCode::UNAVAILABLE, "busy"));
  const Tensor input{"FP32", {1, 1, 4}, std::string(16, '\0')};
  // Shared with the callbacks, so a callback still unlocking it when the
  // waiter wakes keeps it alive.
  struct Countdown {
    absl::Mutex mu;
    int left ABSL_GUARDED_BY(mu) = 0;
  };
  for (int round = 0; round < 30; ++round) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
    ASSERT_TRUE(client.ok());
    constexpr int kCalls = 16;
    auto countdown = std::make_shared<Countdown>();
    {
      absl::MutexLock lock(&countdown->mu);
      countdown->left = kCalls;
    }
    for (int i = 0; i < kCalls; ++i) {
      (*client)->AsyncInfer("demo", input, absl::Now() + absl::Seconds(10),
                            [countdown](absl::StatusOr<Tensor> result) {
                              EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
                              absl::MutexLock lock(&countdown->mu);
                              --countdown->left;
                            });
    }
    absl::MutexLock lock(&countdown->mu);
    ASSERT_TRUE(
        countdown->mu.AwaitWithTimeout(absl::Condition(
                                           +[](int* n) { return *n == 0; }, &countdown->left),
                                       absl::Seconds(20)));
    client->reset();  // right after the last callback, while it may still be finishing
  }
}

TEST(BenchFailureTest, StopsOnAFatalStatusInTheOpenLoop) {
  FakeServer server(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no ModelInfer here"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  BenchOptions options = ClosedLoop(0, 30.0);
  options.rate_per_second = 200;
  const absl::Time start = absl::Now();
  absl::StatusOr<BenchReport> report = RunBench(**client, options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the run did not stop";
  EXPECT_EQ(report.status().code(), absl::StatusCode::kUnimplemented) << report.status();
}

// A server's INVALID_ARGUMENT may name one of the server's flags; it is not
// a mistake on layerctl's command line, so layerctl exits 1, not 2.
TEST(BenchFailureTest, ServerErrorNamingAFlagIsNotAUsageError) {
  FakeServer server(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "the request has 9000 tokens, more than --max-batch-tokens 8192"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  absl::StatusOr<BenchReport> report = RunBench(**client, ClosedLoop(2, 30.0));
  ASSERT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument) << report.status();
  EXPECT_EQ(ExitStatusFor(report.status()), kExitFailure) << report.status();

  // The bench's own option checks are usage errors.
  BenchOptions no_model = ClosedLoop(1, 1.0);
  no_model.model.clear();
  const absl::Status usage = RunBench(**client, no_model).status();
  EXPECT_EQ(ExitStatusFor(usage), kExitUsage) << usage;
  EXPECT_EQ(ExitStatusFor(absl::OkStatus()), kExitOk);
}

}  // namespace
}  // namespace layerserve::client
