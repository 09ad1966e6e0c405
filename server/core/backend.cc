// Packing of a batch's sequences into one activation (see backend.h).
#include "server/core/backend.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace layerserve {

void Batch::Pack() {
  cu_seqlens.clear();
  cu_seqlens.push_back(0);
  kv.clear();
  has_sessions = false;
  int64_t offset = 0;
  for (const auto& request : requests) {
    const bool session = request->session.has_value();
    has_sessions = has_sessions || session;
    for (int64_t b = 0; b < request->batch; ++b) {
      offset += request->piece_tokens();
      cu_seqlens.push_back(static_cast<int32_t>(offset));
      SequenceKv& seq = kv.emplace_back();
      if (session && static_cast<size_t>(b) < request->step.block_tables.size()) {
        seq.position = request->step.position;
        seq.block_table = &request->step.block_tables[static_cast<size_t>(b)];
      }
    }
  }
  total_tokens = offset;
}

namespace {

// A session step's block tables against the pool (see Batch::Validate).
absl::Status ValidateStep(const InferRequest& request, const KvCacheShape& kv_cache) {
  if (kv_cache.num_blocks <= 0 || kv_cache.block_tokens <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request '", request.id, "' is a session step, but the backend keeps no KV cache"));
  }
  const SessionStep& step = request.step;
  if (step.position < 0 || step.tokens != request.piece_tokens() ||
      step.block_tokens != kv_cache.block_tokens ||
      step.block_tables.size() != static_cast<size_t>(request.batch)) {
    return absl::InternalError(
        absl::StrCat("request '", request.id, "': its session step does not match its shape"));
  }
  const int64_t blocks =
      BlocksForTokens(step.position + request.piece_tokens(), kv_cache.block_tokens);
  for (const std::vector<KvBlockId>& table : step.block_tables) {
    if (static_cast<int64_t>(table.size()) != blocks) {
      return absl::InternalError(absl::StrCat("request '", request.id, "': a block table has ",
                                              table.size(), " blocks for ", blocks, " needed"));
    }
    for (const KvBlockId id : table) {
      if (id < 0 || id >= kv_cache.num_blocks) {
        return absl::InternalError(absl::StrCat("request '", request.id, "': KV block ", id,
                                                " is outside the pool of ", kv_cache.num_blocks));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Batch::Validate(int64_t hidden_size, int64_t max_tokens,
                             const KvCacheShape& kv_cache) const {
  std::vector<int32_t> expected = {0};
  int64_t tokens = 0;
  for (const auto& request : requests) {
    if (request->batch < 0 || request->seq_len < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request '", request->id, "' has a negative shape"));
    }
    // Only a session's request may be computed in pieces: a stateless one
    // would lose the context of its earlier pieces.
    if (request->chunk_begin < 0 || request->chunk_tokens < 0 ||
        request->chunk_begin + request->piece_tokens() > request->seq_len ||
        (!request->session && request->piece_tokens() != request->seq_len)) {
      return absl::InternalError(absl::StrCat("request '", request->id, "': piece [",
                                              request->chunk_begin, ", +", request->chunk_tokens,
                                              ") of its ", request->seq_len, " tokens"));
    }
    if (request->hidden != hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat("request '", request->id, "' has hidden ",
                                                     request->hidden, ", model has ", hidden_size));
    }
    if (request->session) LS_RETURN_IF_ERROR(ValidateStep(*request, kv_cache));
    const size_t bytes = request->num_elements() * DTypeSize(request->dtype);
    if (request->input.size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("request '", request->id, "' input is ",
                                                     request->input.size(), " bytes, shape needs ",
                                                     bytes));
    }
    tokens += request->batch_tokens();
    if (tokens > max_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch exceeds the backend's max_batch_tokens (", max_tokens, ")"));
    }
    for (int64_t b = 0; b < request->batch; ++b) {
      expected.push_back(static_cast<int32_t>(expected.back() + request->piece_tokens()));
    }
  }
  if (cu_seqlens != expected || total_tokens != expected.back()) {
    return absl::InternalError("batch cu_seqlens/total_tokens do not match its requests");
  }
  // kv must be what Pack() made of these requests: a backend writes each
  // sequence's new K/V through its entry's block table.
  size_t s = 0;
  bool any_session = false;
  for (const auto& request : requests) {
    any_session = any_session || request->session.has_value();
    for (int64_t b = 0; b < request->batch; ++b, ++s) {
      SequenceKv want;
      if (request->session) {
        want = {request->step.position, &request->step.block_tables[static_cast<size_t>(b)]};
      }
      if (s >= kv.size() || kv[s].position != want.position ||
          kv[s].block_table != want.block_table) {
        return absl::InternalError("batch kv entries do not match its requests");
      }
    }
  }
  if (s != kv.size() || has_sessions != any_session) {
    return absl::InternalError("batch kv entries do not match its requests");
  }
  return absl::OkStatus();
}

}  // namespace layerserve
