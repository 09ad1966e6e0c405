// The CUDA backend's paged KV cache: the device storage behind the block ids
// that the core's session table hands out (server/core/kv_blocks.h,
// sessions.h), and each stream's staging for the block tables of a batch.
//
// Layout, one cudaMalloc: for each layer of the span a K pool and a V pool
// in the activation dtype (bf16, or fp16 for fp16 checkpoints) of
// [num_blocks][block_tokens][kv_heads * head_dim] elements, the layout the
// CPU backend's cache has too; or, with --kv-cache-dtype=fp8, the K and V
// codes then the K and V scales in the FP8 layout of
// layerserve/kernels/paged_attention.h's PagedKv (V transposed within each
// block). Rows are written before they are read (a step stores its tokens'
// K/V before any later step attends over them), so the pool is never
// cleared.
//
// A session batch's metadata travels like cu_seqlens: the stream's thread
// packs it into its pinned staging, one copy moves it to the device on the
// stream. Its size: per sequence a start position and a table offset, and
// the tables themselves. The tables of one batch never share a block (the
// session table gives every sequence its own, and a session has one step in
// flight), so they hold at most num_blocks ids, and the staging is sized for
// that. The batch's attention plan (PlanPagedAttention: work items and
// combine tasks, the same for every layer) rides in the same copy, and each
// stream owns the fp32 workspace its split items write, sized once for the
// largest plan a batch of max_tokens tokens can need.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "layerserve/kernels/paged_attention.h"
#include "server/core/backend.h"
#include "server/core/kv_cache_dtype.h"
#include "server/cuda/layer_executor.h"

namespace layerserve::cuda {

// Where a session batch's sequences sit in the pool, on the device (pointers
// into one stream's staging, valid for the batch being enqueued).
struct BatchKvMeta {
  const int32_t* start = nullptr;      // [num_seqs]: position of each sequence's first new token
  const int32_t* cu_blocks = nullptr;  // [num_seqs + 1]: offsets of the tables in block_tables
  const int32_t* block_tables =
      nullptr;  // the tables, concatenated (a stateless sequence's is empty)
  // Whether some sequence starts past 0 (has cached keys); only then is
  // there a plan.
  bool history = false;
  // The attention plan of the batch, and the stream's split workspace.
  const kernels::PagedWorkItem* items = nullptr;
  int num_items = 0;
  const kernels::PagedCombineTask* combines = nullptr;
  int num_combines = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
};

class KvPool;

// Completes `geometry` for a session batch: the pool and what Upload put on
// the device (starts, tables, the attention plan, the split workspace).
void AttachKv(const KvPool* pool, const BatchKvMeta& meta, BatchGeometry* geometry);

// Threading: Create runs once, before serving. Afterwards the pool's storage
// is written and read only by enqueued kernels, and staging(i) is used only
// by stream i's thread.
class KvPool {
 public:
  // Bytes one block costs: num_layers x (K, V) x block_tokens x kv_heads x
  // (head_dim x element size, or for FP8 head_dim codes and a 4-byte scale).
  // 0 for block_tokens < 1; INT64_MAX where the product overflows.
  static int64_t BlockBytes(const LayerShape& shape, KvCacheDType dtype, int num_layers,
                            int64_t block_tokens);

  // The pool for `cache` (num_blocks 0: an empty pool, nothing allocated), and
  // for each of `num_streams` streams a staging area for batches of up to
  // `max_tokens` tokens. INVALID_ARGUMENT for a negative block count, or with
  // blocks, block_tokens outside [1, 2^31); RESOURCE_EXHAUSTED naming the
  // bytes when the device cannot hold the pool; INTERNAL for other device
  // failures. An FP8 pool needs block_tokens a multiple of 16
  // (INVALID_ARGUMENT otherwise). The current device must be set; its SM
  // count shapes the attention plans.
  static absl::StatusOr<std::unique_ptr<KvPool>> Create(const LayerShape& shape, KvCacheDType dtype,
                                                        int num_layers, const KvCacheShape& cache,
                                                        int num_streams, int64_t max_tokens);

  const KvCacheShape& shape() const { return shape_; }
  size_t bytes() const { return storage_.bytes(); }
  // Layer `layer`'s K and V pools (in an FP8 pool: the K codes, and the V
  // groups of codes and scales).
  void* k(int layer) const { return Layer(layer); }
  void* v(int layer) const { return Layer(layer) + k_bytes_; }
  bool fp8() const { return fp8_; }

  // Packs `batch`'s start positions, block tables and attention plan into
  // stream `stream`'s pinned staging and enqueues their copy to the device
  // on `cuda_stream`. With `pad_plan`, the plan is padded with idle work to
  // GraphPlanCount of its counts (forward_graphs.h), so that the batch's
  // key, and its captured graph, serve the nearby plans too. The pointers
  // returned depend on the batch's sequence count and plan counts only.
  // The staging must not be in use by an earlier batch of that stream (its
  // thread waits for each batch before the next). INVALID_ARGUMENT when the
  // batch has more sequences than max_tokens or its tables more ids than the
  // pool has blocks (they would share blocks).
  absl::StatusOr<BatchKvMeta> Upload(const Batch& batch, int stream, cudaStream_t cuda_stream,
                                     bool pad_plan);

 private:
  struct Staging {
    PinnedBuffer host;
    DeviceBuffer device;
    DeviceBuffer partials;  // partial_out then partial_lse, fp32
  };

  KvPool(const LayerShape& layer, const KvCacheShape& shape, bool fp8, size_t k_bytes,
         size_t v_bytes, int64_t max_tokens, int num_sms, kernels::PagedPlanLimits plan_limits,
         DeviceBuffer storage, std::vector<Staging> staging);

  // One layer's storage: its K pool, then its V pool.
  unsigned char* Layer(int layer) const {
    return static_cast<unsigned char*>(storage_.data()) +
           static_cast<size_t>(layer) * (k_bytes_ + v_bytes_);
  }

  const LayerShape layer_;
  const KvCacheShape shape_;
  const bool fp8_;
  const size_t k_bytes_;  // of one layer's K pool
  const size_t v_bytes_;  // of one layer's V pool (FP8: the scales too)
  const int64_t max_tokens_;
  const int num_sms_;
  const kernels::PagedPlanLimits plan_limits_;
  DeviceBuffer storage_;  // [num_layers][K pool, V pool]
  // per stream: [start | cu_blocks | items | combines | block_tables]
  std::vector<Staging> staging_;
};

}  // namespace layerserve::cuda
