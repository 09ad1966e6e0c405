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
#include "server/core/request.h"

namespace layerserve {

// The longest sequence (T, the tokens of one of a request's B sequences) a
// backend computes exactly for its model, and why; max_tokens 0 means no limit
// beyond the batch budget. Today: the CUDA backend's attention has no sliding
// window, so for a windowed model it serves sequences up to the window, where
// windowed and full-causal attention agree.
struct SequenceLimit {
  int64_t max_tokens = 0;
  std::string reason;
};

struct Batch {
  std::vector<std::unique_ptr<InferRequest>> requests;
  std::vector<int32_t> cu_seqlens;  // num_sequences + 1 offsets, cu_seqlens[0] == 0
  int64_t total_tokens = 0;

  // Fills cu_seqlens and total_tokens from `requests`.
  void Pack();

  // What every backend checks before it computes: each request's hidden size
  // and input byte count match its shape, no shape is negative, the packing
  // matches the requests, the batch fits `max_tokens` and no sequence is
  // longer than `sequence_limit` allows (INVALID_ARGUMENT quoting its reason).
  // The frontend's validation already guarantees all of it; this keeps a
  // backend safe when called directly (tests, benchmarks) or by a buggy
  // caller.
  absl::Status Validate(int64_t hidden_size, int64_t max_tokens,
                        const SequenceLimit& sequence_limit = {}) const;
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

  // The longest sequence this backend computes exactly for its model (see
  // SequenceLimit). The edge refuses longer sequences with INVALID_ARGUMENT
  // quoting the reason, so a backend that lacks some of the model's math past
  // a length never answers with other math.
  virtual SequenceLimit MaxSequence() const { return {}; }

  // OK while the backend can serve. A backend that hits an unrecoverable
  // device error reports it here; readiness and health turn NOT_SERVING.
  virtual absl::Status Health() const { return absl::OkStatus(); }
};

}  // namespace layerserve
