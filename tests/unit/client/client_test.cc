// The request Client::Infer sends: the tensor, and the sequence parameters of
// InferOptions spelled as tritonclient spells them (sequence_id int64_param or
// string_param, sequence_start and sequence_end bool_param) plus
// sequence_position (int64_param).
#include "client/client.h"

#include <gtest/gtest.h>

#include <string>

namespace layerserve::client {
namespace {

const Tensor kInput{"FP32", {1, 2, 4}, std::string(32, '\0')};

const inference::InferParameter* Find(const inference::ModelInferRequest& request,
                                      const std::string& name) {
  const auto it = request.parameters().find(name);
  return it == request.parameters().end() ? nullptr : &it->second;
}

TEST(ClientRequestTest, StatelessRequestCarriesNoParameters) {
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput);
  EXPECT_EQ(request.model_name(), "demo");
  ASSERT_EQ(request.inputs_size(), 1);
  EXPECT_EQ(request.inputs(0).name(), kHiddenStates);
  EXPECT_EQ(request.raw_input_contents_size(), 1);
  EXPECT_TRUE(request.parameters().empty());

  // 0 and "" are "no sequence", as in tritonclient: nothing is sent.
  for (const SequenceId& none : {SequenceId(int64_t{0}), SequenceId(std::string())}) {
    InferOptions options;
    options.sequence_id = none;
    EXPECT_TRUE(IsNoSequence(none));
    EXPECT_TRUE(Client::MakeInferRequest("demo", kInput, options).parameters().empty());
  }
}

TEST(ClientRequestTest, IntegerSequenceAsTritonclientSendsIt) {
  InferOptions options;
  options.sequence_id = int64_t{42};
  options.sequence_start = true;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  const inference::InferParameter* id = Find(request, "sequence_id");
  ASSERT_NE(id, nullptr);
  EXPECT_EQ(id->parameter_choice_case(), inference::InferParameter::kInt64Param);
  EXPECT_EQ(id->int64_param(), 42);
  // Both flags, even a false one, as tritonclient does for a sequence.
  ASSERT_NE(Find(request, "sequence_start"), nullptr);
  EXPECT_EQ(Find(request, "sequence_start")->parameter_choice_case(),
            inference::InferParameter::kBoolParam);
  EXPECT_TRUE(Find(request, "sequence_start")->bool_param());
  ASSERT_NE(Find(request, "sequence_end"), nullptr);
  EXPECT_FALSE(Find(request, "sequence_end")->bool_param());
  EXPECT_EQ(Find(request, "sequence_position"), nullptr);
}

TEST(ClientRequestTest, StringSequenceWithEndAndPosition) {
  InferOptions options;
  options.sequence_id = std::string("chat-7");
  options.sequence_end = true;
  options.sequence_position = 17;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  EXPECT_FALSE(IsNoSequence(options.sequence_id));
  ASSERT_NE(Find(request, "sequence_id"), nullptr);
  EXPECT_EQ(Find(request, "sequence_id")->parameter_choice_case(),
            inference::InferParameter::kStringParam);
  EXPECT_EQ(Find(request, "sequence_id")->string_param(), "chat-7");
  EXPECT_FALSE(Find(request, "sequence_start")->bool_param());
  EXPECT_TRUE(Find(request, "sequence_end")->bool_param());
  ASSERT_NE(Find(request, "sequence_position"), nullptr);
  EXPECT_EQ(Find(request, "sequence_position")->parameter_choice_case(),
            inference::InferParameter::kInt64Param);
  EXPECT_EQ(Find(request, "sequence_position")->int64_param(), 17);
}

TEST(ClientRequestTest, FlagsWithoutAnIdAreSentForTheServerToRefuse) {
  // tritonclient drops them silently; this client sends them, and the server
  // answers INVALID_ARGUMENT instead of computing a stateless request.
  InferOptions options;
  options.sequence_start = true;
  options.sequence_position = 0;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  EXPECT_EQ(Find(request, "sequence_id"), nullptr);
  ASSERT_NE(Find(request, "sequence_start"), nullptr);
  EXPECT_TRUE(Find(request, "sequence_start")->bool_param());
  EXPECT_EQ(Find(request, "sequence_end"), nullptr) << "false flags are not sent without an id";
  ASSERT_NE(Find(request, "sequence_position"), nullptr);
}

}  // namespace
}  // namespace layerserve::client
