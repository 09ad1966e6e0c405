// ModelInfer request validation (see validation.h). Every message names the
// field at fault, because that is what a client developer reads first. Names,
// datatypes and shapes come from the client and are echoed only in part
// (base/echo.h): a status message must stay far below a client's metadata
// limit, or the client sees RESOURCE_EXHAUSTED instead of this error.
#include "server/core/validation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/echo.h"
#include "base/status_macros.h"

namespace layerserve {
namespace {

// Dimensions of a shape an error message lists before eliding the rest.
constexpr size_t kMaxEchoedDims = 8;

absl::Status Invalid(std::string_view input, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("input '", EchoForMessage(input), "': ", ToAbsl(what)));
}

// "[2, 3, 512]", or the first dimensions and a count of the others.
std::string ShapeText(const std::vector<int64_t>& shape) {
  const size_t shown = std::min(shape.size(), kMaxEchoedDims);
  std::string text = absl::StrCat(
      "[", absl::StrJoin(shape.begin(), shape.begin() + static_cast<ptrdiff_t>(shown), ", "));
  if (shown < shape.size()) {
    absl::StrAppend(&text, ", \xE2\x80\xA6(", shape.size() - shown, " more dimensions)");
  }
  absl::StrAppend(&text, "]");
  return text;
}

}  // namespace

absl::StatusOr<ValidatedInput> ValidateRequest(const RequestDescription& request,
                                               const ModelLimits& limits) {
  for (const std::string_view out : request.requested_outputs) {
    if (out != kOutputName) {
      return absl::InvalidArgumentError(absl::StrCat("requested output '", EchoForMessage(out),
                                                     "' does not exist; the model has one output '",
                                                     ToAbsl(kOutputName), "'"));
    }
  }
  if (request.inputs.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected exactly one input '",
                                                   ToAbsl(kInputName), "', got ",
                                                   request.inputs.size(), " inputs"));
  }
  const InputDescription& in = request.inputs[0];
  if (in.name != kInputName) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected input '", EchoForMessage(in.name),
                                                   "'; the model takes one input '",
                                                   ToAbsl(kInputName), "'"));
  }
  const std::optional<DType> dtype = ParseProtocolDType(in.datatype);
  if (!dtype) {
    return Invalid(in.name, absl::StrCat("unsupported datatype '", EchoForMessage(in.datatype),
                                         "' (expected BF16, FP16 or FP32)"));
  }
  if (in.shape.size() != 3) {
    return Invalid(in.name,
                   absl::StrCat("shape ", ShapeText(in.shape), " has rank ", in.shape.size(),
                                "; expected rank 3: [batch, tokens, hidden]"));
  }
  static constexpr std::string_view kDimNames[3] = {"batch", "tokens", "hidden"};
  for (size_t i = 0; i < 3; ++i) {
    if (in.shape[i] <= 0) {
      return Invalid(in.name, absl::StrCat("shape dimension ", i, " (", ToAbsl(kDimNames[i]),
                                           ") is ", in.shape[i], "; every dimension must be >= 1"));
    }
  }
  const int64_t batch = in.shape[0], seq_len = in.shape[1], hidden = in.shape[2];
  if (hidden != limits.hidden_size) {
    return Invalid(in.name, absl::StrCat("shape dimension 2 (hidden) is ", hidden,
                                         ", but the model's hidden size is ", limits.hidden_size));
  }
  // B*T*hidden*element_size, with overflow checked at every step: shapes come
  // straight from the client.
  int64_t tokens = 0;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(batch, seq_len, &tokens) ||
      __builtin_mul_overflow(tokens, hidden, &bytes) ||
      __builtin_mul_overflow(bytes, static_cast<int64_t>(DTypeSize(*dtype)), &bytes)) {
    return Invalid(
        in.name, absl::StrCat("shape ", ShapeText(in.shape), " overflows a 64-bit element count"));
  }
  if (tokens > limits.max_tokens_per_request) {
    return Invalid(in.name, absl::StrCat(tokens, " tokens (batch ", batch, " x ", seq_len,
                                         ") exceed the per-request limit of ",
                                         limits.max_tokens_per_request, " (--max-batch-tokens)"));
  }
  if (in.has_typed_contents) {
    return Invalid(in.name,
                   "tensor data in typed 'contents' fields is not supported; send it in "
                   "raw_input_contents");
  }
  if (request.raw_sizes.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("raw_input_contents has ",
                                                   request.raw_sizes.size(),
                                                   " entries; expected 1 (one per input)"));
  }
  if (request.raw_sizes[0] != static_cast<size_t>(bytes)) {
    return Invalid(in.name, absl::StrCat("raw_input_contents[0] holds ", request.raw_sizes[0],
                                         " bytes; shape ", ShapeText(in.shape), " of ",
                                         ToAbsl(in.datatype), " needs ", bytes));
  }
  return ValidatedInput{*dtype, batch, seq_len, hidden, static_cast<size_t>(bytes)};
}

}  // namespace layerserve
