// Sessions end to end: the real server keeps each session's K/V between
// requests, and the client drives it with the sequence parameters
// (sequence_id, sequence_start, sequence_end, sequence_position).
//
// The oracle: a session fed in pieces must give, for every new token, the
// hidden states that one stateless request over the whole sequence gives,
// within the tolerance of the wire and compute datatypes. On that rest the
// checks of rollback, pipelined steps, errors that leave other sessions
// intact, a session over one ModelStreamInfer stream (the client's
// InferStream) equal to the same session over unary calls, the server's limits
// (--max-session-tokens, --kv-cache-memory,
// --max-sessions), draining on SIGTERM and many sessions from many threads.
//
// Order: the server runs a session's requests in the order they reach its
// queue, and gRPC keeps no order between unary calls, even on one channel.
// Tests that need an order either wait for each reply, or send the next
// request once the one before shows in the queue (a long queue delay keeps
// it there), or send positions, so that a step that arrives early is
// refused rather than applied in the wrong place.
//
// A backend without a KV cache (the CUDA one, for now) serves no sessions:
// its ModelConfig has no sequence_batching, and every test that needs
// sessions skips with a message saying so.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/async_results.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::InferOptions;
using client::SequenceId;
using client::Tensor;

constexpr int64_t kHidden = 512;  // the demo model's
constexpr char kModel[] = "demo";
constexpr char kNoSessions[] =
    "the server's ModelConfig has no sequence_batching: its backend keeps no KV cache, so it "
    "serves no sessions";

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// ---------------------------------------------------------------------------
// A server and what it says about itself.

struct Served {
  std::unique_ptr<ServerProcess> process;
  std::unique_ptr<Client> client;
  inference::ModelConfig config;

  bool sessions() const { return config.has_sequence_batching(); }
  // A ModelConfig parameter as a number (kv_blocks, kv_block_tokens, ...).
  int64_t Parameter(const std::string& key) const {
    int64_t value = -1;
    const auto it = config.parameters().find(key);
    if (it == config.parameters().end() || !absl::SimpleAtoi(it->second.string_value(), &value)) {
      ADD_FAILURE() << "ModelConfig has no numeric parameter " << key;
    }
    return value;
  }
};

absl::StatusOr<inference::ModelConfig> FetchModelConfig(const ServerProcess& server) {
  auto stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(server.grpc_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  inference::ModelConfigRequest request;
  request.set_name(server.model());
  inference::ModelConfigResponse response;
  const grpc::Status status = stub->ModelConfig(&context, request, &response);
  if (!status.ok()) return client::FromGrpcStatus(status);
  return response.config();
}

// Starts a server with `args` (after $LAYERSERVE_SERVER_ARGS), connects a
// client and reads the ModelConfig. Fatal failures on error; callers wrap it
// in ASSERT_NO_FATAL_FAILURE.
void StartServer(const std::vector<std::string>& args, Served* served) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> process = ServerProcess::Start(args);
  ASSERT_TRUE(process.ok()) << process.status();
  served->process = *std::move(process);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(served->process->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();
  served->client = *std::move(client);
  absl::StatusOr<inference::ModelConfig> config = FetchModelConfig(*served->process);
  ASSERT_TRUE(config.ok()) << config.status();
  served->config = *std::move(config);
}

// ---------------------------------------------------------------------------
// Sequences, pieces of them and the oracle.

// Rows [from, from + count) of every sequence of x ([batch, length, hidden]).
template <typename T>
std::vector<T> Rows(const std::vector<T>& x, int64_t batch, int64_t length, int64_t from,
                    int64_t count) {
  std::vector<T> rows;
  rows.reserve(static_cast<size_t>(batch * count * kHidden));
  for (int64_t b = 0; b < batch; ++b) {
    const auto first = x.begin() + (b * length + from) * kHidden;
    rows.insert(rows.end(), first, first + count * kHidden);
  }
  return rows;
}

// The token values of a session's sequences: [batch, length, hidden], exact
// in BF16 so that every wire datatype carries the same input.
struct Sequence {
  Sequence(int64_t batch, int64_t length, uint64_t seed)
      : batch(batch),
        length(length),
        x(RandomBf16ExactValues(static_cast<size_t>(batch * length * kHidden), seed)) {}

  int64_t batch;
  int64_t length;
  std::vector<float> x;
};

InferOptions Options(const SequenceId& id, bool start = false, bool end = false,
                     std::optional<int64_t> position = std::nullopt) {
  InferOptions options;
  options.sequence_id = id;
  options.sequence_start = start;
  options.sequence_end = end;
  options.sequence_position = position;
  return options;
}

std::string IdString(const SequenceId& id) {
  if (const int64_t* integer = std::get_if<int64_t>(&id)) return absl::StrCat(*integer);
  return absl::StrCat("\"", std::get<std::string>(id), "\"");
}

// Tokens [from, from + count) of every sequence of `seq`, as a tensor.
Tensor Piece(const Sequence& seq, int64_t from, int64_t count, const std::string& datatype) {
  absl::StatusOr<Tensor> tensor = client::FloatsToTensor(
      Rows(seq.x, seq.batch, seq.length, from, count), {seq.batch, count, kHidden}, datatype);
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return tensor.ok() ? *std::move(tensor) : Tensor{};
}

// One request: tokens [from, from + count) of `seq` with `options`.
absl::StatusOr<Tensor> Step(Client& client, const Sequence& seq, int64_t from, int64_t count,
                            const std::string& datatype, const InferOptions& options) {
  return client.Infer(kModel, Piece(seq, from, count, datatype), In(absl::Seconds(60)), options);
}

// The oracle: one stateless request over the whole of `seq`, decoded.
// A stateless reply used as a session's oracle is itself rounded as the
// steps are: each is within the compute type's tolerance of the exact
// result, so the two are within twice that of each other (on the CUDA
// backend, bf16 through 4 layers, batched with other requests through other
// GEMM configurations: a few ulps apart).
constexpr double kStatelessOracleFactor = 2.0;

absl::StatusOr<std::vector<double>> Stateless(Client& client, const Sequence& seq,
                                              const std::string& datatype) {
  absl::StatusOr<Tensor> out =
      client.Infer(kModel, Piece(seq, 0, seq.length, datatype), In(absl::Seconds(60)));
  if (!out.ok()) return out.status();
  absl::StatusOr<std::vector<float>> values = client::TensorToFloats(*out);
  if (!values.ok()) return values.status();
  return std::vector<double>(values->begin(), values->end());
}

// A step's reply against the oracle's rows [from, from + count).
::testing::AssertionResult StepMatches(const absl::StatusOr<Tensor>& got,
                                       const std::vector<double>& oracle, const Sequence& seq,
                                       int64_t from, int64_t count, const std::string& datatype,
                                       double tolerance_factor) {
  if (!got.ok()) {
    return ::testing::AssertionFailure()
           << "tokens [" << from << ", " << from + count << "): " << got.status();
  }
  ::testing::AssertionResult match =
      MatchesReference(*got, {seq.batch, count, kHidden}, datatype,
                       Rows(oracle, seq.batch, seq.length, from, count), tolerance_factor);
  if (!match) match << " (tokens [" << from << ", " << from + count << "))";
  return match;
}

// Tokens [0, count) of every sequence of a [B, T, hidden] reply.
absl::StatusOr<Tensor> FirstTokens(const Tensor& reply, int64_t count) {
  const std::optional<size_t> element = client::DatatypeByteSize(reply.datatype);
  if (!element || reply.shape.size() != 3 || reply.shape[1] < count) {
    return absl::InvalidArgumentError("not a [B, T, hidden] tensor of at least `count` tokens");
  }
  const size_t row = static_cast<size_t>(reply.shape[2]) * *element;
  Tensor first{reply.datatype, {reply.shape[0], count, reply.shape[2]}, ""};
  for (int64_t b = 0; b < reply.shape[0]; ++b) {
    first.data.append(reply.data, static_cast<size_t>(b * reply.shape[1]) * row,
                      static_cast<size_t>(count) * row);
  }
  return first;
}

// The status is `code` and its message contains each of `parts`.
::testing::AssertionResult IsError(const absl::Status& status, absl::StatusCode code,
                                   const std::vector<std::string>& parts) {
  if (status.code() != code) {
    return ::testing::AssertionFailure()
           << "expected " << absl::StatusCodeToString(code) << ", got " << status;
  }
  for (const std::string& part : parts) {
    if (!absl::StrContains(status.message(), part)) {
      return ::testing::AssertionFailure() << "'" << part << "' is missing from: " << status;
    }
  }
  return ::testing::AssertionSuccess() << status;
}

// A session that follows its sequence in order and checks every reply
// against the oracle.
class Session {
 public:
  Session(Client* client, SequenceId id, Sequence seq, std::string datatype)
      : client_(client), id_(std::move(id)), seq_(std::move(seq)), datatype_(std::move(datatype)) {}

  const SequenceId& id() const { return id_; }
  const Sequence& seq() const { return seq_; }
  int64_t length() const { return length_; }
  const std::string& datatype() const { return datatype_; }

  // The stateless reply over the whole sequence; before any Send.
  ::testing::AssertionResult ComputeOracle() {
    absl::StatusOr<std::vector<double>> oracle = Stateless(*client_, seq_, datatype_);
    if (!oracle.ok()) return ::testing::AssertionFailure() << "oracle: " << oracle.status();
    oracle_ = *std::move(oracle);
    oracle_factor_ = kStatelessOracleFactor;
    return ::testing::AssertionSuccess();
  }
  // The float64 reference instead, where a stateless request would wait out
  // a long queue delay.
  void UseReference(const DemoReference& reference) {
    oracle_ = reference.Run(seq_.x, seq_.batch, seq_.length);
    oracle_factor_ = 1.0;
  }
  const std::vector<double>& oracle() const { return oracle_; }
  double oracle_factor() const { return oracle_factor_; }

  // Sends the next `count` tokens (the first piece with sequence_start) and
  // checks the reply.
  ::testing::AssertionResult Send(int64_t count, bool end = false) {
    if (length_ + count > seq_.length) {
      return ::testing::AssertionFailure() << "the test's sequence is too short";
    }
    const absl::StatusOr<Tensor> got =
        Step(*client_, seq_, length_, count, datatype_, Options(id_, length_ == 0, end));
    ::testing::AssertionResult match =
        StepMatches(got, oracle_, seq_, length_, count, datatype_, oracle_factor_);
    if (got.ok()) length_ += count;
    if (!match) match << " in session " << IdString(id_);
    return match;
  }

 private:
  Client* const client_;
  const SequenceId id_;
  const Sequence seq_;
  const std::string datatype_;
  std::vector<double> oracle_;
  double oracle_factor_ = 1.0;  // the tolerance's factor for oracle_
  int64_t length_ = 0;
};

// ---------------------------------------------------------------------------
// Tests on one shared server with room for every session they open.

class SessionsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    served_ = new Served();
    // A modest pool (256 blocks of 16 tokens on the CPU backend), not the
    // default share of the machine's memory.
    StartServer({"--kv-cache-memory=32MiB"}, served_);
  }
  static void TearDownTestSuite() {
    delete served_;  // kills the child
    served_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(served_, nullptr);
    ASSERT_NE(served_->client, nullptr) << "the server did not start";
    if (!served_->sessions()) GTEST_SKIP() << kNoSessions;
  }

  static Client& client() { return *served_->client; }

  static Served* served_;
};

Served* SessionsTest::served_ = nullptr;

// B, wire datatype, string (true) or integer session id.
using OracleParam = std::tuple<int64_t, std::string, bool>;

class SessionOracleTest : public SessionsTest, public ::testing::WithParamInterface<OracleParam> {};

// Prefill, then steps of one and of several tokens, crossing the 16-token
// block boundaries (16 and 32) inside a step, ending on one and starting the
// next block with a step of one; the last step ends the session.
TEST_P(SessionOracleTest, PiecesMatchOneStatelessRequest) {
  const auto& [batch, datatype, string_id] = GetParam();
  const std::vector<int64_t> pieces = {6, 1, 1, 10, 1, 13, 1, 3, 5};
  // Token ranges: [0,6) [6] [7] [8,18) [18] [19,32) [32] [33,36) [36,41).
  const int64_t length = std::accumulate(pieces.begin(), pieces.end(), int64_t{0});
  const SequenceId id = string_id ? SequenceId(absl::StrCat("oracle-B", batch, "-", datatype))
                                  : SequenceId(int64_t{1000 + 10 * batch + (datatype == "BF16")});
  Session session(&client(), id, Sequence(batch, length, 7000 + batch), datatype);
  ASSERT_TRUE(session.ComputeOracle());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ::testing::AssertionResult match = session.Send(pieces[i], i + 1 == pieces.size());
    ASSERT_TRUE(match) << "piece " << i;
    std::fprintf(stderr, "[test] B=%lld %s id %s piece %zu (%lld tokens): %s\n",
                 static_cast<long long>(batch), datatype.c_str(), IdString(id).c_str(), i,
                 static_cast<long long>(pieces[i]), match.message());
  }
  // sequence_end freed it.
  const absl::StatusOr<Tensor> after = Step(client(), session.seq(), 0, 1, datatype, Options(id));
  EXPECT_TRUE(IsError(after.status(), absl::StatusCode::kNotFound, {"not found"}));
}

INSTANTIATE_TEST_SUITE_P(Sessions, SessionOracleTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values("FP32", "BF16"), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<OracleParam>& info) {
                           return absl::StrCat("B", std::get<0>(info.param), "_",
                                               std::get<1>(info.param), "_",
                                               std::get<2>(info.param) ? "StringId" : "IntId");
                         });

// Rolling back with sequence_position equals never having sent the dropped
// tokens: the session takes 6 tokens that are not part of the final
// sequence, then 12 more (to 32, two full blocks), and is rolled back to 14,
// inside the first block, by a request that carries the final sequence's
// tokens from there. A position past the length is refused naming both
// numbers and changes nothing.
TEST_F(SessionsTest, RollbackEqualsNeverSendingTheDroppedTokens) {
  constexpr int64_t kBatch = 2;
  const std::string datatype = "FP32";
  const SequenceId id = std::string("rollback");
  const Sequence kept(kBatch, 25, 8100);  // the final sequence
  const Sequence dropped(kBatch, 32, 8101);
  absl::StatusOr<std::vector<double>> oracle = Stateless(client(), kept, datatype);
  ASSERT_TRUE(oracle.ok()) << oracle.status();

  // Tokens 0..19: kept's first 14, then 6 of `dropped` (its random values
  // are all overwritten).
  Sequence mixed(kBatch, 20, 0);
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t t = 0; t < 20; ++t) {
      const Sequence& from = t < 14 ? kept : dropped;
      std::copy_n(from.x.begin() + (b * from.length + t) * kHidden, kHidden,
                  mixed.x.begin() + (b * 20 + t) * kHidden);
    }
  }
  const absl::StatusOr<Tensor> prefill =
      Step(client(), mixed, 0, 20, datatype, Options(id, /*start=*/true));
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_TRUE(StepMatches(FirstTokens(*prefill, 14), *oracle, kept, 0, 14, datatype,
                          kStatelessOracleFactor));
  const absl::StatusOr<Tensor> more = Step(client(), dropped, 20, 12, datatype, Options(id));
  ASSERT_TRUE(more.ok()) << more.status();

  // Back to 14: blocks [16, 32) are given back and taken again.
  EXPECT_TRUE(
      StepMatches(Step(client(), kept, 14, 3, datatype, Options(id, false, false, /*position=*/14)),
                  *oracle, kept, 14, 3, datatype, kStatelessOracleFactor));
  // An explicit position equal to the length appends.
  EXPECT_TRUE(StepMatches(Step(client(), kept, 17, 7, datatype, Options(id, false, false, 17)),
                          *oracle, kept, 17, 7, datatype, kStatelessOracleFactor));
  // Past the length (24): refused, naming both.
  const absl::StatusOr<Tensor> past =
      Step(client(), kept, 24, 1, datatype, Options(id, false, false, 27));
  EXPECT_TRUE(IsError(past.status(), absl::StatusCode::kFailedPrecondition, {"27", "24"}));
  // ... and the session is as it was.
  EXPECT_TRUE(StepMatches(Step(client(), kept, 24, 1, datatype, Options(id, false, true)), *oracle,
                          kept, 24, 1, datatype, kStatelessOracleFactor));
}

// Errors on one session's requests (unknown ids of either kind, a session
// already ended, a batch size that is not the session's, a position past the
// length) change nothing for the sessions open beside it.
TEST_F(SessionsTest, ErrorsLeaveOtherSessionsIntact) {
  Session a(&client(), int64_t{424}, Sequence(1, 12, 8300), "FP32");
  Session b(&client(), std::string("bystander"), Sequence(2, 12, 8301), "BF16");
  ASSERT_TRUE(a.ComputeOracle());
  ASSERT_TRUE(b.ComputeOracle());
  ASSERT_TRUE(a.Send(8));
  ASSERT_TRUE(b.Send(8));

  // "424" is not the integer session 424.
  for (const SequenceId& unknown :
       {SequenceId(int64_t{987654321}), SequenceId("no-such-session"), SequenceId("424")}) {
    const absl::StatusOr<Tensor> got = Step(client(), a.seq(), 0, 1, "FP32", Options(unknown));
    EXPECT_TRUE(
        IsError(got.status(), absl::StatusCode::kNotFound, {IdString(unknown), "not found"}))
        << IdString(unknown);
  }
  // Started and ended by one request: gone after it.
  const SequenceId ended = std::string("ended");
  const absl::StatusOr<Tensor> once =
      Step(client(), a.seq(), 0, 4, "FP32", Options(ended, true, true));
  EXPECT_TRUE(once.ok()) << once.status();
  const absl::StatusOr<Tensor> after = Step(client(), a.seq(), 4, 1, "FP32", Options(ended));
  EXPECT_TRUE(IsError(after.status(), absl::StatusCode::kNotFound, {IdString(ended), "not found"}));
  // Two sequences to a session of one, and one to a session of two.
  const absl::StatusOr<Tensor> wider = Step(client(), b.seq(), 8, 1, "FP32", Options(a.id()));
  EXPECT_TRUE(IsError(wider.status(), absl::StatusCode::kInvalidArgument, {"1", "2"}));
  const absl::StatusOr<Tensor> narrower = Step(client(), a.seq(), 8, 1, "BF16", Options(b.id()));
  EXPECT_TRUE(IsError(narrower.status(), absl::StatusCode::kInvalidArgument, {"2", "1"}));
  // Past the length.
  const absl::StatusOr<Tensor> past =
      Step(client(), a.seq(), 8, 1, "FP32", Options(a.id(), false, false, 9));
  EXPECT_TRUE(IsError(past.status(), absl::StatusCode::kFailedPrecondition, {"9", "8"}));

  EXPECT_TRUE(a.Send(4, /*end=*/true));
  EXPECT_TRUE(b.Send(4, /*end=*/true));
}

// A session over one stream (Client::OpenStream) gives, reply for reply,
// what the same session over unary calls gives, and both match the oracle.
// Errors on the stream (an unknown session, a batch size that is not the
// session's, a position past the length, a step after sequence_end) come
// back as their codes, and the stream goes on carrying the session.
TEST_F(SessionsTest, AStreamCarriesASessionAsUnaryCallsDo) {
  constexpr int64_t kBatch = 2;
  const std::string datatype = "FP32";
  const std::vector<int64_t> pieces = {6, 1, 1, 10, 1, 5};  // crosses the block at 16
  const int64_t length = std::accumulate(pieces.begin(), pieces.end(), int64_t{0});
  const Sequence seq(kBatch, length, 8400);
  absl::StatusOr<std::vector<double>> oracle = Stateless(client(), seq, datatype);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  const SequenceId unary_id = std::string("twin-unary");
  const SequenceId stream_id = std::string("twin-stream");
  std::unique_ptr<client::InferStream> stream = client().OpenStream(In(absl::Seconds(60)));

  int64_t from = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("piece ", i));
    const bool start = i == 0, end = i + 1 == pieces.size();
    const absl::StatusOr<Tensor> unary =
        Step(client(), seq, from, pieces[i], datatype, Options(unary_id, start, end));
    const absl::StatusOr<Tensor> streamed = stream->Infer(
        kModel, Piece(seq, from, pieces[i], datatype), Options(stream_id, start, end));
    ASSERT_TRUE(
        StepMatches(streamed, *oracle, seq, from, pieces[i], datatype, kStatelessOracleFactor));
    ASSERT_TRUE(unary.ok()) << unary.status();
    EXPECT_EQ(streamed->shape, unary->shape);
    EXPECT_TRUE(streamed->data == unary->data) << "the stream's reply differs from the unary one";

    if (i == 2) {
      // Errors in the middle of the session, each answered on the stream.
      const absl::StatusOr<Tensor> unknown = stream->Infer(
          kModel, Piece(seq, 0, 1, datatype), Options(SequenceId("no-such-stream-session")));
      EXPECT_TRUE(IsError(unknown.status(), absl::StatusCode::kNotFound,
                          {"no-such-stream-session", "not found"}));
      const Sequence narrow(1, 1, 8401);
      const absl::StatusOr<Tensor> wrong_batch =
          stream->Infer(kModel, Piece(narrow, 0, 1, datatype), Options(stream_id));
      EXPECT_TRUE(IsError(wrong_batch.status(), absl::StatusCode::kInvalidArgument, {"1", "2"}));
      const absl::StatusOr<Tensor> past = stream->Infer(kModel, Piece(seq, 0, 1, datatype),
                                                        Options(stream_id, false, false, from + 5));
      EXPECT_TRUE(IsError(past.status(), absl::StatusCode::kFailedPrecondition,
                          {absl::StrCat(from + 5), absl::StrCat(from + pieces[i])}));
    }
    from += pieces[i];
  }
  // sequence_end freed the session; the stream still answers.
  const absl::StatusOr<Tensor> after =
      stream->Infer(kModel, Piece(seq, 0, 1, datatype), Options(stream_id));
  EXPECT_TRUE(IsError(after.status(), absl::StatusCode::kNotFound, {"twin-stream", "not found"}));
  const absl::StatusOr<Tensor> again =
      stream->Infer(kModel, Piece(seq, 0, 3, datatype), Options(stream_id, true, true));
  EXPECT_TRUE(StepMatches(again, *oracle, seq, 0, 3, datatype, kStatelessOracleFactor))
      << "a new session on the stream";
  EXPECT_TRUE(stream->Close().ok());
}

// Steps of one session sent back to back with AsyncInfer, each without
// waiting for the previous reply and each with its sequence_position, beside
// a burst of stateless requests. gRPC keeps no order between unary calls, so
// a step may reach the server's queue before the one it follows: it is then
// refused (its position is past the session's length), never applied in the
// wrong place, and so are the steps after it. So every step is answered,
// correctly (the oracle's rows) up to the first refused one and refused
// from there; sent again in order, the refused ones complete the session;
// the burst is unaffected. (SessionQueueTest.StepsRunInTheOrderTheyAreQueued
// shows that steps that reach the queue in order run in that order.)
TEST_F(SessionsTest, PipelinedStepsWithPositionsAreNeverMisapplied) {
  const std::string datatype = "FP32";
  constexpr int64_t kPrefill = 5;
  const std::vector<int64_t> steps = {1, 2, 1, 3, 1, 4, 1};
  const int64_t length = kPrefill + std::accumulate(steps.begin(), steps.end(), int64_t{0});
  const SequenceId id = std::string("pipelined");
  Session session(&client(), id, Sequence(1, length, 8200), datatype);
  ASSERT_TRUE(session.ComputeOracle());
  ASSERT_TRUE(session.Send(kPrefill));

  const Sequence burst(1, 3, 8201);
  const std::vector<double> burst_expected = DemoReference(0, 4).Run(burst.x, 1, burst.length);
  const Tensor burst_input = Piece(burst, 0, burst.length, datatype);

  std::vector<int64_t> starts;  // each step's first token
  for (int64_t from = kPrefill; const int64_t count : steps) {
    starts.push_back(from);
    from += count;
  }
  const auto end = [&](size_t i) { return i + 1 == steps.size(); };
  const int calls = static_cast<int>(2 * steps.size());
  const std::shared_ptr<AsyncResults> results = AsyncResults::Create(calls);
  for (size_t i = 0; i < steps.size(); ++i) {
    client().AsyncInfer(kModel, Piece(session.seq(), starts[i], steps[i], datatype),
                        In(absl::Seconds(60)), Options(id, false, end(i), starts[i]),
                        results->Callback(static_cast<int>(2 * i)));
    client().AsyncInfer(kModel, burst_input, In(absl::Seconds(60)),
                        results->Callback(static_cast<int>(2 * i + 1)));
  }
  const auto waited = results->Wait(absl::Seconds(60));
  ASSERT_TRUE(waited.ok()) << waited.status();
  size_t first_refused = steps.size();
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "step " << i);
    const absl::StatusOr<Tensor>& step = (*waited)[2 * i];
    if (first_refused == steps.size() && !step.ok()) first_refused = i;
    if (i < first_refused) {
      EXPECT_TRUE(StepMatches(step, session.oracle(), session.seq(), starts[i], steps[i], datatype,
                              session.oracle_factor()));
    } else {
      EXPECT_TRUE(IsError(step.status(), absl::StatusCode::kFailedPrecondition,
                          {absl::StrCat("sequence_position ", starts[i]), "past"}));
    }
    const absl::StatusOr<Tensor>& stateless = (*waited)[2 * i + 1];
    ASSERT_TRUE(stateless.ok()) << stateless.status();
    EXPECT_TRUE(MatchesReference(*stateless, {1, burst.length, kHidden}, datatype, burst_expected));
  }
  std::fprintf(stderr, "[test] %zu of %zu pipelined steps ran, the rest reached the queue early\n",
               first_refused, steps.size());
  for (size_t i = first_refused; i < steps.size(); ++i) {
    EXPECT_TRUE(StepMatches(Step(client(), session.seq(), starts[i], steps[i], datatype,
                                 Options(id, false, end(i), starts[i])),
                            session.oracle(), session.seq(), starts[i], steps[i], datatype,
                            session.oracle_factor()))
        << "step " << i << " sent again";
  }
  const absl::StatusOr<Tensor> ended = Step(client(), session.seq(), 0, 1, datatype, Options(id));
  EXPECT_TRUE(IsError(ended.status(), absl::StatusCode::kNotFound, {"not found"}));
}

// Sessions from several threads, each thread stepping its own sessions in
// turn with pieces of random sizes: each session matches its own oracle.
// Threads 0 and 2 name theirs by integers, 1 and 3 by the same numbers as
// strings, which are other sessions.
TEST_F(SessionsTest, InterleavedSessionsFromThreadsStayIndependent) {
  constexpr int kThreads = 4;
  constexpr int kSessionsPerThread = 3;
  constexpr int64_t kLength = 20;
  const std::string target = served_->process->grpc_target();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &target] {
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Connect(target, /*dedicated_connection=*/true);
      ASSERT_TRUE(client.ok()) << client.status();
      std::vector<std::unique_ptr<Session>> sessions;
      for (int j = 0; j < kSessionsPerThread; ++j) {
        const int64_t number = 10 * (t / 2) + j + 1;
        const SequenceId id = t % 2 == 0 ? SequenceId(number) : SequenceId(absl::StrCat(number));
        sessions.push_back(std::make_unique<Session>(
            client->get(), id, Sequence(1 + j % 2, kLength, 9000 + 10 * t + j),
            j == 1 ? "BF16" : "FP32"));
        ASSERT_TRUE(sessions.back()->ComputeOracle());
      }
      std::mt19937 random(static_cast<uint32_t>(t));
      std::vector<bool> failed(sessions.size(), false);
      for (bool more = true; more;) {
        more = false;
        for (size_t j = 0; j < sessions.size(); ++j) {
          Session& session = *sessions[j];
          const int64_t left = kLength - session.length();
          if (failed[j] || left == 0) continue;
          const int64_t count = std::min<int64_t>(
              left,
              session.length() == 0 ? 4 : std::uniform_int_distribution<int64_t>(1, 4)(random));
          const ::testing::AssertionResult match = session.Send(count, count == left);
          EXPECT_TRUE(match) << "thread " << t;
          failed[j] = !match;
          more = true;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// ---------------------------------------------------------------------------
// Tests that need a server of their own: a queue delay, or small limits.

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
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// A server whose 1 s queue delay holds requests in the queue, so that the
// order in which they are queued is the order they were sent: each is sent
// once the one before it shows in layerserve_queue_depth. Expected values
// come from the float64 reference (a stateless oracle would wait the delay).
class SessionQueueTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    served_ = new Served();
    StartServer(
        {"--kv-cache-memory=32MiB", "--max-queue-delay-us=1000000", "--batch-delay-when-idle"},
        served_);
    reference_ = new DemoReference(0, 4);
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete served_;
    reference_ = nullptr;
    served_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(served_, nullptr);
    ASSERT_NE(served_->client, nullptr) << "the server did not start";
    if (!served_->sessions()) GTEST_SKIP() << kNoSessions;
  }

  static Client& client() { return *served_->client; }

  // AsyncInfer, then waits until the queue holds `depth` requests.
  static ::testing::AssertionResult SendQueued(const Tensor& input, const InferOptions& options,
                                               client::Client::InferCallback done, int depth) {
    client().AsyncInfer(kModel, input, In(absl::Seconds(30)), options, std::move(done));
    absl::StatusOr<double> queued = WaitForQueueDepth(*served_->process, depth, absl::Seconds(2));
    if (!queued.ok()) return ::testing::AssertionFailure() << queued.status();
    if (*queued != depth) {
      return ::testing::AssertionFailure()
             << *queued << " requests queued, expected " << depth
             << " (did the queue delay pass while the test was sending?)";
    }
    return ::testing::AssertionSuccess();
  }

  static Served* served_;
  static DemoReference* reference_;
};

Served* SessionQueueTest::served_ = nullptr;
DemoReference* SessionQueueTest::reference_ = nullptr;

// A session's steps queued in order, with stateless requests queued between
// them, run in that order, one at a time: each reply is the oracle's rows
// for its place. No positions are sent, so a step run out of order would
// give wrong values (or NOT_FOUND, for steps after the end).
TEST_F(SessionQueueTest, StepsRunInTheOrderTheyAreQueued) {
  const std::string datatype = "BF16";
  const std::vector<int64_t> pieces = {4, 1, 2, 1, 3};
  const int64_t length = std::accumulate(pieces.begin(), pieces.end(), int64_t{0});
  const SequenceId id = std::string("queued-in-order");
  Session session(&client(), id, Sequence(2, length, 8450), datatype);
  session.UseReference(*reference_);
  const Sequence stateless(1, 2, 8451);
  const std::vector<double> stateless_expected = reference_->Run(stateless.x, 1, stateless.length);

  const int calls = static_cast<int>(2 * pieces.size());
  const std::shared_ptr<AsyncResults> results = AsyncResults::Create(calls);
  int depth = 0;
  for (int64_t i = 0, from = 0; i < static_cast<int64_t>(pieces.size()); from += pieces[i++]) {
    const bool last = i + 1 == static_cast<int64_t>(pieces.size());
    ASSERT_TRUE(SendQueued(Piece(session.seq(), from, pieces[i], datatype),
                           Options(id, /*start=*/i == 0, /*end=*/last),
                           results->Callback(static_cast<int>(2 * i)), ++depth));
    ASSERT_TRUE(SendQueued(Piece(stateless, 0, stateless.length, datatype), InferOptions{},
                           results->Callback(static_cast<int>(2 * i + 1)), ++depth));
  }
  const auto waited = results->Wait(absl::Seconds(30));
  ASSERT_TRUE(waited.ok()) << waited.status();
  for (int64_t i = 0, from = 0; i < static_cast<int64_t>(pieces.size()); from += pieces[i++]) {
    SCOPED_TRACE(testing::Message() << "piece " << i);
    EXPECT_TRUE(StepMatches((*waited)[2 * i], session.oracle(), session.seq(), from, pieces[i],
                            datatype, session.oracle_factor()));
    const absl::StatusOr<Tensor>& other = (*waited)[2 * i + 1];
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_TRUE(
        MatchesReference(*other, {1, stateless.length, kHidden}, datatype, stateless_expected));
  }
}

// sequence_start for a session whose step is still queued is refused; the
// queued step then runs as if nothing had happened, the session goes on,
// and once its replies are in, sequence_start resets it.
TEST_F(SessionQueueTest, SequenceStartWhileAStepIsQueuedIsRefused) {
  const std::string datatype = "FP32";
  const SequenceId id = int64_t{77};
  Session first(&client(), id, Sequence(1, 7, 8400), datatype);
  Session second(&client(), id, Sequence(1, 3, 8401), datatype);
  first.UseReference(*reference_);
  second.UseReference(*reference_);

  const std::shared_ptr<AsyncResults> results = AsyncResults::Create(2);
  ASSERT_TRUE(SendQueued(Piece(first.seq(), 0, 4, datatype), Options(id, /*start=*/true),
                         results->Callback(0), 1));
  const absl::StatusOr<Tensor> restart =
      Step(client(), second.seq(), 0, 3, datatype, Options(id, /*start=*/true));
  EXPECT_TRUE(IsError(restart.status(), absl::StatusCode::kFailedPrecondition,
                      {"sequence_start", IdString(id), "queued or in flight"}))
      << (results->Pending() == 1 ? "" : " (the first step had already been answered)");
  ASSERT_TRUE(SendQueued(Piece(first.seq(), 4, 3, datatype), Options(id), results->Callback(1), 2));
  const auto waited = results->Wait(absl::Seconds(30));
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_TRUE(StepMatches((*waited)[0], first.oracle(), first.seq(), 0, 4, datatype,
                          first.oracle_factor()));
  EXPECT_TRUE(StepMatches((*waited)[1], first.oracle(), first.seq(), 4, 3, datatype,
                          first.oracle_factor()));
  EXPECT_TRUE(second.Send(3, /*end=*/true));
}

// --max-session-tokens bounds B x L: a step that would pass it is refused
// and the session can still grow to the limit exactly.
TEST(SessionLimitsTest, MaxSessionTokensRefusesTheStepThatWouldPassIt) {
  Served served;
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--kv-cache-memory=32MiB", "--max-session-tokens=40"}, &served));
  if (!served.sessions()) GTEST_SKIP() << kNoSessions;
  Client& client = *served.client;
  Session big(&client, std::string("big"), Sequence(2, 21, 8500), "FP32");
  Session small(&client, int64_t{5}, Sequence(1, 12, 8501), "FP32");
  ASSERT_TRUE(big.ComputeOracle());
  ASSERT_TRUE(small.ComputeOracle());
  ASSERT_TRUE(small.Send(10));
  ASSERT_TRUE(big.Send(16));  // 2 x 16 = 32 of 40 tokens

  // 2 x (16 + 5) = 42.
  const absl::StatusOr<Tensor> over = Step(client, big.seq(), 16, 5, "FP32", Options(big.id()));
  EXPECT_TRUE(IsError(over.status(), absl::StatusCode::kResourceExhausted, {"40"}));
  // A new session may not start past it either: 41 tokens.
  const absl::StatusOr<Tensor> start_over =
      Step(client, Sequence(1, 41, 8502), 0, 41, "FP32", Options(int64_t{6}, /*start=*/true));
  EXPECT_TRUE(IsError(start_over.status(), absl::StatusCode::kResourceExhausted, {"40"}));

  EXPECT_TRUE(big.Send(4, /*end=*/true));  // 2 x 20 = 40
  EXPECT_TRUE(small.Send(2, /*end=*/true));
}

// A KV cache of a few blocks: a step that needs more blocks than are free is
// refused, saying how many are free, and succeeds once another session has
// given its blocks back; the sessions open meanwhile are unchanged.
TEST(SessionLimitsTest, KvCacheExhaustedSaysHowManyBlocksAreFree) {
  Served served;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=1MiB"}, &served));
  if (!served.sessions()) GTEST_SKIP() << kNoSessions;
  Client& client = *served.client;
  const int64_t blocks = served.Parameter("kv_blocks");
  const int64_t block_tokens = served.Parameter("kv_block_tokens");
  // 8 blocks of 16 tokens on the CPU backend (128 KiB each for the demo model).
  ASSERT_GE(blocks, 4) << "--kv-cache-memory=1MiB should hold a few blocks";
  ASSERT_LE(blocks * block_tokens, 1024) << "a pool this large makes the test slow";
  const std::string of_blocks = absl::StrCat(" of ", blocks, " free");

  // k1 fills all but two blocks.
  Session k1(&client, std::string("k1"), Sequence(1, (blocks - 2) * block_tokens + 3, 8600),
             "FP32");
  Session k2(&client, int64_t{2}, Sequence(2, block_tokens, 8601), "FP32");
  ASSERT_TRUE(k1.ComputeOracle());
  ASSERT_TRUE(k2.ComputeOracle());
  ASSERT_TRUE(k1.Send((blocks - 2) * block_tokens));

  // Two sequences of block_tokens + 1 need 4 blocks; 2 are free.
  const absl::StatusOr<Tensor> too_big =
      Step(client, Sequence(2, block_tokens + 1, 8602), 0, block_tokens + 1, "FP32",
           Options(k2.id(), /*start=*/true));
  EXPECT_TRUE(IsError(too_big.status(), absl::StatusCode::kResourceExhausted,
                      {"4 needed", absl::StrCat(2, of_blocks)}));
  ASSERT_TRUE(k2.Send(block_tokens));  // the last two blocks
  // k1's next token needs a new block: none is free.
  const absl::StatusOr<Tensor> full =
      Step(client, k1.seq(), k1.length(), 1, "FP32", Options(k1.id()));
  EXPECT_TRUE(IsError(full.status(), absl::StatusCode::kResourceExhausted,
                      {"1 needed", absl::StrCat(0, of_blocks)}));
  // k2 ends with a step that needs no new block (it rewrites its last token).
  EXPECT_TRUE(StepMatches(Step(client, k2.seq(), block_tokens - 1, 1, "FP32",
                               Options(k2.id(), false, /*end=*/true, block_tokens - 1)),
                          k2.oracle(), k2.seq(), block_tokens - 1, 1, "FP32", k2.oracle_factor()));
  // Its blocks are free again, and k1 goes on as if nothing had happened.
  EXPECT_TRUE(k1.Send(3, /*end=*/true));
}

// --kv-cache-dtype=fp8: the same memory holds more blocks (about 3.8x the
// CPU backend's float32 rows, 1.9x CUDA's bf16 ones), and a session's steps
// match the float64 reference whose attention reads K and V quantized as the
// cache stores them, at the backend's usual tolerance; the reference without
// the quantization is measurably farther.
TEST(SessionLimitsTest, Fp8KvCacheHoldsMoreTokensAndStepsMatchItsReference) {
  Served plain;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=1MiB"}, &plain));
  if (!plain.sessions()) GTEST_SKIP() << kNoSessions;
  const int64_t plain_blocks = plain.Parameter("kv_blocks");
  Served served;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=1MiB", "--kv-cache-dtype=fp8"}, &served));
  const int64_t blocks = served.Parameter("kv_blocks");
  EXPECT_GE(static_cast<double>(blocks), 1.8 * static_cast<double>(plain_blocks))
      << blocks << " blocks of FP8 against " << plain_blocks;
  EXPECT_EQ(served.config.parameters().at("kv_cache_dtype").string_value(), "fp8");
  EXPECT_EQ(plain.config.parameters().at("kv_cache_dtype").string_value(), "auto");

  Session session(served.client.get(), std::string("fp8"), Sequence(2, 40, 8700), "FP32");
  session.UseReference(DemoReference(0, 4, /*kv_cache_fp8=*/true));
  for (const int64_t piece : {17, 1, 1, 5, 16}) ASSERT_TRUE(session.Send(piece));
  // The unquantized reference misses at least one of the same steps' tokens
  // at float32's tolerance (a bf16 backend's is wider than the quantization's
  // effect, so only the CPU backend's run can tell them apart here).
  if (ToleranceFor("FP32") > 1e-4) return;
  Session unquantized(served.client.get(), std::string("plain"), Sequence(2, 40, 8700), "FP32");
  unquantized.UseReference(DemoReference(0, 4));
  bool missed = false;
  for (const int64_t piece : {17, 1, 1, 5, 16}) missed = !unquantized.Send(piece) || missed;
  EXPECT_TRUE(missed) << "the FP8 cache's steps match the unquantized reference: no quantization?";
}

// --max-sessions: one more session than allowed is refused until one ends.
TEST(SessionLimitsTest, MaxSessionsRefusesOneMoreUntilOneEnds) {
  Served served;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=32MiB", "--max-sessions=2"}, &served));
  if (!served.sessions()) GTEST_SKIP() << kNoSessions;
  Client& client = *served.client;
  Session m1(&client, int64_t{1}, Sequence(1, 6, 8700), "FP32");
  Session m2(&client, std::string("m2"), Sequence(2, 6, 8701), "FP32");
  Session m3(&client, int64_t{3}, Sequence(1, 6, 8702), "FP32");
  ASSERT_TRUE(m1.ComputeOracle());
  ASSERT_TRUE(m2.ComputeOracle());
  ASSERT_TRUE(m3.ComputeOracle());
  ASSERT_TRUE(m1.Send(3));
  ASSERT_TRUE(m2.Send(3));

  const absl::StatusOr<Tensor> third =
      Step(client, m3.seq(), 0, 3, "FP32", Options(m3.id(), /*start=*/true));
  EXPECT_TRUE(
      IsError(third.status(), absl::StatusCode::kResourceExhausted, {IdString(m3.id()), "2"}));
  EXPECT_TRUE(m1.Send(3, /*end=*/true));
  EXPECT_TRUE(m3.Send(3));
  EXPECT_TRUE(m2.Send(3, /*end=*/true));
  EXPECT_TRUE(m3.Send(3, /*end=*/true));
}

// SIGTERM while session steps wait in the queue (a 1 s queue delay holds
// them; each wave of steps is sent once the one before shows in the queue,
// so they are queued in order): every accepted step, starts and ends
// included, completes with the right answer, and the server exits 0.
TEST(SessionShutdownTest, SigtermDrainsQueuedSessionSteps) {
  Served served;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=32MiB", "--max-queue-delay-us=1000000",
                                       "--batch-delay-when-idle", "--drain-timeout-s=20"},
                                      &served));
  if (!served.sessions()) GTEST_SKIP() << kNoSessions;
  const std::vector<int64_t> pieces = {5, 1, 3, 1};
  const int64_t length = std::accumulate(pieces.begin(), pieces.end(), int64_t{0});
  const DemoReference reference(0, 4);
  std::vector<std::unique_ptr<Session>> sessions;
  sessions.push_back(std::make_unique<Session>(served.client.get(), int64_t{1},
                                               Sequence(1, length, 8800), "FP32"));
  sessions.push_back(std::make_unique<Session>(served.client.get(), std::string("drain"),
                                               Sequence(2, length, 8801), "BF16"));
  for (auto& session : sessions) session->UseReference(reference);

  const int calls = static_cast<int>(pieces.size() * sessions.size());
  const std::shared_ptr<AsyncResults> results = AsyncResults::Create(calls);
  int depth = 0;
  for (int64_t i = 0, from = 0; i < static_cast<int64_t>(pieces.size()); from += pieces[i++]) {
    for (size_t k = 0; k < sessions.size(); ++k) {
      const Session& s = *sessions[k];
      served.client->AsyncInfer(
          kModel, Piece(s.seq(), from, pieces[i], s.datatype()), In(absl::Seconds(30)),
          Options(s.id(), /*start=*/i == 0, /*end=*/i + 1 == static_cast<int64_t>(pieces.size())),
          results->Callback(static_cast<int>(i * sessions.size() + k)));
    }
    depth += static_cast<int>(sessions.size());
    absl::StatusOr<double> queued = WaitForQueueDepth(*served.process, depth, absl::Seconds(2));
    ASSERT_TRUE(queued.ok()) << queued.status();
    ASSERT_EQ(*queued, depth) << "the steps were not all queued before SIGTERM";
  }
  ASSERT_EQ(results->Pending(), calls) << "steps finished before SIGTERM; the test proves nothing";

  // No request is sent during the drain: it is short here, and one that
  // crosses gRPC's stop at its end is CANCELLED, as the server documents
  // (shutdown_test covers the refusal of new work while draining).
  served.process->Signal(SIGTERM);

  const auto waited = results->Wait(absl::Seconds(25));
  ASSERT_TRUE(waited.ok()) << waited.status();
  for (int64_t i = 0, from = 0; i < static_cast<int64_t>(pieces.size()); from += pieces[i++]) {
    for (size_t k = 0; k < sessions.size(); ++k) {
      const Session& s = *sessions[k];
      SCOPED_TRACE(testing::Message() << "session " << IdString(s.id()) << " piece " << i);
      EXPECT_TRUE(StepMatches((*waited)[i * sessions.size() + k], s.oracle(), s.seq(), from,
                              pieces[i], s.datatype(), s.oracle_factor()));
    }
  }
  absl::StatusOr<int> exit_code = served.process->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// Without a KV cache (--kv-cache-memory=0 here; the CUDA backend has none
// yet) the ModelConfig says dynamic batching and a request naming a session
// is refused, while stateless ones are served. Runs on every backend.
TEST(SessionsOffTest, SequenceRequestsAreRefusedWithoutAKvCache) {
  Served served;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kv-cache-memory=0"}, &served));
  EXPECT_FALSE(served.config.has_sequence_batching());
  EXPECT_TRUE(served.config.has_dynamic_batching());
  const Sequence seq(1, 2, 8900);
  const absl::StatusOr<Tensor> refused =
      Step(*served.client, seq, 0, 2, "FP32", Options(int64_t{1}, /*start=*/true));
  EXPECT_TRUE(IsError(refused.status(), absl::StatusCode::kFailedPrecondition,
                      {"without sessions", "--kv-cache-memory=0"}));
  const absl::StatusOr<Tensor> stateless =
      served.client->Infer(kModel, Piece(seq, 0, 2, "FP32"), In(absl::Seconds(30)));
  EXPECT_TRUE(stateless.ok()) << stateless.status();
}

}  // namespace
}  // namespace layerserve::integration
