// The CUDA backend's paged KV cache (see kv_pool.h).
#include "server/cuda/kv_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/cuda/cuda_status.h"
#include "base/saturating.h"
#include "base/status_macros.h"

namespace layerserve::cuda {
int64_t KvPool::BlockBytes(const LayerShape& shape, int num_layers, int64_t block_tokens) {
  if (block_tokens < 1) return 0;
  const int64_t row_bytes =
      int64_t{shape.num_kv_heads} * shape.head_dim * kernels::DTypeBytes(shape.dtype);
  return SaturatingMul(SaturatingMul(2 * int64_t{num_layers}, block_tokens), row_bytes);
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const LayerShape& shape, int num_layers,
                                                       const KvCacheShape& cache, int num_streams,
                                                       int64_t max_tokens) {
  if (cache.num_blocks < 0 ||
      (cache.num_blocks > 0 && (cache.block_tokens < 1 || cache.block_tokens > INT32_MAX))) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: a KV cache of ", cache.num_blocks,
                                                   " blocks of ", cache.block_tokens,
                                                   " tokens is not a pool"));
  }
  const int64_t bytes =
      SaturatingMul(BlockBytes(shape, num_layers, cache.block_tokens), cache.num_blocks);
  const auto exhausted = [&](absl::string_view cause) {
    const bool overflow = bytes == std::numeric_limits<int64_t>::max();
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda backend: cannot allocate a KV cache of ", overflow ? "more than " : "",
                     bytes, " bytes (", cache.num_blocks, " blocks of ", cache.block_tokens,
                     " tokens) on the device", cause.empty() ? "" : ": ", cause));
  };
  if (bytes == std::numeric_limits<int64_t>::max()) return exhausted("");
  absl::StatusOr<DeviceBuffer> storage = DeviceBuffer::Allocate(static_cast<size_t>(bytes));
  if (!storage.ok()) {
    // A failed cudaMalloc stays the thread's last error; clear it so that the
    // next launch check on this thread does not report it.
    static_cast<void>(cudaGetLastError());
    return exhausted(storage.status().message());
  }
  // Per stream: start [max_tokens], cu_blocks [max_tokens + 1], tables [num_blocks].
  const size_t staging_bytes =
      static_cast<size_t>(2 * max_tokens + 1 + cache.num_blocks) * sizeof(int32_t);
  std::vector<Staging> staging;
  for (int i = 0; i < num_streams; ++i) {
    Staging s;
    LS_ASSIGN_OR_RETURN(s.host, PinnedBuffer::Allocate(staging_bytes));
    LS_ASSIGN_OR_RETURN(s.device, DeviceBuffer::Allocate(staging_bytes));
    staging.push_back(std::move(s));
  }
  // One layer's K (or V) pool: half of what a block costs in one layer, per block.
  const size_t layer_bytes = static_cast<size_t>(BlockBytes(shape, 1, cache.block_tokens) / 2) *
                             static_cast<size_t>(cache.num_blocks);
  return std::unique_ptr<KvPool>(
      new KvPool(cache, layer_bytes, max_tokens, *std::move(storage), std::move(staging)));
}

KvPool::KvPool(const KvCacheShape& shape, size_t layer_bytes, int64_t max_tokens,
               DeviceBuffer storage, std::vector<Staging> staging)
    : shape_(shape),
      layer_bytes_(layer_bytes),
      max_tokens_(max_tokens),
      storage_(std::move(storage)),
      staging_(std::move(staging)) {}

absl::StatusOr<BatchKvMeta> KvPool::Upload(const Batch& batch, int stream,
                                           cudaStream_t cuda_stream) {
  const int64_t num_seqs = static_cast<int64_t>(batch.kv.size());
  if (num_seqs > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: a batch of ", num_seqs,
                                                   " sequences, more than max_batch_tokens (",
                                                   max_tokens_, ")"));
  }
  Staging& staging = staging_[static_cast<size_t>(stream)];
  auto* start = reinterpret_cast<int32_t*>(staging.host.data());
  int32_t* cu_blocks = start + num_seqs;
  int32_t* tables = cu_blocks + num_seqs + 1;
  int64_t ids = 0;
  cu_blocks[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SequenceKv& seq = batch.kv[static_cast<size_t>(s)];
    start[s] = static_cast<int32_t>(seq.position);
    if (seq.block_table != nullptr) {
      const std::vector<KvBlockId>& table = *seq.block_table;
      if (ids + static_cast<int64_t>(table.size()) > shape_.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda backend: the batch's block tables list more than the pool's ",
                         shape_.num_blocks, " blocks, so sequences share blocks"));
      }
      std::copy(table.begin(), table.end(), tables + ids);
      ids += static_cast<int64_t>(table.size());
    }
    cu_blocks[s + 1] = static_cast<int32_t>(ids);
  }
  const size_t used = static_cast<size_t>(2 * num_seqs + 1 + ids) * sizeof(int32_t);
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.device.data(), staging.host.data(), used,
                                          cudaMemcpyHostToDevice, cuda_stream));
  const auto* device = static_cast<const int32_t*>(staging.device.data());
  return BatchKvMeta{device, device + num_seqs, device + 2 * num_seqs + 1};
}

}  // namespace layerserve::cuda
