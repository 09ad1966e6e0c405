// The CUDA backend's paged KV cache (see kv_pool.h).
#include "server/cuda/kv_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/cuda/cuda_status.h"
#include "base/saturating.h"
#include "base/status_macros.h"
#include "server/cuda/forward_graphs.h"

namespace layerserve::cuda {

void AttachKv(const KvPool* pool, const BatchKvMeta& meta, BatchGeometry* geometry) {
  geometry->kv_pool = pool;
  geometry->kv_start = meta.start;
  geometry->kv_cu_blocks = meta.cu_blocks;
  geometry->kv_block_tables = meta.block_tables;
  geometry->kv_history = meta.history;
  geometry->paged_items = meta.items;
  geometry->num_paged_items = meta.num_items;
  geometry->paged_combines = meta.combines;
  geometry->num_paged_combines = meta.num_combines;
  geometry->partial_out = meta.partial_out;
  geometry->partial_lse = meta.partial_lse;
}

namespace {

// One token's K (or V) row in one layer: its elements, or its codes and a
// scale per KV head.
int64_t RowBytes(const LayerShape& shape, KvCacheDType dtype) {
  const int64_t width = int64_t{shape.num_kv_heads} * shape.head_dim;
  if (dtype == KvCacheDType::kFp8E4M3) {
    return width + int64_t{shape.num_kv_heads} * static_cast<int64_t>(sizeof(float));
  }
  return width * kernels::DTypeBytes(shape.dtype);
}

}  // namespace

int64_t KvPool::BlockBytes(const LayerShape& shape, KvCacheDType dtype, int num_layers,
                           int64_t block_tokens) {
  if (block_tokens < 1) return 0;
  return SaturatingMul(SaturatingMul(2 * int64_t{num_layers}, block_tokens),
                       RowBytes(shape, dtype));
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const LayerShape& shape, KvCacheDType dtype,
                                                       int num_layers, const KvCacheShape& cache,
                                                       int num_streams, int64_t max_tokens) {
  if (cache.num_blocks < 0 ||
      (cache.num_blocks > 0 && (cache.block_tokens < 1 || cache.block_tokens > INT32_MAX))) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: a KV cache of ", cache.num_blocks,
                                                   " blocks of ", cache.block_tokens,
                                                   " tokens is not a pool"));
  }
  const bool fp8 = dtype == KvCacheDType::kFp8E4M3;
  if (fp8 && cache.num_blocks > 0 && cache.block_tokens % 16 != 0) {
    // The paged kernel loads V codes and scales in runs of 16 keys of one
    // block (layerserve/kernels/paged_attention.h).
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: --kv-cache-dtype=fp8 needs --kv-block-tokens a multiple of 16, got ",
        cache.block_tokens));
  }
  const int64_t bytes =
      SaturatingMul(BlockBytes(shape, dtype, num_layers, cache.block_tokens), cache.num_blocks);
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
  LS_ASSIGN_OR_RETURN(const kernels::DeviceInfo device, kernels::CurrentDeviceInfo());
  const kernels::PagedPlanLimits limits = kernels::PagedPlanCapacity(
      max_tokens, max_tokens, shape.num_heads, shape.num_kv_heads, device.num_sms);
  // Per stream: start [max_tokens], cu_blocks [max_tokens + 1], tables
  // [num_blocks], then the plan's items and combine tasks (the combine tasks
  // are never more than the items).
  const size_t staging_bytes =
      static_cast<size_t>(2 * max_tokens + 1 + cache.num_blocks) * sizeof(int32_t) +
      static_cast<size_t>(limits.items) *
          (sizeof(kernels::PagedWorkItem) + sizeof(kernels::PagedCombineTask));
  const size_t partial_bytes = static_cast<size_t>(limits.partial_rows) * shape.num_kv_heads *
                               (shape.head_dim + 1) * sizeof(float);
  std::vector<Staging> staging;
  for (int i = 0; i < num_streams; ++i) {
    Staging s;
    LS_ASSIGN_OR_RETURN(s.host, PinnedBuffer::Allocate(staging_bytes));
    LS_ASSIGN_OR_RETURN(s.device, DeviceBuffer::Allocate(staging_bytes));
    LS_ASSIGN_OR_RETURN(s.partials, DeviceBuffer::Allocate(partial_bytes));
    staging.push_back(std::move(s));
  }
  // One layer's K and V pools: K's elements (or codes); V's the same, or
  // the FP8 V groups, which hold both scales too.
  const size_t tokens = static_cast<size_t>(cache.num_blocks * cache.block_tokens);
  const size_t width =
      static_cast<size_t>(shape.num_kv_heads) * static_cast<size_t>(shape.head_dim);
  const size_t k_bytes = tokens * width * (fp8 ? 1 : kernels::DTypeBytes(shape.dtype));
  const size_t v_bytes =
      fp8 ? k_bytes + tokens * static_cast<size_t>(shape.num_kv_heads) * 2 * sizeof(float)
          : k_bytes;
  return std::unique_ptr<KvPool>(new KvPool(shape, cache, fp8, k_bytes, v_bytes, max_tokens,
                                            device.num_sms, limits, *std::move(storage),
                                            std::move(staging)));
}

KvPool::KvPool(const LayerShape& layer, const KvCacheShape& shape, bool fp8, size_t k_bytes,
               size_t v_bytes, int64_t max_tokens, int num_sms,
               kernels::PagedPlanLimits plan_limits, DeviceBuffer storage,
               std::vector<Staging> staging)
    : layer_(layer),
      shape_(shape),
      fp8_(fp8),
      k_bytes_(k_bytes),
      v_bytes_(v_bytes),
      max_tokens_(max_tokens),
      num_sms_(num_sms),
      plan_limits_(plan_limits),
      storage_(std::move(storage)),
      staging_(std::move(staging)) {}

absl::StatusOr<BatchKvMeta> KvPool::Upload(const Batch& batch, int stream, cudaStream_t cuda_stream,
                                           bool pad_plan) {
  const int64_t num_seqs = static_cast<int64_t>(batch.kv.size());
  if (num_seqs > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: a batch of ", num_seqs,
                                                   " sequences, more than max_batch_tokens (",
                                                   max_tokens_, ")"));
  }
  // The starts and table offsets first, then the plan, then the tables: every
  // pointer handed out depends on the sequence count and the plan's size
  // only, never on the tables' lengths, so a CUDA graph captured for one
  // batch reads the next one's metadata from the same addresses.
  Staging& staging = staging_[static_cast<size_t>(stream)];
  auto* start = reinterpret_cast<int32_t*>(staging.host.data());
  int32_t* cu_blocks = start + num_seqs;
  int64_t ids = 0;
  cu_blocks[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SequenceKv& seq = batch.kv[static_cast<size_t>(s)];
    start[s] = static_cast<int32_t>(seq.position);
    if (seq.block_table != nullptr) ids += static_cast<int64_t>(seq.block_table->size());
    if (ids > shape_.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda backend: the batch's block tables list more than the pool's ",
                       shape_.num_blocks, " blocks, so sequences share blocks"));
    }
    cu_blocks[s + 1] = static_cast<int32_t>(ids);
  }
  // The attention plan, the same for every layer of the span; none where no
  // sequence has cached keys (the executor runs flash attention then).
  const bool history = std::any_of(start, start + num_seqs, [](int32_t s) { return s > 0; });
  kernels::PagedAttentionPlan plan;
  if (history) {
    std::vector<kernels::PagedSequence> seqs(static_cast<size_t>(num_seqs));
    for (int64_t s = 0; s < num_seqs; ++s) {
      seqs[static_cast<size_t>(s)] = {
          batch.cu_seqlens[static_cast<size_t>(s) + 1] - batch.cu_seqlens[static_cast<size_t>(s)],
          start[s]};
    }
    LS_ASSIGN_OR_RETURN(
        plan, kernels::PlanPagedAttention(seqs, layer_.num_heads, layer_.num_kv_heads, num_sms_,
                                          plan_limits_));
    if (pad_plan) {
      const int64_t items = GraphPlanCount(static_cast<int64_t>(plan.items.size()));
      const int64_t combines = GraphPlanCount(static_cast<int64_t>(plan.combines.size()));
      // Past the staging's room the plan stays as it is (a graph of its own).
      if (items <= plan_limits_.items && combines <= plan_limits_.items) {
        LS_RETURN_IF_ERROR(kernels::PadPagedPlan(items, combines, &plan));
      }
    }
  }
  // Work items and combine tasks are 4-byte aligned structs of int32.
  auto* host_bytes = static_cast<unsigned char*>(staging.host.data());
  const size_t items_offset = static_cast<size_t>(2 * num_seqs + 1) * sizeof(int32_t);
  const size_t items_bytes = plan.items.size() * sizeof(kernels::PagedWorkItem);
  const size_t combines_offset = items_offset + items_bytes;
  const size_t combines_bytes = plan.combines.size() * sizeof(kernels::PagedCombineTask);
  const size_t tables_offset = combines_offset + combines_bytes;
  std::memcpy(host_bytes + items_offset, plan.items.data(), items_bytes);
  std::memcpy(host_bytes + combines_offset, plan.combines.data(), combines_bytes);
  auto* tables = reinterpret_cast<int32_t*>(host_bytes + tables_offset);
  for (const SequenceKv& seq : batch.kv) {
    if (seq.block_table == nullptr) continue;
    tables = std::copy(seq.block_table->begin(), seq.block_table->end(), tables);
  }
  LS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staging.device.data(), staging.host.data(),
                      tables_offset + static_cast<size_t>(ids) * sizeof(int32_t),
                      cudaMemcpyHostToDevice, cuda_stream));
  const auto* device = static_cast<const int32_t*>(staging.device.data());
  const auto* device_bytes = static_cast<const unsigned char*>(staging.device.data());
  BatchKvMeta meta;
  meta.history = history;
  meta.start = device;
  meta.cu_blocks = device + num_seqs;
  meta.block_tables = reinterpret_cast<const int32_t*>(device_bytes + tables_offset);
  meta.items = reinterpret_cast<const kernels::PagedWorkItem*>(device_bytes + items_offset);
  meta.num_items = static_cast<int>(plan.items.size());
  meta.combines =
      reinterpret_cast<const kernels::PagedCombineTask*>(device_bytes + combines_offset);
  meta.num_combines = static_cast<int>(plan.combines.size());
  auto* partials = static_cast<float*>(staging.partials.data());
  meta.partial_out = partials;
  meta.partial_lse = partials + static_cast<size_t>(plan_limits_.partial_rows) *
                                    layer_.num_kv_heads * layer_.head_dim;
  return meta;
}

}  // namespace layerserve::cuda
