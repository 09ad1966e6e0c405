// Per-op device timings of sampled batches: the hook the metrics layer
// implements (KernelTimingSink) and the event recorder the layer executor
// drives (OpTimer).
//
// The backend times one batch in N: on that batch the executor records a CUDA
// event after every op, and once the stream has finished the differences
// between consecutive events are reported, one call per op launch (a span of
// L layers reports "norm" 2L times, the others L times each).
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"

namespace layerserve {

// Receives one device duration per op launch of a sampled batch. Called from
// the backend's stream threads (several at once with several streams), never
// under a backend lock; implementations must be thread-safe and cheap.
class KernelTimingSink {
 public:
  virtual ~KernelTimingSink() = default;
  // `op` is one of the kOp* names below (a string literal: it outlives the call).
  virtual void OnKernelTime(std::string_view op, double seconds) = 0;
};

namespace cuda {

// Op names, as reported to the sink and used as a metric label.
inline constexpr std::string_view kOpNorm = "norm";
inline constexpr std::string_view kOpGemmQkv = "gemm_qkv";
// Rotary embedding; in a batch with sessions also the KV-cache write (one
// kernel), so there "attention" is the attention alone.
inline constexpr std::string_view kOpRope = "rope";
inline constexpr std::string_view kOpAttention = "attention";
inline constexpr std::string_view kOpGemmO = "gemm_o";
// The gate/up projection with its SiLU gate (fused into our GEMMs' epilogue;
// on cuBLASLt a second kernel, timed with it).
inline constexpr std::string_view kOpGemmGateUp = "gemm_gate_up";
inline constexpr std::string_view kOpGemmDown = "gemm_down";
// Mixture-of-experts layers: routing and permutation before the expert
// GEMMs, the weighted combine after them.
inline constexpr std::string_view kOpMoeRoute = "moe_route";
inline constexpr std::string_view kOpMoeCombine = "moe_combine";
// Qwen2-MoE's shared expert: its gate/up, gate and down, timed together.
inline constexpr std::string_view kOpSharedExpert = "shared_expert";
// The most ops one decoder layer marks (a mixture-of-experts layer with a
// shared expert; a dense one marks 8).
inline constexpr int kOpsPerLayer = 11;

// Records an event after each op on one stream. Owned by one stream and used
// by one thread at a time. Reuses its events from batch to batch.
class OpTimer {
 public:
  OpTimer() = default;  // holds no events: Create one to use it
  // `max_ops`: the most Mark calls between two Starts.
  static absl::StatusOr<OpTimer> Create(int max_ops);

  // Begins a timed sequence: records the reference event on `stream`.
  absl::Status Start(cudaStream_t stream);
  // Records the end of `op`, which began where the previous op ended.
  absl::Status Mark(std::string_view op, cudaStream_t stream);
  // After the stream has completed: reports each op's duration to `sink`.
  absl::Status Report(KernelTimingSink* sink);

 private:
  explicit OpTimer(std::vector<CudaEvent> events);

  std::vector<CudaEvent> events_;      // events_[0] = start, events_[i] ends op i - 1
  std::vector<std::string_view> ops_;  // ops marked since Start
};

}  // namespace cuda
}  // namespace layerserve
