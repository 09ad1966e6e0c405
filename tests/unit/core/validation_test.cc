// The table of every malformed ModelInfer a client can send, with the code and
// the field its error message must name.
#include "server/core/validation.h"

#include <gtest/gtest.h>

#include <limits>

namespace layerserve {
namespace {

const ModelLimits kLimits{.hidden_size = 512, .max_tokens_per_request = 1024};

RequestDescription Good(std::string_view datatype = "FP32",
                        std::vector<int64_t> shape = {2, 3, 512}) {
  RequestDescription r;
  InputDescription in;
  in.name = "hidden_states";
  in.datatype = datatype;
  in.shape = shape;
  r.inputs.push_back(in);
  size_t elements = 1;
  for (int64_t d : shape) elements *= static_cast<size_t>(d);
  const size_t esize = datatype == "FP32" ? 4 : 2;
  r.raw_sizes.push_back(elements * esize);
  return r;
}

TEST(ValidationTest, AcceptsEachDatatype) {
  for (std::string_view dt : {"FP32", "FP16", "BF16"}) {
    auto v = ValidateRequest(Good(dt), kLimits);
    ASSERT_TRUE(v.ok()) << dt << ": " << v.status();
    EXPECT_EQ(v->batch, 2);
    EXPECT_EQ(v->seq_len, 3);
    EXPECT_EQ(v->hidden, 512);
    EXPECT_EQ(v->byte_size, 2u * 3 * 512 * (dt == "FP32" ? 4 : 2));
  }
}

TEST(ValidationTest, AcceptsRequestAtTokenLimitAndNamedOutput) {
  RequestDescription r = Good("BF16", {4, 256, 512});
  r.requested_outputs = {"hidden_states"};
  EXPECT_TRUE(ValidateRequest(r, kLimits).ok());
}

struct BadCase {
  std::string label;
  RequestDescription request;
  std::string must_mention;  // substring of the error message
};

std::vector<BadCase> BadCases() {
  std::vector<BadCase> cases;
  {
    RequestDescription r = Good();
    r.inputs[0].name = "input_ids";
    cases.push_back({"wrong input name", r, "'input_ids'"});
  }
  {
    RequestDescription r = Good();
    r.inputs.push_back(r.inputs[0]);
    r.raw_sizes.push_back(r.raw_sizes[0]);
    cases.push_back({"two inputs", r, "2 inputs"});
  }
  {
    RequestDescription r = Good();
    r.inputs.clear();
    r.raw_sizes.clear();
    cases.push_back({"no input", r, "0 inputs"});
  }
  cases.push_back({"INT32 datatype", Good("INT32"), "datatype 'INT32'"});
  cases.push_back({"unknown datatype", Good("FOO"), "datatype 'FOO'"});
  cases.push_back({"empty datatype", Good(""), "datatype ''"});
  cases.push_back({"rank 2", Good("FP32", {3, 512}), "rank 2"});
  cases.push_back({"rank 4", Good("FP32", {1, 2, 3, 512}), "rank 4"});
  {
    RequestDescription r = Good();
    r.inputs[0].shape = {};
    cases.push_back({"rank 0", r, "rank 0"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].shape = {0, 3, 512};
    cases.push_back({"zero batch", r, "dimension 0 (batch) is 0"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].shape = {1, -1, 512};
    cases.push_back({"negative tokens", r, "dimension 1 (tokens) is -1"});
  }
  cases.push_back({"wrong hidden", Good("FP32", {1, 3, 256}), "hidden size is 512"});
  {
    RequestDescription r = Good();
    const int64_t big = std::numeric_limits<int64_t>::max() / 2;
    r.inputs[0].shape = {big, big, 512};
    cases.push_back({"overflowing shape", r, "overflows"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].shape = {1, int64_t{1} << 53, 512};
    cases.push_back({"overflow in bytes", r, "overflows"});
  }
  cases.push_back({"over token limit", Good("FP32", {3, 400, 512}), "per-request limit of 1024"});
  {
    RequestDescription r = Good();
    r.raw_sizes[0] -= 4;
    cases.push_back({"short raw bytes", r, "raw_input_contents[0] holds"});
  }
  {
    RequestDescription r = Good();
    r.raw_sizes[0] += 1;
    cases.push_back({"long raw bytes", r, "raw_input_contents[0] holds"});
  }
  {
    RequestDescription r = Good();
    r.raw_sizes.clear();
    cases.push_back({"no raw contents", r, "raw_input_contents has 0 entries"});
  }
  {
    RequestDescription r = Good();
    r.raw_sizes.push_back(4);
    cases.push_back({"extra raw contents", r, "raw_input_contents has 2 entries"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].has_typed_contents = true;
    r.raw_sizes.clear();
    cases.push_back({"typed contents", r, "typed 'contents'"});
  }
  {
    RequestDescription r = Good();
    r.requested_outputs = {"logits"};
    cases.push_back({"unknown requested output", r, "output 'logits'"});
  }
  return cases;
}

TEST(ValidationTest, RejectsEveryMalformedRequestNamingTheField) {
  for (const BadCase& c : BadCases()) {
    const auto v = ValidateRequest(c.request, kLimits);
    ASSERT_FALSE(v.ok()) << c.label << " was accepted";
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_NE(v.status().message().find(c.must_mention), std::string_view::npos)
        << c.label << ": message \"" << v.status().message() << "\" does not mention \""
        << c.must_mention << "\"";
  }
}

// Whatever the client sends, the message stays short: it travels in gRPC
// metadata, and past the client's limit (8 KiB) the client would read
// RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT.
TEST(ValidationTest, MessagesEchoAtMostABoundedPartOfTheInput) {
  const std::string huge(1 << 20, 'x');
  std::vector<BadCase> cases;
  {
    RequestDescription r = Good();
    r.inputs[0].name = huge;
    cases.push_back({"huge input name", r, "more bytes)"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].datatype = huge;
    cases.push_back({"huge datatype", r, "more bytes)"});
  }
  {
    RequestDescription r = Good();
    r.requested_outputs = {huge};
    cases.push_back({"huge requested output", r, "more bytes)"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].shape.assign(10000, 7);
    cases.push_back({"rank 10000", r, "rank 10000"});
  }
  {
    RequestDescription r = Good();
    r.inputs[0].shape.assign(10000, 7);
    cases.push_back({"rank 10000 lists a few dimensions", r,
                     "[7, 7, 7, 7, 7, 7, 7, 7, \xE2\x80\xA6(9992 more dimensions)]"});
  }
  {
    RequestDescription r = Good();
    r.raw_sizes[0] += 1;
    cases.push_back({"raw bytes mismatch quotes the datatype", r, "of FP32 needs"});
  }
  for (const BadCase& c : cases) {
    const auto v = ValidateRequest(c.request, kLimits);
    ASSERT_FALSE(v.ok()) << c.label << " was accepted";
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_LT(v.status().message().size(), 512u) << c.label;
    EXPECT_NE(v.status().message().find(c.must_mention), std::string_view::npos)
        << c.label << ": message \"" << v.status().message().substr(0, 300)
        << "\" does not mention \"" << c.must_mention << "\"";
  }
}

}  // namespace
}  // namespace layerserve
