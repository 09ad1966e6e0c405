// The CPU backend's paged KV cache: the storage behind the block ids that the
// core's session table hands out (server/core/kv_blocks.h, sessions.h).
//
// Layout: for each layer of the span, a K pool and a V pool of
// [num_blocks][block_tokens] rows, one per token, where kv_width = kv_heads *
// head_dim is the row's width as the fused qkv projection produces it. A row
// is kv_width float32 values, like every CPU activation, or with
// KvCacheDType::kFp8E4M3 kv_width e4m3 codes followed by kv_heads float32
// scales, one per head (the numerics are kv_cache_dtype.h's). Token p of a
// sequence with block table `table` lives at block table[p / block_tokens],
// row p % block_tokens, so a block's rows are contiguous: reading a float
// sequence back is one copy per block, and writing a new token is one copy
// (or quantization) of its row.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/backend.h"
#include "server/core/kv_blocks.h"
#include "server/core/kv_cache_dtype.h"

namespace layerserve::cpu {

// Threading: not synchronised. The backend's worker thread is its only user;
// calls on disjoint rows (different sequences, or a sequence's cached rows
// and its new ones) may run at once on the backend's thread pool.
class KvCache {
 public:
  // A token's K (or V) row: its heads and their width.
  struct RowShape {
    int64_t kv_heads = 0;
    int64_t head_dim = 0;
    KvCacheDType dtype = KvCacheDType::kActivation;
    int64_t width() const { return kv_heads * head_dim; }
    // Bytes of one stored row: 4 per value, or 1 per code and 4 per head's
    // scale.
    int64_t bytes() const;
  };

  // Bytes one block costs: K and V of `block_tokens` tokens in each of
  // `num_layers` layers. 0 for block_tokens < 1; INT64_MAX where the product
  // overflows.
  static int64_t BlockBytes(int64_t num_layers, const RowShape& row, int64_t block_tokens);

  // A pool of shape.num_blocks blocks (0: none, and nothing allocated). Its
  // memory is not touched here (see kv_cache.cc).
  // INVALID_ARGUMENT for a negative block count or, with blocks, block_tokens
  // < 1; RESOURCE_EXHAUSTED naming the bytes when they cannot be allocated.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(int64_t num_layers, const RowShape& row,
                                                         const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }

  // Stores positions [begin, end) of the sequence whose blocks are `table`
  // in layer `layer`: position p's K row from k + (p - begin) * stride, its V
  // row likewise from v (quantized, in an FP8 cache). `table` must cover
  // position end - 1.
  void Write(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
             const float* k, const float* v, int64_t stride);

  // Copies positions [begin, end) of that sequence out of layer `layer` into
  // k_out and v_out, as contiguous rows of kv_width floats (code * scale,
  // in an FP8 cache).
  void Read(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
            float* k_out, float* v_out) const;

 private:
  KvCache(const RowShape& row, const KvCacheShape& shape, std::unique_ptr<unsigned char[]> storage);

  // The row of position `position` of a sequence in layer `layer`'s K (or,
  // with value = true, V) pool.
  unsigned char* Row(int64_t layer, bool value, std::span<const KvBlockId> table,
                     int64_t position) const;
  void StoreRow(const float* x, unsigned char* row) const;
  void LoadRow(const unsigned char* row, float* out) const;

  const RowShape row_;
  const KvCacheShape shape_;
  // [num_layers][K, V][num_blocks][block_tokens] rows of row_.bytes()
  std::unique_ptr<unsigned char[]> storage_;
};

// The memory the OS reports available to a new allocation, in bytes
// (MemAvailable in /proc/meminfo; the free physical pages where that file is
// missing).
int64_t AvailableMemoryBytes();

}  // namespace layerserve::cpu
