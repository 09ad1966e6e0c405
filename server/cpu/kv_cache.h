// The CPU backend's paged KV cache: the storage behind the block ids that the
// core's session table hands out (server/core/kv_blocks.h, sessions.h).
//
// Layout, float32 like every CPU activation: for each layer of the span, a K
// pool and a V pool of [num_blocks][block_tokens][kv_width] floats, where
// kv_width = kv_heads * head_dim is one token's row as the fused qkv
// projection produces it. Token p of a sequence with block table `table`
// lives at block table[p / block_tokens], row p % block_tokens, so a block's
// rows are contiguous: reading a sequence back is one copy per block, and
// writing a new token is one copy of its row.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/backend.h"
#include "server/core/kv_blocks.h"

namespace layerserve::cpu {

// Threading: not synchronised. The backend's worker thread is its only user;
// calls on disjoint rows (different sequences, or a sequence's cached rows
// and its new ones) may run at once on the backend's thread pool.
class KvCache {
 public:
  // Bytes one block costs: K and V of `block_tokens` tokens in each of
  // `num_layers` layers, kv_width floats per row. 0 for block_tokens < 1;
  // INT64_MAX where the product overflows.
  static int64_t BlockBytes(int64_t num_layers, int64_t kv_width, int64_t block_tokens);

  // A pool of shape.num_blocks blocks (0: none, and nothing allocated). Its
  // memory is not touched here (see kv_cache.cc).
  // INVALID_ARGUMENT for a negative block count or, with blocks, block_tokens
  // < 1; RESOURCE_EXHAUSTED naming the bytes when they cannot be allocated.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(int64_t num_layers, int64_t kv_width,
                                                         const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }

  // Stores positions [begin, end) of the sequence whose blocks are `table`
  // in layer `layer`: position p's K row from k + (p - begin) * stride, its V
  // row likewise from v. `table` must cover position end - 1.
  void Write(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
             const float* k, const float* v, int64_t stride);

  // Copies positions [begin, end) of that sequence out of layer `layer` into
  // k_out and v_out, as contiguous rows of kv_width floats.
  void Read(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
            float* k_out, float* v_out) const;

 private:
  KvCache(int64_t kv_width, const KvCacheShape& shape, std::unique_ptr<float[]> storage);

  // The row of position `position` of a sequence in layer `layer`'s K (or,
  // with value = true, V) pool.
  size_t RowOffset(int64_t layer, bool value, std::span<const KvBlockId> table,
                   int64_t position) const;

  const int64_t kv_width_;
  const KvCacheShape shape_;
  // [num_layers][K, V][num_blocks][block_tokens][kv_width]
  std::unique_ptr<float[]> storage_;
};

// The memory the OS reports available to a new allocation, in bytes
// (MemAvailable in /proc/meminfo; the free physical pages where that file is
// missing).
int64_t AvailableMemoryBytes();

}  // namespace layerserve::cpu
