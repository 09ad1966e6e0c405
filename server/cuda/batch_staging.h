// The host side of one batch on a stream (stream_slot.h): its requests'
// tensors packed into the slot's pinned staging, and its positions and
// cu_seqlens into the pinned metadata, before the batch launches; its
// outputs unpacked from the same staging after it completes.
//
// Requests go in order, each request's pieces (all of its rows unless it is
// chunked) as one contiguous run in its wire dtype. Inputs and outputs
// share the staging: a request's output has the size and dtype of its
// input, and the stream orders the copy-out after the copy-in. A batch that
// moves at least kParallelCopyBytes copies on the slot's copy pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/backend.h"
#include "server/cuda/layer_executor.h"
#include "server/cuda/stream_slot.h"

namespace layerserve::cuda {

class BatchStaging {
 public:
  // Packs `batch` into `slot`'s pinned staging (INVALID_ARGUMENT where its
  // sequences do not fit the device's metadata: more sequences than
  // max_batch_tokens, a position past int32). The geometry's pointers are
  // the slot arena's, for the layers once the metadata is on the device.
  static absl::StatusOr<BatchStaging> Pack(StreamSlot& slot, Batch& batch,
                                           int64_t max_batch_tokens);

  // Fills each request's output from the slot's pinned staging.
  void Unpack(StreamSlot& slot, Batch& batch) const;

  const BatchGeometry& geometry() const { return geometry_; }
  // Where each request's run starts in the staging, and the bytes of all.
  const std::vector<size_t>& offsets() const { return offsets_; }
  size_t io_bytes() const { return io_bytes_; }
  // Bytes of the metadata (positions, then cu_seqlens).
  size_t meta_bytes() const;

  // Bytes of one of a request's B pieces on the wire (of its whole sequence
  // unless it is chunked).
  static size_t PieceBytes(const InferRequest& request);

 private:
  BatchGeometry geometry_;
  std::vector<size_t> offsets_;
  size_t io_bytes_ = 0;
};

}  // namespace layerserve::cuda
