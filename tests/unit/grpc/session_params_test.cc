// The sequence parameters of a ModelInfer request (Triton's sequence batcher
// spelling plus layerserve's sequence_position) become the core request's
// SessionParams, or a clear error naming the parameter; a session request for
// a model that serves no sessions is FAILED_PRECONDITION.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "server/grpc/request_convert.h"

namespace layerserve {
namespace {

using inference::ModelInferRequest;

constexpr int64_t kHidden = 8;

ServedModel Model(bool sessions) {
  ServedModel model;
  model.name = "demo";
  model.backend = "cpu";
  model.config.hidden_size = kHidden;
  model.max_batch_tokens = 64;
  model.sessions = sessions;
  return model;
}

// A valid FP32 request of shape [1, 2, kHidden].
ModelInferRequest GoodRequest() {
  ModelInferRequest request;
  request.set_model_name("demo");
  request.set_id("r1");
  auto* input = request.add_inputs();
  input->set_name("hidden_states");
  input->set_datatype("FP32");
  for (int64_t dim : {int64_t{1}, int64_t{2}, kHidden}) input->add_shape(dim);
  request.add_raw_input_contents(std::string(2 * kHidden * sizeof(float), '\0'));
  return request;
}

inference::InferParameter& Param(ModelInferRequest& request, const std::string& name) {
  return (*request.mutable_parameters())[name];
}

absl::StatusOr<std::unique_ptr<InferRequest>> Make(const ModelInferRequest& request,
                                                   bool sessions = true) {
  const ServedModel model = Model(sessions);
  return MakeInferRequest(request, model, LimitsOf(model), std::nullopt, SteadyTime());
}

// The request must fail with `code` and a message containing each of `mentions`.
void ExpectError(const ModelInferRequest& request, absl::StatusCode code,
                 std::initializer_list<std::string> mentions, bool sessions = true) {
  const absl::Status status = Make(request, sessions).status();
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& mention : mentions) {
    EXPECT_TRUE(absl::StrContains(status.message(), mention))
        << "'" << mention << "' missing from: " << status.message();
  }
}

TEST(SessionParametersTest, StatelessRequestsHaveNoSession) {
  absl::StatusOr<std::unique_ptr<InferRequest>> made = Make(GoodRequest());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_FALSE((*made)->session.has_value());
  EXPECT_EQ((*made)->id, "r1");
  EXPECT_EQ((*made)->seq_len, 2);

  // 0 and "" mean "no sequence" (Triton's convention), with false flags too,
  // and that holds on a model without sessions as well.
  for (bool sessions : {true, false}) {
    ModelInferRequest zero = GoodRequest();
    Param(zero, "sequence_id").set_int64_param(0);
    Param(zero, "sequence_start").set_bool_param(false);
    Param(zero, "sequence_end").set_bool_param(false);
    made = Make(zero, sessions);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_FALSE((*made)->session.has_value());

    ModelInferRequest empty = GoodRequest();
    Param(empty, "sequence_id").set_string_param("");
    Param(empty, "priority").set_uint64_param(3);  // other parameters are ignored
    made = Make(empty, sessions);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_FALSE((*made)->session.has_value());

    ModelInferRequest zero_unsigned = GoodRequest();
    Param(zero_unsigned, "sequence_id").set_uint64_param(0);
    made = Make(zero_unsigned, sessions);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_FALSE((*made)->session.has_value());
  }
}

TEST(SessionParametersTest, IntegerIdWithFlags) {
  // What tritonclient sends for infer(..., sequence_id=42, sequence_start=True).
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_id").set_int64_param(42);
  Param(request, "sequence_start").set_bool_param(true);
  Param(request, "sequence_end").set_bool_param(false);
  absl::StatusOr<std::unique_ptr<InferRequest>> made = Make(request);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE((*made)->session.has_value());
  const SessionParams& session = *(*made)->session;
  EXPECT_EQ(session.id, SessionId(42));
  EXPECT_TRUE(session.start);
  EXPECT_FALSE(session.end);
  EXPECT_FALSE(session.position.has_value());

  // A middle step carries the id alone; a last step sequence_end.
  ModelInferRequest last = GoodRequest();
  Param(last, "sequence_id").set_int64_param(-5);  // any non-zero int64 names a session
  Param(last, "sequence_end").set_bool_param(true);
  made = Make(last);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->session->id, SessionId(-5));
  EXPECT_FALSE((*made)->session->start);
  EXPECT_TRUE((*made)->session->end);
}

TEST(SessionParametersTest, Uint64IdIsReinterpretedAsInt64) {
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_id").set_uint64_param(7);
  absl::StatusOr<std::optional<SessionParams>> parsed = ParseSessionParameters(request);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_TRUE(parsed->has_value());
  EXPECT_EQ((*parsed)->id, SessionId(7));

  // Triton's correlation ids are uint64 and it reads an int64 -1 as 2^64-1:
  // both spellings name one session here too.
  Param(request, "sequence_id").set_uint64_param(std::numeric_limits<uint64_t>::max());
  parsed = ParseSessionParameters(request);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ((*parsed)->id, SessionId(-1));
}

TEST(SessionParametersTest, StringIds) {
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_id").set_string_param("7");
  absl::StatusOr<std::optional<SessionParams>> parsed = ParseSessionParameters(request);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_TRUE(parsed->has_value());
  EXPECT_TRUE((*parsed)->id.is_string());
  EXPECT_EQ((*parsed)->id, SessionId(std::string("7")));
  EXPECT_NE((*parsed)->id, SessionId(7)) << "\"7\" and 7 are two sessions";

  // Up to kMaxSequenceIdBytes is accepted; one byte more is refused, and the
  // message does not echo the id.
  Param(request, "sequence_id").set_string_param(std::string(kMaxSequenceIdBytes, 'x'));
  parsed = ParseSessionParameters(request);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ((*parsed)->id.string_value().size(), kMaxSequenceIdBytes);

  Param(request, "sequence_id").set_string_param(std::string(kMaxSequenceIdBytes + 1, 'x'));
  ExpectError(request, absl::StatusCode::kInvalidArgument, {"sequence_id", "257", "256"});
  EXPECT_FALSE(absl::StrContains(Make(request).status().message(), "xxxx"));
  Param(request, "sequence_id").set_string_param(std::string(1 << 20, 'x'));
  ExpectError(request, absl::StatusCode::kInvalidArgument, {"sequence_id", "1048576"});
}

TEST(SessionParametersTest, Position) {
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_id").set_string_param("chat-1");
  for (int64_t position : {int64_t{0}, int64_t{5}, std::numeric_limits<int64_t>::max()}) {
    Param(request, "sequence_position").set_int64_param(position);
    absl::StatusOr<std::unique_ptr<InferRequest>> made = Make(request);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_EQ((*made)->session->position, position);
  }
  Param(request, "sequence_position").set_uint64_param(9);
  absl::StatusOr<std::unique_ptr<InferRequest>> made = Make(request);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->session->position, 9);

  Param(request, "sequence_position").set_int64_param(-1);
  ExpectError(request, absl::StatusCode::kInvalidArgument, {"sequence_position", "-1", ">= 0"});
  Param(request, "sequence_position")
      .set_uint64_param(uint64_t{std::numeric_limits<int64_t>::max()} + 1);
  ExpectError(request, absl::StatusCode::kInvalidArgument,
              {"sequence_position", "9223372036854775808"});
}

TEST(SessionParametersTest, WrongTypesNameTheParameterAndTheType) {
  struct Case {
    const char* name;
    void (*set)(inference::InferParameter&);
    const char* expected;  // in the message
  };
  const Case cases[] = {
      {"sequence_id", [](inference::InferParameter& p) { p.set_bool_param(true); },
       "got bool_param"},
      {"sequence_id", [](inference::InferParameter& p) { p.set_double_param(1.0); },
       "got double_param"},
      {"sequence_id", [](inference::InferParameter& p) { p.Clear(); }, "got no value"},
      {"sequence_start", [](inference::InferParameter& p) { p.set_int64_param(1); },
       "must be a bool_param; got int64_param"},
      {"sequence_end", [](inference::InferParameter& p) { p.set_string_param("true"); },
       "must be a bool_param; got string_param"},
      {"sequence_position", [](inference::InferParameter& p) { p.set_string_param("3"); },
       "got string_param"},
      {"sequence_position", [](inference::InferParameter& p) { p.set_double_param(3.0); },
       "got double_param"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelInferRequest request = GoodRequest();
    if (std::string(c.name) != "sequence_id") Param(request, "sequence_id").set_int64_param(1);
    c.set(Param(request, c.name));
    ExpectError(request, absl::StatusCode::kInvalidArgument, {c.name, c.expected});
    // A wrong type is a malformed request whether or not sessions are served.
    ExpectError(request, absl::StatusCode::kInvalidArgument, {c.name}, /*sessions=*/false);
  }
  // Without a sequence_id, a wrongly typed flag is still reported as such.
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_start").set_int64_param(0);
  ExpectError(request, absl::StatusCode::kInvalidArgument, {"sequence_start", "bool_param"});
}

TEST(SessionParametersTest, FlagsOrPositionWithoutAnIdAreRefused) {
  for (const char* id_spelling : {"absent", "0", "\"\""}) {
    SCOPED_TRACE(id_spelling);
    const auto with_id = [id_spelling] {
      ModelInferRequest request = GoodRequest();
      if (std::string(id_spelling) == "0") Param(request, "sequence_id").set_int64_param(0);
      if (std::string(id_spelling) == "\"\"") Param(request, "sequence_id").set_string_param("");
      return request;
    };
    ModelInferRequest start = with_id();
    Param(start, "sequence_start").set_bool_param(true);
    ExpectError(start, absl::StatusCode::kInvalidArgument, {"'sequence_start'", "sequence_id"});
    ModelInferRequest end = with_id();
    Param(end, "sequence_end").set_bool_param(true);
    ExpectError(end, absl::StatusCode::kInvalidArgument, {"'sequence_end'", "sequence_id"});
    ModelInferRequest position = with_id();
    Param(position, "sequence_position").set_int64_param(0);
    ExpectError(position, absl::StatusCode::kInvalidArgument,
                {"'sequence_position'", "sequence_id"});
    // Also on a model without sessions: the request is malformed either way.
    ExpectError(position, absl::StatusCode::kInvalidArgument, {"'sequence_position'"},
                /*sessions=*/false);
  }
}

TEST(SessionParametersTest, ModelWithoutSessionsRefusesSessionRequests) {
  ModelInferRequest request = GoodRequest();
  Param(request, "sequence_id").set_string_param("chat-7");
  Param(request, "sequence_start").set_bool_param(true);
  ExpectError(request, absl::StatusCode::kFailedPrecondition,
              {"\"chat-7\"", "'demo'", "cpu backend", "no KV cache", "without sequence parameters"},
              /*sessions=*/false);
  EXPECT_EQ(CheckSessionsServed(Model(false), SessionId(3)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(CheckSessionsServed(Model(true), SessionId(3)).ok());
}

TEST(SessionParametersTest, ErrorOrder) {
  // A malformed tensor is reported before the sequence parameters...
  ModelInferRequest bad_tensor = GoodRequest();
  bad_tensor.mutable_inputs(0)->set_name("x");
  Param(bad_tensor, "sequence_id").set_bool_param(true);
  ExpectError(bad_tensor, absl::StatusCode::kInvalidArgument, {"'x'"});
  // ... and a malformed request (timeout included) before sessions not served.
  ModelInferRequest bad_timeout = GoodRequest();
  Param(bad_timeout, "sequence_id").set_int64_param(1);
  Param(bad_timeout, "timeout").set_int64_param(-1);
  ExpectError(bad_timeout, absl::StatusCode::kInvalidArgument, {"timeout"}, /*sessions=*/false);
}

}  // namespace
}  // namespace layerserve
