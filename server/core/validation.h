// Validation of a ModelInfer request against the served model, without any
// protobuf types: the gRPC layer copies the few fields it needs into
// InputDescription, so this table-tested function decides every error message
// a client can get for a malformed tensor.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace layerserve {

inline constexpr std::string_view kInputName = "hidden_states";
inline constexpr std::string_view kOutputName = "hidden_states";

struct InputDescription {
  std::string_view name;
  std::string_view datatype;
  std::vector<int64_t> shape;
  bool has_typed_contents = false;  // InferTensorContents set (unsupported)
};

struct RequestDescription {
  std::vector<InputDescription> inputs;
  // Sizes of raw_input_contents entries, one per raw entry sent.
  std::vector<size_t> raw_sizes;
  // Names in the request's `outputs` list (empty: all outputs).
  std::vector<std::string_view> requested_outputs;
};

struct ModelLimits {
  int64_t hidden_size = 0;
  // Largest B*T one request may carry (= --max-batch-tokens: a request must
  // fit in one batch).
  int64_t max_tokens_per_request = 0;
};

struct ValidatedInput {
  DType dtype;
  int64_t batch;
  int64_t seq_len;
  int64_t hidden;
  size_t byte_size;
};

// OK with the parsed shape, or INVALID_ARGUMENT naming the offending field.
absl::StatusOr<ValidatedInput> ValidateRequest(const RequestDescription& request,
                                               const ModelLimits& limits);

}  // namespace layerserve
