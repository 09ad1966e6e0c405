// Sessions behind several replicas, against the real server:
//   - the x-session-id header (what a proxy routes a call by) must name the
//     request's sequence_id: a mismatch, on ModelInfer or on a
//     ModelStreamInfer stream, is INVALID_ARGUMENT naming both values and
//     leaves the session as it was; a matching header and no header work;
//   - SIGTERM with sessions open: new sessions and stateless requests are
//     refused (UNAVAILABLE, for another replica) at once, open sessions go on
//     stepping and may end, and once --drain-sessions-timeout-s has passed
//     the rest are dropped: a later step gets NOT_FOUND naming the session
//     and the drain; the server then exits 0.
// The same through a real nginx with the shipped configuration:
// tests/deploy/test_session_routing.py.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"
#include "tests/integration/server_suite.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::InferOptions;
using client::Tensor;

constexpr int64_t kHidden = 512;  // the demo model's
constexpr char kModel[] = "demo";

absl::Time In(absl::Duration d) { return absl::Now() + d; }

Tensor Tokens(int64_t count, uint64_t seed) {
  absl::StatusOr<Tensor> t =
      client::FloatsToTensor(RandomBf16ExactValues(static_cast<size_t>(count * kHidden), seed),
                             {1, count, kHidden}, "FP32");
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

// A request as Client::Infer sends it, sent with the headers given (none:
// no x-session-id at all), through the generated stub.
absl::Status InferWithHeaders(const std::string& target, const InferOptions& options,
                              const std::vector<std::string>& session_headers) {
  auto stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  for (const std::string& value : session_headers) context.AddMetadata("x-session-id", value);
  inference::ModelInferResponse response;
  return client::FromGrpcStatus(stub->ModelInfer(
      &context, Client::MakeInferRequest(kModel, Tokens(1, 3), options), &response));
}

// One server for both tests: they use sessions of distinct ids.
class SessionHeaderRoutingTest : public ServerSuite<SessionHeaderRoutingTest> {
 public:
  static std::vector<std::string> ServerArgs() { return {"--kv-cache-memory=16MiB"}; }
};

TEST_F(SessionHeaderRoutingTest, AMismatchedHeaderIsRefusedOnModelInfer) {
  const std::string target = server_->grpc_target();
  // The client library sends the header itself.
  ASSERT_TRUE(client_
                  ->Infer(kModel, Tokens(3, 1), In(absl::Seconds(30)),
                          {.sequence_id = int64_t{7}, .sequence_start = true})
                  .ok());

  const absl::Status wrong = InferWithHeaders(target, {.sequence_id = int64_t{7}}, {"8"});
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument) << wrong;
  EXPECT_TRUE(absl::StrContains(wrong.message(),
                                "header x-session-id is \"8\" but the request's sequence_id is 7"))
      << wrong;
  const absl::Status stateless = InferWithHeaders(target, {}, {"7"});
  EXPECT_EQ(stateless.code(), absl::StatusCode::kInvalidArgument) << stateless;
  EXPECT_TRUE(absl::StrContains(stateless.message(), "but the request has no sequence_id"))
      << stateless;
  const absl::Status twice = InferWithHeaders(target, {.sequence_id = int64_t{7}}, {"7", "7"});
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument) << twice;

  // The refused steps left session 7 at length 3: a step at position 3 is
  // the next one, with the header or without.
  EXPECT_TRUE(
      InferWithHeaders(target, {.sequence_id = int64_t{7}, .sequence_position = 3}, {"7"}).ok());
  EXPECT_TRUE(
      InferWithHeaders(target, {.sequence_id = int64_t{7}, .sequence_position = 4}, {}).ok());
  EXPECT_TRUE(
      InferWithHeaders(target, {.sequence_id = std::string("s-1"), .sequence_start = true}, {"s-1"})
          .ok());
}

TEST_F(SessionHeaderRoutingTest, AStreamsHeaderMustNameEachRequestsSession) {
  std::unique_ptr<client::InferStream> stream =
      client_->OpenStream(In(absl::Seconds(30)), std::string("chat-1"));
  ASSERT_TRUE(stream
                  ->Infer(kModel, Tokens(2, 4),
                          {.sequence_id = std::string("chat-1"), .sequence_start = true})
                  .ok());
  const absl::StatusOr<Tensor> other = stream->Infer(
      kModel, Tokens(2, 5), {.sequence_id = std::string("chat-2"), .sequence_start = true});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_TRUE(absl::StrContains(other.status().message(),
                                "header x-session-id is \"chat-1\" but the request's sequence_id "
                                "is \"chat-2\""))
      << other.status();
  const absl::StatusOr<Tensor> stateless = stream->Infer(kModel, Tokens(1, 6));
  EXPECT_EQ(stateless.status().code(), absl::StatusCode::kInvalidArgument);
  // The stream goes on; its session is where it was.
  EXPECT_TRUE(
      stream
          ->Infer(
              kModel, Tokens(1, 7),
              {.sequence_id = std::string("chat-1"), .sequence_end = true, .sequence_position = 2})
          .ok());
  EXPECT_TRUE(stream->Close().ok());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// SIGTERM with two sessions open, one that ends during the drain and one
// that keeps stepping until the drain drops it.
TEST(SessionDrainTest, OpenSessionsFinishNewOnesGoElsewhereTheRestAreDropped) {
  const std::string log = ::testing::TempDir() + "session_drain_test.log";
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
      {"--kv-cache-memory=16MiB", "--drain-sessions-timeout-s=2", "--drain-timeout-s=10"},
      absl::Seconds(30), log);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(server.grpc_target());
  ASSERT_TRUE(connected.ok()) << connected.status();
  Client& client = **connected;
  const auto step = [&](const InferOptions& options) {
    return client
        .Infer(kModel, Tokens(options.sequence_start ? 4 : 1, 9), In(absl::Seconds(30)), options)
        .status();
  };
  ASSERT_TRUE(step({.sequence_id = int64_t{1}, .sequence_start = true}).ok());
  ASSERT_TRUE(step({.sequence_id = int64_t{2}, .sequence_start = true}).ok());

  server.Signal(SIGTERM);
  // Refused at once, whatever the server's clock: a drain begins before
  // anything else happens after the signal, and the client waits until it
  // shows (health turns NOT_SERVING as the drain begins).
  const absl::Time give_up = In(absl::Seconds(10));
  while (client.Health(In(absl::Seconds(5)))
                 .value_or(grpc::health::v1::HealthCheckResponse::SERVING) ==
             grpc::health::v1::HealthCheckResponse::SERVING &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Status fresh = step({.sequence_id = int64_t{3}, .sequence_start = true});
  EXPECT_EQ(fresh.code(), absl::StatusCode::kUnavailable) << fresh;
  EXPECT_TRUE(absl::StrContains(fresh.message(),
                                "opens no new session; start session 3 on "
                                "another replica"))
      << fresh;
  const absl::Status stateless = step({});
  EXPECT_EQ(stateless.code(), absl::StatusCode::kUnavailable) << stateless;

  // Open sessions step on, and one ends as its client wants.
  EXPECT_TRUE(step({.sequence_id = int64_t{1}}).ok());
  EXPECT_TRUE(step({.sequence_id = int64_t{1}, .sequence_end = true}).ok());
  // Session 2 steps until the drain drops it. A step that crosses the drop
  // on its way into the queue may be refused as the queue closes
  // (UNAVAILABLE); the next one hears why.
  absl::Status last;
  int unavailable = 0;
  for (int i = 0; i < 400; ++i) {  // 2 s of drain at most: well under 400 steps' time
    last = step({.sequence_id = int64_t{2}});
    if (last.code() == absl::StatusCode::kUnavailable && unavailable++ == 0) continue;
    if (!last.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LE(unavailable, 1);
  EXPECT_EQ(last.code(), absl::StatusCode::kNotFound) << last;
  EXPECT_TRUE(absl::StrContains(last.message(), "session 2 was dropped by a drain")) << last;

  absl::StatusOr<int> exit_code = server.WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  const std::string text = ReadFile(log);
  EXPECT_TRUE(absl::StrContains(text,
                                "drain: no new sessions; waiting up to 2s for the 2 open "
                                "to end"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "drain: sessions dropped: 1 (2 were open at the signal)"))
      << text;
}

}  // namespace
}  // namespace layerserve::integration
