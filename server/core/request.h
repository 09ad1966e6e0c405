// One inference request as the core sees it: transport-agnostic.
//
// The gRPC layer validates a ModelInfer call, builds an InferRequest whose
// `input` points into the call's request message (which it keeps alive until
// `on_done` runs), and hands it to the Batcher. The core fills `output` and
// the timings, then calls `on_done` exactly once, from the batcher or a
// backend completion thread, never under a lock.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "server/core/clock.h"
#include "server/core/sessions.h"

namespace layerserve {

// A request's session parameters (Triton's sequence batcher spelling,
// docs/sessions.md), as the edge parsed them.
struct SessionParams {
  SessionId id;
  bool start = false;  // sequence_start: open the session, or reset it
  bool end = false;    // sequence_end: free it after this request
  // sequence_position: where the request's first token sits (unset: append).
  std::optional<int64_t> position;
};

struct InferRequest {
  std::string id;             // echoed back; may be empty
  DType dtype = DType::kF32;  // of both input and output
  int64_t batch = 0;          // B: independent sequences
  int64_t seq_len = 0;        // T: tokens per sequence, positions 0..T-1
  int64_t hidden = 0;
  std::string_view input;  // B*T*hidden elements of `dtype`, row-major; not owned

  // Drop the request before compute once this passes (unset: no deadline).
  std::optional<SteadyTime> deadline;
  // Polled before compute; true drops the request with CANCELLED. May be empty.
  std::function<bool()> is_cancelled;

  // Set: the request is one step of a session. Its T tokens continue the
  // session's B sequences (token t sits at position step.position + t), and
  // their keys and values stay in the backend's KV cache for later steps.
  // Unset: stateless, positions 0..T-1, nothing kept.
  std::optional<SessionParams> session;
  // Filled by the batcher when a session request joins a batch (the session
  // table's BeginStep); untouched for stateless requests.
  SessionStep step;
  // Chunked prefill: the batcher computes a session request's T tokens in
  // pieces of at most --prefill-chunk-tokens (B x tokens), each a step of the
  // session in a batch of its own, so that a long prefill shares batches with
  // other sessions' decode steps instead of filling them. The batch that
  // holds the request computes tokens [chunk_begin, chunk_begin + chunk_tokens)
  // of each of its B sequences. chunk_tokens 0: all T (stateless requests).
  int64_t chunk_begin = 0;
  int64_t chunk_tokens = 0;
  // The session's length before the request's first piece (set with it), to
  // roll back to if a later piece fails.
  int64_t chunk_start_position = 0;

  // Filled by the core.
  std::string output;  // same size and layout as `input`
  SteadyTime enqueue_time{};
  double queue_seconds = 0;  // enqueue -> first batch start
  // Batch start -> batch done, the batch's time (shared by its requests);
  // summed over the batches of a request computed in pieces.
  double compute_seconds = 0;
  // From its batch's end (its last piece's) to a reply thread taking the
  // request up: the wait for the reply pool (BatcherOptions::reply_threads).
  double reply_wait_seconds = 0;
  int64_t batch_requests = 0;  // requests in the batch that ran this one

  // Called once with OK (output filled) or the reason the request failed.
  std::function<void(absl::Status)> on_done;

  int64_t tokens() const { return batch * seq_len; }
  size_t num_elements() const { return static_cast<size_t>(batch * seq_len * hidden); }

  // Tokens per sequence, and in all, that the batch holding the request
  // computes (the whole request unless it is chunked).
  int64_t piece_tokens() const { return chunk_tokens > 0 ? chunk_tokens : seq_len; }
  int64_t batch_tokens() const { return batch * piece_tokens(); }
  // Element offset in `input` (and `output`) of sequence b's piece; each
  // piece is piece_tokens() x hidden contiguous elements.
  size_t piece_offset(int64_t b) const {
    return static_cast<size_t>((b * seq_len + chunk_begin) * hidden);
  }
};

}  // namespace layerserve
