// The device side of one batch on its stream, in the order the stream runs
// it:
//   CopyIn    the staging and metadata to the device (with sessions, the KV
//             pool's metadata too, which completes the geometry), then the
//             wire dtype to the activation dtype into the arena's rows
//   Layers    the span's layers (LayerExecutor::Forward)
//   CopyOut   the rows back to the wire dtype, the copies to the host (and a
//             mixture of experts' tokens per expert), the completion event
// Launch runs them, Layers directly or through the stream's CUDA graphs
// (forward_graphs.h), which capture and replay Layers alone.
//
// Requests are packed in order on both sides (batch_staging.h), so each run
// of consecutive requests with one wire dtype is one contiguous range: one
// cast per run, not per request, keeps a batch of many 1-token requests from
// paying a launch for each. Where every request's wire dtype is the
// activation dtype, the staging goes to the rows and comes back from them
// as it is: no cast, no device-side copy.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "server/core/backend.h"
#include "server/cuda/batch_staging.h"
#include "server/cuda/kv_pool.h"
#include "server/cuda/layer_executor.h"
#include "server/cuda/stream_slot.h"

namespace layerserve::cuda {

class BatchLaunch {
 public:
  // `kv_pool`: null until the backend has one (a batch with sessions needs
  // it). `timed`: the layers record the op timer's events (not graphed).
  BatchLaunch(StreamSlot& slot, const Batch& batch, const BatchStaging& staging,
              const LayerExecutor& executor, KvPool* kv_pool, bool timed);

  // Enqueues the whole batch on the slot's stream; its layers through the
  // stream's graphs when `graph`. Returns how they were launched
  // (GraphLaunchName). The batch is done once the slot's event is.
  absl::StatusOr<std::string_view> Launch(bool graph);

 private:
  absl::Status CopyIn(bool graph);
  absl::Status Layers() const;
  absl::Status CopyOut();
  // Casts every run of requests of one wire dtype between its staging and
  // its rows: to the activation dtype, or back.
  absl::Status Convert(bool to_activation) const;

  StreamSlot& slot_;
  const Batch& batch_;
  const BatchStaging& staging_;
  const LayerExecutor& executor_;
  KvPool* const kv_pool_;
  const bool timed_;
  // Every request's wire dtype is the activation dtype.
  const bool wire_is_activation_;
  BatchGeometry geometry_;
};

}  // namespace layerserve::cuda
