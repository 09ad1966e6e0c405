// Sessions behind several replicas, against the real server:
//   - the x-session-id header (what a proxy routes a call by) must name the
//     request's sequence_id: a mismatch, on ModelInfer or on a
//     ModelStreamInfer stream, is INVALID_ARGUMENT naming both values and
//     leaves the session as it was; a matching header and no header work;
// The same through a real nginx with the shipped configuration:
// tests/deploy/test_session_routing.py.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
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

class SessionHeaderRoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start({"--kv-cache-memory=16MiB"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server_->grpc_target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
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

}  // namespace
}  // namespace layerserve::integration
