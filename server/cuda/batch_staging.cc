#include "server/cuda/batch_staging.h"

#include <algorithm>
#include <cstring>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"

namespace layerserve::cuda {
namespace {

// Below this many bytes moved per batch, a stream copies on its own thread:
// for a few 16 KiB rows, waking the pool costs more than it saves; from a
// few hundred KiB the pool unpacks faster. Design record 0002.
constexpr size_t kParallelCopyBytes = size_t{256} << 10;

// Runs copy(i) for every request of the batch: on the stream's copy pool
// when the batch moves at least kParallelCopyBytes (a 128-token FP32
// request of Llama-3-8B is 2 MiB each way), else inline, where waking the
// pool would cost more. Design record 0002.
void ForEachRequest(StreamSlot& slot, const Batch& batch, size_t io_bytes,
                    absl::FunctionRef<void(size_t)> copy) {
  const auto n = static_cast<int64_t>(batch.requests.size());
  if (io_bytes < kParallelCopyBytes) {
    for (int64_t i = 0; i < n; ++i) copy(static_cast<size_t>(i));
    return;
  }
  slot.copy_pool->ParallelFor(n, [&](int64_t i) { copy(static_cast<size_t>(i)); });
}

}  // namespace

size_t BatchStaging::PieceBytes(const InferRequest& request) {
  return static_cast<size_t>(request.piece_tokens() * request.hidden) * DTypeSize(request.dtype);
}

size_t BatchStaging::meta_bytes() const {
  return (static_cast<size_t>(geometry_.tokens) + geometry_.num_seqs + 1) * sizeof(int32_t);
}

absl::StatusOr<BatchStaging> BatchStaging::Pack(StreamSlot& slot, Batch& batch,
                                                int64_t max_batch_tokens) {
  const int64_t tokens = batch.total_tokens;
  const int num_seqs = static_cast<int>(batch.cu_seqlens.size()) - 1;
  // The metadata holds tokens + num_seqs + 1 values in room for
  // 2 max_tokens + 1 (frontends send no empty sequences; a direct caller
  // might).
  if (num_seqs > max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: a batch of ", num_seqs,
                                                   " sequences, more than max_batch_tokens (",
                                                   max_batch_tokens, ")"));
  }
  // Positions are int32 on the device.
  for (int s = 0; s < num_seqs; ++s) {
    const int64_t reach = batch.kv[s].position + batch.cu_seqlens[s + 1] - batch.cu_seqlens[s];
    if (reach > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: a sequence reaches position ",
                                                     reach, ", past the int32 positions"));
    }
  }

  BatchStaging staging;
  staging.offsets_.reserve(batch.requests.size());
  for (const auto& request : batch.requests) {
    staging.offsets_.push_back(staging.io_bytes_);
    staging.io_bytes_ += static_cast<size_t>(request->batch) * PieceBytes(*request);
  }
  ForEachRequest(slot, batch, staging.io_bytes_, [&](size_t i) {
    const InferRequest& request = *batch.requests[i];
    const size_t element = DTypeSize(request.dtype);
    const size_t piece = PieceBytes(request);
    for (int64_t b = 0; b < request.batch; ++b) {
      std::memcpy(slot.io_host.data() + staging.offsets_[i] + static_cast<size_t>(b) * piece,
                  request.input.data() + request.piece_offset(b) * element, piece);
    }
  });
  auto* meta = reinterpret_cast<int32_t*>(slot.meta_host.data());
  int max_seqlen = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int32_t begin = batch.cu_seqlens[s];
    const int32_t len = batch.cu_seqlens[s + 1] - begin;
    const auto start = static_cast<int32_t>(batch.kv[s].position);  // 0: stateless
    max_seqlen = std::max(max_seqlen, len);
    for (int32_t i = 0; i < len; ++i) meta[begin + i] = start + i;
  }
  std::memcpy(meta + tokens, batch.cu_seqlens.data(), batch.cu_seqlens.size() * sizeof(int32_t));
  BatchGeometry& geometry = staging.geometry_;
  geometry.tokens = tokens;
  geometry.num_seqs = num_seqs;
  geometry.max_seqlen = max_seqlen;
  geometry.positions = slot.arena.meta;
  geometry.cu_seqlens = slot.arena.meta + tokens;
  return staging;
}

void BatchStaging::Unpack(StreamSlot& slot, Batch& batch) const {
  ForEachRequest(slot, batch, io_bytes_, [&](size_t i) {
    InferRequest& request = *batch.requests[i];
    const size_t element = DTypeSize(request.dtype);
    const size_t piece = PieceBytes(request);
    request.output.resize(request.input.size());  // once: later pieces keep earlier rows
    for (int64_t b = 0; b < request.batch; ++b) {
      std::memcpy(request.output.data() + request.piece_offset(b) * element,
                  slot.io_host.data() + offsets_[i] + static_cast<size_t>(b) * piece, piece);
    }
  });
  if (slot.arena.expert_tokens != nullptr) {
    const auto* counts = reinterpret_cast<const int32_t*>(slot.expert_tokens_host.data());
    batch.expert_tokens.assign(counts, counts + slot.expert_tokens_host.bytes() / sizeof(int32_t));
  }
}

}  // namespace layerserve::cuda
