// The CPU backend's paged KV cache (see kv_cache.h).
#include "server/cpu/kv_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/saturating.h"

namespace layerserve::cpu {
int64_t KvCache::RowShape::bytes() const {
  if (dtype == KvCacheDType::kFp8E4M3) {
    return SaturatingAdd(width(), SaturatingMul(kv_heads, static_cast<int64_t>(sizeof(float))));
  }
  return SaturatingMul(width(), static_cast<int64_t>(sizeof(float)));
}

int64_t KvCache::BlockBytes(int64_t num_layers, const RowShape& row, int64_t block_tokens) {
  if (block_tokens < 1) return 0;
  const int64_t rows_per_layer = SaturatingMul(2, block_tokens);
  return SaturatingMul(SaturatingMul(num_layers, rows_per_layer), row.bytes());
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(int64_t num_layers, const RowShape& row,
                                                         const KvCacheShape& shape) {
  if (shape.num_blocks < 0 || (shape.num_blocks > 0 && shape.block_tokens < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: a KV cache of ", shape.num_blocks,
                                                   " blocks of ", shape.block_tokens,
                                                   " tokens is not a pool"));
  }
  const int64_t bytes =
      SaturatingMul(BlockBytes(num_layers, row, shape.block_tokens), shape.num_blocks);
  const auto exhausted = [&] {
    const bool overflow = bytes == std::numeric_limits<int64_t>::max();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate a KV cache of ", overflow ? "more than " : "", bytes,
        " bytes (", shape.num_blocks, " blocks of ", shape.block_tokens, " tokens)"));
  };
  if (bytes == std::numeric_limits<int64_t>::max()) return exhausted();
  std::unique_ptr<unsigned char[]> storage;
  try {
    // Left uninitialised: the pages are the OS's until a step first writes
    // them (a step writes every row before any step reads it), so a large
    // pool costs nothing at start-up and a host's memory is only taken as
    // sessions fill it. The price: on a host that overcommits memory, a pool
    // larger than the memory that is really free fails when it fills, not
    // here; --kv-cache-memory's default stays a fraction of what is free.
    storage = std::make_unique_for_overwrite<unsigned char[]>(static_cast<size_t>(bytes));
  } catch (const std::bad_alloc&) {
    return exhausted();
  }
  return std::unique_ptr<KvCache>(new KvCache(row, shape, std::move(storage)));
}

KvCache::KvCache(const RowShape& row, const KvCacheShape& shape,
                 std::unique_ptr<unsigned char[]> storage)
    : row_(row), shape_(shape), storage_(std::move(storage)) {}

unsigned char* KvCache::Row(int64_t layer, bool value, std::span<const KvBlockId> table,
                            int64_t position) const {
  const KvSlot slot = KvSlotOf(position, shape_.block_tokens);
  const int64_t pool = 2 * layer + (value ? 1 : 0);
  const int64_t block = pool * shape_.num_blocks + table[static_cast<size_t>(slot.table_index)];
  return storage_.get() +
         static_cast<size_t>((block * shape_.block_tokens + slot.row) * row_.bytes());
}

// An FP8 row: the codes of every head, then the heads' scales (memcpy: the
// scales sit at any offset).
void KvCache::StoreRow(const float* x, unsigned char* row) const {
  if (row_.dtype != KvCacheDType::kFp8E4M3) {
    std::memcpy(row, x, static_cast<size_t>(row_.width()) * sizeof(float));
    return;
  }
  unsigned char* scales = row + row_.width();
  for (int64_t h = 0; h < row_.kv_heads; ++h) {
    const float* head = x + h * row_.head_dim;
    float amax = 0.f;
    for (int64_t i = 0; i < row_.head_dim; ++i) amax = std::max(amax, std::fabs(head[i]));
    const float scale = amax / kFp8E4M3Max;
    for (int64_t i = 0; i < row_.head_dim; ++i) {
      row[h * row_.head_dim + i] = scale == 0.f ? 0 : FloatToFp8E4M3(head[i] / scale);
    }
    std::memcpy(scales + h * static_cast<int64_t>(sizeof(float)), &scale, sizeof(float));
  }
}

void KvCache::LoadRow(const unsigned char* row, float* out) const {
  if (row_.dtype != KvCacheDType::kFp8E4M3) {
    std::memcpy(out, row, static_cast<size_t>(row_.width()) * sizeof(float));
    return;
  }
  const unsigned char* scales = row + row_.width();
  for (int64_t h = 0; h < row_.kv_heads; ++h) {
    float scale;
    std::memcpy(&scale, scales + h * static_cast<int64_t>(sizeof(float)), sizeof(float));
    for (int64_t i = 0; i < row_.head_dim; ++i) {
      out[h * row_.head_dim + i] = Fp8E4M3ToFloat(row[h * row_.head_dim + i]) * scale;
    }
  }
}

void KvCache::Write(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
                    const float* k, const float* v, int64_t stride) {
  for (int64_t p = begin; p < end; ++p) {
    const int64_t src = (p - begin) * stride;
    StoreRow(k + src, Row(layer, false, table, p));
    StoreRow(v + src, Row(layer, true, table, p));
  }
}

void KvCache::Read(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
                   float* k_out, float* v_out) const {
  const int64_t width = row_.width();
  if (row_.dtype == KvCacheDType::kFp8E4M3) {
    for (int64_t p = begin; p < end; ++p) {
      LoadRow(Row(layer, false, table, p), k_out + (p - begin) * width);
      LoadRow(Row(layer, true, table, p), v_out + (p - begin) * width);
    }
    return;
  }
  // Float rows: one copy per block, from p to the end of p's block or `end`.
  for (int64_t p = begin; p < end;) {
    const int64_t rows = std::min(end, (p / shape_.block_tokens + 1) * shape_.block_tokens) - p;
    const size_t bytes = static_cast<size_t>(rows * width) * sizeof(float);
    const int64_t dst = (p - begin) * width;
    std::memcpy(k_out + dst, Row(layer, false, table, p), bytes);
    std::memcpy(v_out + dst, Row(layer, true, table, p), bytes);
    p += rows;
  }
}

int64_t AvailableMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    int64_t kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %" SCNd64 " kB", &kib) == 1) return kib * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (pages < 0 || page_bytes < 0) return 0;
  return static_cast<int64_t>(pages) * page_bytes;
}

}  // namespace layerserve::cpu
