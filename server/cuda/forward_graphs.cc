// CUDA graphs for small batches (see forward_graphs.h).
#include "server/cuda/forward_graphs.h"

#include <bit>

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace layerserve::cuda {

ForwardGraphKey GraphKeyOf(const BatchGeometry& batch) {
  return {.tokens = batch.tokens,
          .num_seqs = batch.num_seqs,
          .max_seqlen = batch.max_seqlen,
          .sessions = batch.kv_pool != nullptr,
          .paged = batch.kv_pool != nullptr && batch.kv_history,
          .items = batch.num_paged_items,
          .combines = batch.num_paged_combines};
}

int64_t GraphPlanCount(int64_t n) {
  if (n <= 4) return n;
  const int64_t step = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(n))) / 4;
  return (n + step - 1) / step * step;
}

bool UseForwardGraph(int64_t tokens, int64_t max_tokens, bool timed, int other_batches_running) {
  return tokens <= max_tokens && !timed && other_batches_running == 0;
}

std::string_view GraphLaunchName(GraphLaunch launch) {
  switch (launch) {
    case GraphLaunch::kDirect:
      return "direct";
    case GraphLaunch::kCaptured:
      return "captured";
    case GraphLaunch::kReplayed:
      return "replayed";
  }
  return "direct";
}

absl::StatusOr<GraphLaunch> ForwardGraphs::Run(const ForwardGraphKey& key, cudaStream_t stream,
                                               absl::FunctionRef<absl::Status()> forward,
                                               absl::FunctionRef<absl::Status()> rest) {
  CudaGraphExec* graph = disabled_ ? nullptr : graphs_.Find(key);
  if (graph != nullptr && graph->get() != nullptr) {
    LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph->get(), stream));
    LS_RETURN_IF_ERROR(rest());
    return GraphLaunch::kReplayed;
  }
  LS_RETURN_IF_ERROR(forward());
  LS_RETURN_IF_ERROR(rest());
  if (disabled_) return GraphLaunch::kDirect;
  if (graph == nullptr) {
    graphs_.Insert(key, CudaGraphExec());  // seen once: capture at the next sight
    return GraphLaunch::kDirect;
  }
  // The batch is enqueued; the device computes it while this thread records
  // the same launches again. Thread-local: the other streams' threads launch
  // on as usual.
  absl::StatusOr<CudaGraphExec> captured =
      CaptureGraph(stream, cudaStreamCaptureModeThreadLocal, forward);
  if (!captured.ok()) {
    // Nothing of the capture was enqueued: clear its error, keep the batch.
    static_cast<void>(cudaGetLastError());
    disabled_ = true;
    LogWarning(absl::StrCat("cuda backend: capturing a CUDA graph failed (",
                            captured.status().message(),
                            "); this stream launches its batches directly from now on"));
    return GraphLaunch::kDirect;
  }
  *graph = *std::move(captured);
  return GraphLaunch::kCaptured;
}

}  // namespace layerserve::cuda
