// CUDA graphs for small batches: a stream captures the launches of a batch's
// Forward (layer_executor.h) once and replays them for later batches of the
// same key, instead of enqueueing each layer's eight to ten kernels one at a
// time. The gaps between kernels shrink (the work is submitted as one
// graph) and the stream's thread spends one launch per batch, not ~40.
//
// What a capture bakes in, besides pointers, is the batch's key
// (ForwardGraphKey): the token and sequence counts that size the grids and
// pick the GEMM routes, the attention path, and the paged plan's counts. The
// pointers are the stream's own: its activation arena (with the positions
// and cu_seqlens in arena.meta), its KV staging (starts, block tables, the
// plan), its split and cuBLASLt workspaces, and the KV pool. Each batch
// refills them before its launch, so one graph serves any sessions and any
// inputs of its key; the graphs belong to their stream.
//
// A key's life on one stream: its first batch launches directly, which also
// loads what the runtime loads lazily (kernel modules, cuBLASLt's plans) and
// must not load inside a capture; the second launches directly too, and once
// the rest of that batch is enqueued, its launches are captured a second
// time (recorded, not run) and instantiated while the device computes the
// batch; the later ones replay. A capture thus costs host time the stream's
// thread would otherwise spend waiting for its batch, not time before the
// device can start (it cost a batch up to ~1 ms of a 4-layer span there
// before, with a capture in a fifth of the batches of 256 unary sessions).
// A stream keeps its `capacity` most recently used keys. Should a capture
// fail, the stream logs why and launches every batch directly from then on.
// The backend sends here only the batches UseForwardGraph admits: up to
// --cuda-graph-max-tokens tokens, not timed per op, onto an idle device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "base/lru_cache.h"
#include "server/cuda/layer_executor.h"

namespace layerserve::cuda {

// What a captured Forward depends on besides the stream's fixed pointers.
struct ForwardGraphKey {
  int64_t tokens = 0;
  int num_seqs = 0;
  int max_seqlen = 0;     // flash attention's grid
  bool sessions = false;  // RoPE writes the KV cache
  bool paged = false;     // attention over cached keys
  int items = 0;          // the paged plan's work items
  int combines = 0;       // and combine tasks

  friend bool operator==(const ForwardGraphKey&, const ForwardGraphKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ForwardGraphKey& k) {
    return H::combine(std::move(h), k.tokens, k.num_seqs, k.max_seqlen, k.sessions, k.paged,
                      k.items, k.combines);
  }
};

ForwardGraphKey GraphKeyOf(const BatchGeometry& batch);

// A paged plan's item (or combine task) count rounded up so that nearby
// plans share a key: to a multiple of a quarter of its largest power of two,
// so at most a fifth of the padded work is idle. 0..4 stay, 17 -> 20,
// 33 -> 40, 64 -> 64, 66 -> 80. A one-sequence decode step's plan changes
// as its context grows; rounded, it takes a few keys rather than dozens.
int64_t GraphPlanCount(int64_t n);

// Whether a batch of `tokens` tokens runs through its graph: small enough
// (`max_tokens`, --cuda-graph-max-tokens), not timed per op (the per-op
// events belong to direct launches), and launched while no other batch of
// the backend computes. A graph saves the host's launch path, which matters
// only when the device waits for it: behind a running batch the host
// enqueues a direct launch well before the device gets to it, and a
// capture there only costs host time. Design record 0004.
bool UseForwardGraph(int64_t tokens, int64_t max_tokens, bool timed, int other_batches_running);

// How a batch's layers were launched: directly; directly, then captured for
// the key's later batches; or by replaying the key's graph.
enum class GraphLaunch { kDirect, kCaptured, kReplayed };
std::string_view GraphLaunchName(GraphLaunch launch);  // "direct", "captured", "replayed"

// One stream's graphs. Used by that stream's thread only.
class ForwardGraphs {
 public:
  explicit ForwardGraphs(size_t capacity) : graphs_(capacity) {}

  // Enqueues a batch of `key` on `stream`: `forward`'s launches, directly or
  // by replaying the key's graph, then `rest` (the batch's work after its
  // layers: output copies, its completion event), then, on the key's second
  // batch, the capture of `forward` for the batches after it. `forward` must
  // enqueue the same launches for every batch of a key, on `stream` only,
  // and must not synchronize. Errors of `forward` and `rest` come back as
  // they are; a failed capture is not the batch's failure (the stream
  // launches directly from then on).
  absl::StatusOr<GraphLaunch> Run(const ForwardGraphKey& key, cudaStream_t stream,
                                  absl::FunctionRef<absl::Status()> forward,
                                  absl::FunctionRef<absl::Status()> rest);

  size_t size() const { return graphs_.size(); }

 private:
  // An empty exec: a key seen once, not captured yet.
  LruCache<ForwardGraphKey, CudaGraphExec> graphs_;
  bool disabled_ = false;  // a capture failed
};

}  // namespace layerserve::cuda
