// The interface every compute backend (CPU reference, CUDA) implements.
//
// A Batch packs the sequences of several requests into one activation of
// [total_tokens, hidden] rows: sequence s occupies rows
// [cu_seqlens[s], cu_seqlens[s+1]) and has positions 0..len-1. A request with
// B sequences contributes B consecutive sequences. Backends run every
// projection once over all rows (one GEMM with M = total_tokens) and attention
// per sequence, as variable-length flash attention does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "server/core/kv_blocks.h"
#include "server/core/request.h"

namespace layerserve {

// A backend's paged KV cache as the core hands it out: `num_blocks` blocks of
// `block_tokens` tokens each (kv_blocks.h). num_blocks 0: no cache.
struct KvCacheShape {
  int32_t num_blocks = 0;
  int64_t block_tokens = 0;
};

// Where one packed sequence's new tokens sit, for RoPE, attention and the KV
// cache. A stateless sequence starts at position 0 and has no block table. A
// session's sequence starts at its session's length (after any rollback);
// its block table lists the KV cache blocks of positions 0..position+len-1
// (BlocksForTokens(position + len, block_tokens) ids), and attention reads
// positions 0..position-1 from the cache, then the new tokens.
struct SequenceKv {
  int64_t position = 0;
  const std::vector<KvBlockId>* block_table = nullptr;  // owned by the request's step
};

// How a backend's time on one batch splits (seconds), as Triton's statistics
// split it: moving the requests' tensors in (conversion and packing into the
// backend's own buffers), and moving the outputs back into the requests.
// What is left of the batch's compute time is inference proper (the layers,
// and on the CUDA backend the device copies, which run on the stream). Zero
// where a backend does not measure a part.
struct BatchTimings {
  double input_seconds = 0;
  double output_seconds = 0;
  // How the CUDA backend launched the batch's layers: "direct" (kernel by
  // kernel), "captured" (into a CUDA graph, then launched) or "replayed" (a
  // graph captured before); empty for a backend without graphs.
  std::string_view launch;
};

struct Batch {
  std::vector<std::unique_ptr<InferRequest>> requests;
  std::vector<int32_t> cu_seqlens;  // num_sequences + 1 offsets, cu_seqlens[0] == 0
  int64_t total_tokens = 0;
  // One entry per sequence, in cu_seqlens order.
  std::vector<SequenceKv> kv;
  bool has_sessions = false;  // any request is a session step
  BatchTimings timings;       // filled by the backend as it computes
  // A mixture-of-experts span's routing, filled by the backend as it
  // computes: tokens sent to each expert, [layer * experts + expert] with
  // the layer counted from the span's first; empty for a dense span.
  std::vector<int64_t> expert_tokens;

  // Fills cu_seqlens, total_tokens, kv and has_sessions from `requests`.
  void Pack();

  // What every backend checks before it computes: each request's hidden size
  // and input byte count match its shape, no shape is negative, the packing
  // matches the requests, the batch fits `max_tokens`, and every session
  // step's block tables fit `kv_cache` (one table per sequence, each
  // covering position + T tokens with ids inside the pool; a session request
  // to a backend without a cache is FAILED_PRECONDITION). The frontend's
  // validation and the session table already guarantee all of it; this keeps
  // a backend safe when called directly (tests, benchmarks) or by a buggy
  // caller.
  absl::Status Validate(int64_t hidden_size, int64_t max_tokens,
                        const KvCacheShape& kv_cache = {}) const;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view Name() const = 0;

  // What computes, for the build-info metric: the GPU's name for the CUDA
  // backend, the backend's name otherwise.
  virtual std::string Device() const { return std::string(Name()); }

  // How many batches may be in flight at once (CPU: 1; CUDA: one per stream).
  // The batcher forms a batch only when a slot is free, so requests keep
  // accumulating (and batching) while the backend is busy.
  virtual int MaxInflightBatches() const = 0;

  // Runs the layer span over `batch`: reads each request's `input` and fills
  // its `output` (same dtype, same layout). Returns at once; calls `done`
  // exactly once, on any thread, when the outputs are written or the batch
  // failed. Must not block the caller on compute.
  virtual void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) = 0;

  // The paged KV cache that sessions keep their keys and values in
  // (docs/sessions.md). A backend that has one reports what a block of `block_tokens`
  // tokens costs (K and V of every layer of its span, in bytes) and how much
  // memory a pool could take (what --kv-cache-memory's fraction is of), and
  // allocates its pool once, before serving. The core then hands out block
  // ids 0..num_blocks-1 through its session table and passes each step's
  // block tables in the Batch (SequenceKv). KvBlockBytes 0: no cache, and
  // the edge refuses session requests.
  virtual int64_t KvBlockBytes(int64_t /*block_tokens*/) const { return 0; }
  virtual int64_t KvMemoryAvailable() const { return 0; }
  virtual absl::Status AllocateKvCache(const KvCacheShape& /*shape*/) {
    return absl::UnimplementedError(std::string(Name()) + " backend keeps no KV cache");
  }

  // OK while the backend can serve. A backend that hits an unrecoverable
  // device error reports it here; readiness and health turn NOT_SERVING.
  virtual absl::Status Health() const { return absl::OkStatus(); }
};

}  // namespace layerserve
