// ModelStreamInfer answers a stream's requests in the order they were sent,
// as Triton does for a non-decoupled model, so a client may match replies by
// position (tritonclient's sequence stream example does).
//
// Each round opens many streams at once, under load from other connections.
// On every stream the client writes, back to back and without waiting for a
// reply, a mix built to overtake itself wherever replies could go out as
// they complete: a long stateless request followed by short ones, a
// session's prefill and 1-token steps (each of which waits in the batcher for
// its predecessor) between stateless requests, and a request the server
// refuses on arrival (its error reply is ready at once). Every stream's
// replies must carry its request ids in order, each with the reply its
// request should get: the float64 reference's rows, or the refusal.
//
// The server runs with several reply threads (the batcher's pool that runs
// finished requests' replies). LAYERSERVE_STREAM_ORDER_ROUNDS sets the number
// of rounds (default 20; issue 33 asked for 1000 on each backend).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
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
constexpr int kStreams = 12;
constexpr int kPrefillTokens = 5;
constexpr int kSteps = 10;  // 1-token session steps after the prefill
constexpr int kLoadThreads = 3;
constexpr int kDefaultRounds = 20;
// The replies are checked for which request they answer, not for precision
// (correctness_test and the GPU suite own that): a reply of another request
// is off by tens of percent, while the CUDA backend's BF16 compute lands at
// 1.7% of the scale on the 48-token request (H200, against 1.6% for ~2 BF16
// ulps).
constexpr double kWhichReplyTolerance = 4.0;

int Rounds() {
  int rounds = kDefaultRounds;
  const char* env = std::getenv("LAYERSERVE_STREAM_ORDER_ROUNDS");
  if (env != nullptr && (!absl::SimpleAtoi(env, &rounds) || rounds < 1)) {
    ADD_FAILURE() << "LAYERSERVE_STREAM_ORDER_ROUNDS must be a positive integer, not " << env;
    rounds = kDefaultRounds;
  }
  return rounds;
}

Tensor Fp32(const std::vector<float>& x, int64_t tokens) {
  absl::StatusOr<Tensor> tensor = client::FloatsToTensor(x, {1, tokens, kHidden}, "FP32");
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return tensor.ok() ? *std::move(tensor) : Tensor{};
}

// One request of a stream and what its reply must be.
struct Expected {
  inference::ModelInferRequest request;
  int64_t tokens = 0;             // the reply's [1, tokens, hidden]
  std::vector<double> reference;  // its rows of the float64 reference
  bool refused = false;           // answered with an error_message instead
};

// A stateless input of `tokens` tokens and its reference.
struct Stateless {
  int64_t tokens;
  std::vector<float> x;
  std::vector<double> reference;
};

class StreamOrderTest : public ServerSuite<StreamOrderTest> {
 public:
  // Several reply threads, and a queue delay long enough that requests from
  // many streams meet in batches of several requests.
  static std::vector<std::string> ServerArgs() {
    return {"--reply-threads=4", "--max-queue-delay-us=2000", "--kv-cache-memory=64MiB"};
  }

 protected:
  static void SetUpTestSuite() {
    ServerSuite::SetUpTestSuite();
    if (HasFatalFailure()) return;

    const DemoReference reference(0, 4);
    stateless_ = new std::vector<Stateless>();
    for (int64_t tokens : {48, 1, 3, 1, 7, 2}) {
      std::vector<float> x = RandomBf16ExactValues(tokens * kHidden, 3300 + tokens);
      std::vector<double> ref = reference.Run(x, 1, tokens);
      stateless_->push_back({tokens, std::move(x), std::move(ref)});
    }
    streams_ = new std::vector<std::vector<Expected>>();
    for (int s = 0; s < kStreams; ++s) streams_->push_back(StreamPlan(reference, s));
  }
  static void TearDownTestSuite() {
    delete streams_;
    delete stateless_;
    streams_ = nullptr;
    stateless_ = nullptr;
    ServerSuite::TearDownTestSuite();
  }
  void SetUp() override { ASSERT_NE(streams_, nullptr) << "suite set-up failed"; }

  // Stream s: the long stateless request, the session's prefill, then
  // stateless requests, a refused one and the session's steps in turn.
  static std::vector<Expected> StreamPlan(const DemoReference& reference, int s) {
    const int64_t length = kPrefillTokens + kSteps;
    const std::vector<float> seq = RandomBf16ExactValues(length * kHidden, 3400 + s);
    const std::vector<double> seq_ref = reference.Run(seq, 1, length);
    std::vector<Expected> plan;
    auto add_stateless = [&](size_t which) {
      const Stateless& st = (*stateless_)[which % stateless_->size()];
      plan.push_back({Client::MakeInferRequest(kModel, Fp32(st.x, st.tokens)), st.tokens,
                      st.reference, false});
    };
    auto add_step = [&](int64_t from, int64_t count, bool start, bool end) {
      InferOptions options;
      options.sequence_id = absl::StrCat("order-", s);
      options.sequence_start = start;
      options.sequence_end = end;
      const std::vector<float> x(seq.begin() + from * kHidden,
                                 seq.begin() + (from + count) * kHidden);
      const std::vector<double> ref(seq_ref.begin() + from * kHidden,
                                    seq_ref.begin() + (from + count) * kHidden);
      plan.push_back(
          {Client::MakeInferRequest(kModel, Fp32(x, count), options), count, ref, false});
    };
    add_stateless(0);  // 48 tokens: the longest of the stream
    add_step(0, kPrefillTokens, true, false);
    for (int k = 0; k < kSteps; ++k) {
      add_stateless(1 + k);
      if (k == 1 || k == 6) {
        // Refused on arrival (a hidden size that is not the model's).
        const std::vector<float> seven(7, 1.0f);
        const Tensor narrow{
            "FP32", {1, 1, 7}, std::string(reinterpret_cast<const char*>(seven.data()), 28)};
        plan.push_back({Client::MakeInferRequest(kModel, narrow), 0, {}, true});
      }
      add_step(kPrefillTokens + k, 1, false, k + 1 == kSteps);
    }
    for (size_t i = 0; i < plan.size(); ++i) plan[i].request.set_id(absl::StrCat("s", s, "-", i));
    return plan;
  }

  // Writes stream s's requests back to back and reads its replies; every
  // mismatch is a test failure naming the stream, the round and the reply.
  static void RunStream(int s, int round) {
    const std::vector<Expected>& plan = (*streams_)[s];
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(server_->grpc_target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto stream = stub->ModelStreamInfer(&context);
    std::thread writer([&] {
      for (const Expected& e : plan) {
        if (!stream->Write(e.request)) return;  // the read side reports the break
      }
      stream->WritesDone();
    });
    std::vector<std::string> ids;
    inference::ModelStreamInferResponse reply;
    while (stream->Read(&reply)) {
      const size_t i = ids.size();
      ids.push_back(reply.infer_response().id());
      if (i >= plan.size()) continue;
      const Expected& e = plan[i];
      SCOPED_TRACE(
          absl::StrCat("stream ", s, ", round ", round, ", reply ", i, " (", e.request.id(), ")"));
      if (reply.infer_response().id() != e.request.id()) continue;  // reported below
      if (e.refused) {
        EXPECT_NE(reply.error_message(), "") << "the refused request got a reply";
        continue;
      }
      ASSERT_EQ(reply.error_message(), "");
      absl::StatusOr<Tensor> out =
          Client::OutputFromResponse(std::move(*reply.mutable_infer_response()));
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_TRUE(MatchesReference(*out, {1, e.tokens, kHidden}, "FP32", e.reference,
                                   kWhichReplyTolerance));
    }
    writer.join();
    const grpc::Status finish = stream->Finish();
    EXPECT_TRUE(finish.ok()) << finish.error_message();
    std::vector<std::string> sent;
    for (const Expected& e : plan) sent.push_back(e.request.id());
    EXPECT_EQ(ids, sent) << "stream " << s << ", round " << round
                         << ": the replies are not in the order of the requests";
  }

  static std::vector<Stateless>* stateless_;
  static std::vector<std::vector<Expected>>* streams_;
};

std::vector<Stateless>* StreamOrderTest::stateless_ = nullptr;
std::vector<std::vector<Expected>>* StreamOrderTest::streams_ = nullptr;

TEST_F(StreamOrderTest, RepliesComeBackInRequestOrderUnderLoad) {
  // Other connections' stateless traffic for the whole test.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> load_ok{0};
  std::vector<std::thread> load;
  for (int t = 0; t < kLoadThreads; ++t) {
    load.emplace_back([&, t] {
      client::ConnectOptions options;
      options.dedicated_connection = true;
      absl::StatusOr<std::unique_ptr<Client>> other =
          Client::Connect(server_->grpc_target(), options);
      if (!other.ok()) return;
      for (int64_t i = 0; !stop.load(); ++i) {
        const Stateless& st = (*stateless_)[static_cast<size_t>(t + i) % stateless_->size()];
        absl::StatusOr<Tensor> out =
            (*other)->Infer(kModel, Fp32(st.x, st.tokens), absl::Now() + absl::Seconds(60));
        if (out.ok()) ++load_ok;
      }
    });
  }
  const int rounds = Rounds();
  for (int round = 0; round < rounds && !HasFailure(); ++round) {
    std::vector<std::thread> streams;
    for (int s = 0; s < kStreams; ++s) streams.emplace_back([s, round] { RunStream(s, round); });
    for (std::thread& t : streams) t.join();
  }
  stop = true;
  for (std::thread& t : load) t.join();
  std::fprintf(stderr, "[test] %d rounds of %d streams; %lld requests of other connections\n",
               rounds, kStreams, static_cast<long long>(load_ok.load()));
  EXPECT_GT(load_ok.load(), 0) << "the other connections' load never ran";
}

}  // namespace
}  // namespace layerserve::integration
