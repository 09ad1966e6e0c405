// Packing of a batch's sequences into one activation (see backend.h).
#include "server/core/backend.h"

#include "absl/strings/str_cat.h"

namespace layerserve {

void Batch::Pack() {
  cu_seqlens.clear();
  cu_seqlens.push_back(0);
  int64_t offset = 0;
  for (const auto& request : requests) {
    for (int64_t b = 0; b < request->batch; ++b) {
      offset += request->seq_len;
      cu_seqlens.push_back(static_cast<int32_t>(offset));
    }
  }
  total_tokens = offset;
}

absl::Status Batch::Validate(int64_t hidden_size, int64_t max_tokens,
                             const SequenceLimit& sequence_limit) const {
  std::vector<int32_t> expected = {0};
  int64_t tokens = 0;
  for (const auto& request : requests) {
    if (request->batch < 0 || request->seq_len < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request '", request->id, "' has a negative shape"));
    }
    if (request->hidden != hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat("request '", request->id, "' has hidden ",
                                                     request->hidden, ", model has ", hidden_size));
    }
    if (sequence_limit.max_tokens > 0 && request->seq_len > sequence_limit.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request '", request->id, "' has sequences of ", request->seq_len, " tokens, more than ",
          sequence_limit.max_tokens, ": ", sequence_limit.reason));
    }
    const size_t bytes = request->num_elements() * DTypeSize(request->dtype);
    if (request->input.size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("request '", request->id, "' input is ",
                                                     request->input.size(), " bytes, shape needs ",
                                                     bytes));
    }
    tokens += request->tokens();
    if (tokens > max_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch exceeds the backend's max_batch_tokens (", max_tokens, ")"));
    }
    for (int64_t b = 0; b < request->batch; ++b) {
      expected.push_back(static_cast<int32_t>(expected.back() + request->seq_len));
    }
  }
  if (cu_seqlens != expected || total_tokens != expected.back()) {
    return absl::InternalError("batch cu_seqlens/total_tokens do not match its requests");
  }
  return absl::OkStatus();
}

}  // namespace layerserve
