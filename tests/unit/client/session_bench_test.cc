// Tests of the session bench (client/session_bench.h): the plan of each
// session's requests, session ids, the statistics, the option checks, and
// whole runs, over unary calls and over streams (--streaming), against an
// in-process fake server that records the sequence parameters of every
// request and the stream it came on.
#include "client/bench/session_bench.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"

namespace layerserve::client {
namespace {

BenchOptions SessionOptions(int64_t sessions, int64_t prefill, int64_t steps,
                            int64_t step_tokens = 1) {
  BenchOptions options;
  options.model = "demo";
  options.hidden = 4;
  options.sessions = sessions;
  options.prefill_tokens = prefill;
  options.steps = steps;
  options.step_tokens = step_tokens;
  options.timeout_seconds = 10;
  options.progress = false;
  return options;
}

TEST(SessionPlanTest, PrefillWithStartThenStepsTheLastWithEnd) {
  const std::vector<SessionRequestPlan> plan = PlanSessionRequests(SessionOptions(1, 5, 3, 2));
  const std::vector<SessionRequestPlan> expected = {
      {.tokens = 5, .start = true, .end = false},
      {.tokens = 2, .start = false, .end = false},
      {.tokens = 2, .start = false, .end = false},
      {.tokens = 2, .start = false, .end = true},
  };
  EXPECT_EQ(plan, expected);
  // No steps: the prefill opens and closes the session.
  const std::vector<SessionRequestPlan> alone = {{.tokens = 7, .start = true, .end = true}};
  EXPECT_EQ(PlanSessionRequests(SessionOptions(1, 7, 0)), alone);
}

TEST(SessionIdTest, RandomPrefixAndDistinctIds) {
  const std::string a = NewSessionIdPrefix();
  const std::string b = NewSessionIdPrefix();
  EXPECT_TRUE(std::regex_match(a, std::regex("lsbench-[0-9a-f]{16}"))) << a;
  EXPECT_NE(a, b) << "two runs drew the same prefix";
  EXPECT_EQ(SessionBenchId("lsbench-00ff", 3), "lsbench-00ff-3");
  std::set<std::string> ids;
  for (int64_t i = 0; i < 1000; ++i) ids.insert(SessionBenchId(a, i));
  EXPECT_EQ(ids.size(), 1000u);
  // The longest prefix accepted and the largest index stay within the
  // server's 256-byte limit on string ids.
  EXPECT_LE(SessionBenchId(std::string(kMaxSessionIdPrefixBytes, 'p'),
                           std::numeric_limits<int64_t>::min())
                .size(),
            256u);
}

TEST(SessionStatsTest, LatencySummaries) {
  std::vector<double> samples;
  for (int i = 100; i >= 1; --i) samples.push_back(i);
  const LatencySummary summary = SummarizeLatencies(samples);
  EXPECT_EQ(summary.count, 100);
  EXPECT_EQ(summary.p50_ms, 50);
  EXPECT_EQ(summary.p90_ms, 90);
  EXPECT_EQ(summary.p99_ms, 99);
  EXPECT_EQ(summary.max_ms, 100);
  EXPECT_DOUBLE_EQ(summary.mean_ms, 50.5);
  const LatencySummary empty = SummarizeLatencies({});
  EXPECT_EQ(empty.count, 0);
  EXPECT_EQ(empty.p99_ms, 0);
  EXPECT_EQ(empty.mean_ms, 0);
}

TEST(SessionStatsTest, TokensPerSecondPerPhase) {
  // 8 sessions of B = 2: prefill 100 tokens, then 50 steps of 3 tokens.
  SessionBenchReport report;
  report.options = SessionOptions(8, 100, 50, 3);
  report.options.batch = 2;
  report.prefills_ok = 8;
  report.steps_ok = 8 * 50;
  report.prefill_seconds = 0.5;
  report.decode_seconds = 4.0;
  FinishSessionBenchReport({10, 20}, {1, 2, 3}, report);
  EXPECT_DOUBLE_EQ(report.prefill_tokens_per_second, 8 * 2 * 100 / 0.5);
  // N x S x K x B / decode wall time.
  EXPECT_DOUBLE_EQ(report.decode_tokens_per_second, 8 * 50 * 3 * 2 / 4.0);
  EXPECT_EQ(report.prefill_latency.count, 2);
  EXPECT_EQ(report.step_latency.count, 3);
  EXPECT_EQ(report.step_latency.p50_ms, 2);

  SessionBenchReport idle;
  idle.options = SessionOptions(1, 1, 0);
  FinishSessionBenchReport({}, {}, idle);
  EXPECT_EQ(idle.decode_tokens_per_second, 0) << "no decode phase, no division by zero";
  EXPECT_EQ(idle.steady_decode_tokens_per_second, 0);
}

TEST(SessionStatsTest, SteadyWindowEndsAtTheFirstSessionsLastStep) {
  // Steps answered at these times (s from the barrier); the first session to
  // finish did so at 0.3, and the step answered exactly then counts.
  EXPECT_EQ(SteadySteps({0.1, 0.2, 0.3, 0.35, 0.5, 0.2}, 0.3), 4);
  EXPECT_EQ(SteadySteps({}, 0.3), 0);

  SessionBenchReport report;
  report.options = SessionOptions(4, 10, 20, 2);
  report.steps_ok = 80;
  report.decode_seconds = 2.0;
  report.steady_decode_seconds = 1.5;
  report.steady_steps_ok = 72;  // 8 steps of the slowest sessions came after
  FinishSessionBenchReport({}, std::vector<double>(80, 1.0), report);
  EXPECT_DOUBLE_EQ(report.decode_tokens_per_second, 80 * 2 / 2.0);
  EXPECT_DOUBLE_EQ(report.steady_decode_tokens_per_second, 72 * 2 / 1.5);
}

TEST(SessionBenchOptionsTest, InconsistentOptionsFailBeforeConnecting) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  std::vector<BenchOptions> bad(9, SessionOptions(2, 4, 3));
  bad[0].sessions = 0;
  bad[1].prefill_tokens = 0;
  bad[2].steps = -1;
  bad[3].step_tokens = 0;
  bad[4].batch = 0;
  bad[5].concurrency = 2;
  bad[6].rate_per_second = 5;
  bad[7].datatype = "INT8";
  bad[8].session_id_prefix = std::string(kMaxSessionIdPrefixBytes + 1, 'p');
  for (size_t i = 0; i < bad.size(); ++i) {
    const absl::Status status = RunSessionBench({client->get()}, bad[i]).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << i << ": " << status;
    EXPECT_FALSE(IsCallStatus(status)) << i;
  }
  // And the request bench refuses a session load.
  BenchOptions sessions = SessionOptions(2, 4, 3);
  sessions.concurrency = 1;
  EXPECT_EQ(RunBench(**client, sessions).status().code(), absl::StatusCode::kInvalidArgument);
}

// Echoes hidden_states back (or answers every call with a fixed error) and
// records each request's sequence parameters and shape, per sequence id.
class SessionService final : public inference::GRPCInferenceService::Service {
 public:
  struct Seen {
    std::vector<int64_t> shape;
    bool start = false;
    bool end = false;
    bool position_sent = false;
    // When a step arrived, or a prefill was answered, on one counter.
    int64_t order = 0;
    // 0: a unary call; k: on the k-th stream opened.
    int64_t stream = 0;
    std::string request_id;
    std::string input;  // the raw input bytes
  };

  explicit SessionService(grpc::Status status = grpc::Status::OK) : status_(std::move(status)) {}

  grpc::Status ModelInfer(grpc::ServerContext*, const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response) override {
    return Handle(request, response, 0);
  }

  // As layerserve answers a stream: each request in turn, an error as
  // "CODE: message" in error_message, the stream left open.
  grpc::Status ModelStreamInfer(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<inference::ModelStreamInferResponse, inference::ModelInferRequest>*
          stream) override {
    int64_t number = 0;
    {
      absl::MutexLock lock(&mu_);
      number = ++streams_;
    }
    inference::ModelInferRequest request;
    while (stream->Read(&request)) {
      inference::ModelStreamInferResponse reply;
      const grpc::Status status = Handle(&request, reply.mutable_infer_response(), number);
      if (!status.ok()) {
        reply.mutable_infer_response()->Clear();
        reply.set_error_message(absl::StrCat(
            absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
            status.error_message()));
      }
      reply.mutable_infer_response()->set_id(request.id());
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }

  std::map<std::string, std::vector<Seen>> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  grpc::Status Handle(const inference::ModelInferRequest* request,
                      inference::ModelInferResponse* response, int64_t stream) {
    Seen seen;
    seen.stream = stream;
    seen.request_id = request->id();
    seen.input = request->raw_input_contents(0);
    seen.shape.assign(request->inputs(0).shape().begin(), request->inputs(0).shape().end());
    std::string id = "<none>";
    for (const auto& [name, value] : request->parameters()) {
      if (name == "sequence_id") id = value.string_param();
      if (name == "sequence_start") seen.start = value.bool_param();
      if (name == "sequence_end") seen.end = value.bool_param();
      if (name == "sequence_position") seen.position_sent = true;
    }
    // Session 0's prefill is slow, so steps sent before every prefill is
    // answered would show up in the order.
    if (seen.start && absl::EndsWith(id, "-0")) absl::SleepFor(absl::Milliseconds(50));
    {
      absl::MutexLock lock(&mu_);
      seen.order = next_order_++;
      requests_[id].push_back(seen);
    }
    if (!status_.ok()) return status_;
    auto* output = response->add_outputs();
    output->set_name(kHiddenStates);
    output->set_datatype(request->inputs(0).datatype());
    *output->mutable_shape() = request->inputs(0).shape();
    response->add_raw_output_contents(request->raw_input_contents(0));
    return grpc::Status::OK;
  }

  const grpc::Status status_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<Seen>> requests_ ABSL_GUARDED_BY(mu_);
  int64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_ ABSL_GUARDED_BY(mu_) = 0;
};

class SessionServer {
 public:
  explicit SessionServer(grpc::Status status = grpc::Status::OK) : service_(std::move(status)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~SessionServer() { server_->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  const SessionService& service() const { return service_; }

 private:
  SessionService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Unary calls (false) or a stream per session (true).
class SessionBenchTransportTest : public ::testing::TestWithParam<bool> {};

TEST_P(SessionBenchTransportTest, EverySessionStartsStepsAndEndsInOrder) {
  const bool streaming = GetParam();
  SessionServer server;
  std::vector<std::unique_ptr<Client>> owned;
  std::vector<Client*> clients;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
    ASSERT_TRUE(client.ok());
    clients.push_back(client->get());
    owned.push_back(*std::move(client));
  }
  constexpr int64_t kSessions = 5, kPrefill = 6, kSteps = 4, kStepTokens = 2;
  BenchOptions options = SessionOptions(kSessions, kPrefill, kSteps, kStepTokens);
  options.batch = 2;
  options.streaming = streaming;
  absl::StatusOr<SessionBenchReport> report = RunSessionBench(clients, options);
  ASSERT_TRUE(report.ok()) << report.status();

  EXPECT_EQ(report->sessions_completed, kSessions);
  EXPECT_EQ(report->sessions_failed, 0);
  EXPECT_EQ(report->prefills_ok, kSessions);
  EXPECT_EQ(report->steps_ok, kSessions * kSteps);
  EXPECT_EQ(report->prefill_latency.count, kSessions);
  EXPECT_EQ(report->step_latency.count, kSessions * kSteps);
  EXPECT_TRUE(report->errors_by_code.empty());
  EXPECT_GT(report->decode_seconds, 0);
  EXPECT_DOUBLE_EQ(report->decode_tokens_per_second,
                   kSessions * kSteps * kStepTokens * 2 / report->decode_seconds);
  // The steady window closes at the first session's last step: inside the
  // phase, with at least that session's steps and at most all of them.
  EXPECT_GT(report->steady_decode_seconds, 0);
  EXPECT_LE(report->steady_decode_seconds, report->decode_seconds);
  EXPECT_GE(report->steady_steps_ok, kSteps);
  EXPECT_LE(report->steady_steps_ok, report->steps_ok);
  EXPECT_EQ(report->options.connections, 2);
  const std::string& prefix = report->options.session_id_prefix;
  EXPECT_TRUE(absl::StartsWith(prefix, "lsbench-")) << prefix;

  const auto requests = server.service().requests();
  ASSERT_EQ(requests.size(), static_cast<size_t>(kSessions));
  // The decode phase begins once every prefill is answered.
  int64_t last_prefill = -1, first_step = std::numeric_limits<int64_t>::max();
  for (const auto& [id, seen] : requests) {
    for (const SessionService::Seen& r : seen) {
      if (r.start) last_prefill = std::max(last_prefill, r.order);
      if (!r.start) first_step = std::min(first_step, r.order);
    }
  }
  EXPECT_LT(last_prefill, first_step);
  std::set<int64_t> streams;
  for (int64_t i = 0; i < kSessions; ++i) {
    const std::string id = SessionBenchId(prefix, i);
    SCOPED_TRACE(id);
    ASSERT_EQ(requests.count(id), 1u);
    const std::vector<SessionService::Seen>& seen = requests.at(id);
    ASSERT_EQ(seen.size(), static_cast<size_t>(1 + kSteps));
    for (size_t r = 0; r < seen.size(); ++r) {
      const std::vector<int64_t> shape = {2, r == 0 ? kPrefill : kStepTokens, 4};
      EXPECT_EQ(seen[r].shape, shape) << r;
      EXPECT_EQ(seen[r].start, r == 0) << r;
      EXPECT_EQ(seen[r].end, r == seen.size() - 1) << r;
      EXPECT_FALSE(seen[r].position_sent) << r;
      // Over a stream: all of a session's requests on one stream of its
      // own, numbered in order.
      EXPECT_EQ(seen[r].stream, seen[0].stream) << r;
      if (streaming) EXPECT_EQ(seen[r].request_id, absl::StrCat(r + 1)) << r;
    }
    streams.insert(seen[0].stream);
    // Steps rotate over the bench's four step inputs (session i's step r
    // sends input (i + r) mod 4), also where a step rewrites the message
    // of the one before in place.
    std::set<std::string> step_inputs;
    for (size_t r = 1; r < seen.size(); ++r) step_inputs.insert(seen[r].input);
    EXPECT_EQ(step_inputs.size(), static_cast<size_t>(kSteps));
    if (i + 1 < kSessions) {
      const std::vector<SessionService::Seen>& next = requests.at(SessionBenchId(prefix, i + 1));
      ASSERT_EQ(next.size(), seen.size());
      for (size_t r = 1; r + 1 < seen.size(); ++r) EXPECT_EQ(seen[r + 1].input, next[r].input) << r;
    }
  }
  if (streaming) {
    EXPECT_EQ(streams.size(), static_cast<size_t>(kSessions));
    EXPECT_EQ(streams.count(0), 0u) << "a unary call";
  } else {
    EXPECT_EQ(streams, std::set<int64_t>{0}) << "a stream";
  }
  // The report's text and JSON name the phases.
  const std::string text = FormatSessionBenchReport(*report);
  EXPECT_TRUE(absl::StrContains(text, "decode:")) << text;
  EXPECT_TRUE(absl::StrContains(text, "decode while all sessions ran:")) << text;
  EXPECT_TRUE(absl::StrContains(text, "5 completed, 0 failed")) << text;
  EXPECT_TRUE(absl::StrContains(text, streaming ? "a stream per session" : "unary calls")) << text;
  const std::string json = SessionBenchReportJson(*report);
  for (const char* key : {"\"decode_tokens_per_second\"", "\"steady_decode_tokens_per_second\"",
                          "\"step_latency_ms\"", "\"p99\"", "\"session_id_prefix\"",
                          "\"mode\": \"sessions\"", "\"first_error_by_code\": {}",
                          streaming ? "\"transport\": \"stream\"" : "\"transport\": \"unary\""}) {
    EXPECT_TRUE(absl::StrContains(json, key)) << key << " missing from " << json;
  }
}

TEST(SessionBenchRunTest, ConcurrentRunsUseDifferentIds) {
  SessionServer server;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  absl::StatusOr<SessionBenchReport> first, second;
  std::thread other([&] { first = RunSessionBench({client->get()}, SessionOptions(3, 2, 2)); });
  second = RunSessionBench({client->get()}, SessionOptions(3, 2, 2));
  other.join();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(first->options.session_id_prefix, second->options.session_id_prefix);
  // 6 sessions, 3 requests each, none sharing an id.
  const auto requests = server.service().requests();
  EXPECT_EQ(requests.size(), 6u);
  for (const auto& [id, seen] : requests) EXPECT_EQ(seen.size(), 3u) << id;
}

// The error's code and first message come through either transport: over
// a stream, from the reply's "CODE: message".
TEST_P(SessionBenchTransportTest, ALoadErrorAbandonsTheSessionAndIsCounted) {
  SessionServer server(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no free KV blocks"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  BenchOptions options = SessionOptions(4, 8, 10);
  options.streaming = GetParam();
  absl::StatusOr<SessionBenchReport> report = RunSessionBench({client->get()}, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->sessions_completed, 0);
  EXPECT_EQ(report->sessions_failed, 4);
  EXPECT_EQ(report->steps_ok, 0);
  EXPECT_EQ(report->errors_by_code, (std::map<std::string, int64_t>{{"RESOURCE_EXHAUSTED", 4}}));
  EXPECT_EQ(report->first_error_by_code,
            (std::map<std::string, std::string>{{"RESOURCE_EXHAUSTED", "no free KV blocks"}}));
  const std::string text = FormatSessionBenchReport(*report);
  EXPECT_TRUE(absl::StrContains(text, "errors RESOURCE_EXHAUSTED: 4 (first: no free KV blocks)\n"))
      << text;
  const std::string json = SessionBenchReportJson(*report);
  EXPECT_TRUE(absl::StrContains(json, "\"RESOURCE_EXHAUSTED\": \"no free KV blocks\"")) << json;
  // Only the prefills were sent: an abandoned session sends no steps.
  for (const auto& [id, seen] : server.service().requests()) EXPECT_EQ(seen.size(), 1u) << id;
}

TEST_P(SessionBenchTransportTest, StopsOnAFatalStatus) {
  SessionServer server(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the cpu backend keeps no KV cache"));
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server.address());
  ASSERT_TRUE(client.ok());
  BenchOptions options = SessionOptions(3, 8, 100);
  options.streaming = GetParam();
  const absl::Status status = RunSessionBench({client->get()}, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "no KV cache")) << status;
  EXPECT_TRUE(IsCallStatus(status));
}

// A stream that cannot even open (nothing listens) fails its session with
// the call's status, as a unary call would.
TEST(SessionBenchRunTest, AStreamThatCannotOpenFailsItsSession) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  BenchOptions options = SessionOptions(2, 4, 3);
  options.streaming = true;
  absl::StatusOr<SessionBenchReport> report = RunSessionBench({client->get()}, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->sessions_failed, 2);
  EXPECT_EQ(report->errors_by_code, (std::map<std::string, int64_t>{{"UNAVAILABLE", 2}}));
  EXPECT_FALSE(report->first_error_by_code["UNAVAILABLE"].empty());
}

INSTANTIATE_TEST_SUITE_P(Transports, SessionBenchTransportTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Stream" : "Unary";
                         });

}  // namespace
}  // namespace layerserve::client
