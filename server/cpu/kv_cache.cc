// The CPU backend's paged KV cache (see kv_cache.h).
#include "server/cpu/kv_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/saturating.h"

namespace layerserve::cpu {
int64_t KvCache::BlockBytes(int64_t num_layers, int64_t kv_width, int64_t block_tokens) {
  if (block_tokens < 1) return 0;
  const int64_t floats_per_layer = SaturatingMul(2 * kv_width, block_tokens);
  return SaturatingMul(SaturatingMul(num_layers, floats_per_layer),
                       static_cast<int64_t>(sizeof(float)));
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(int64_t num_layers, int64_t kv_width,
                                                         const KvCacheShape& shape) {
  if (shape.num_blocks < 0 || (shape.num_blocks > 0 && shape.block_tokens < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: a KV cache of ", shape.num_blocks,
                                                   " blocks of ", shape.block_tokens,
                                                   " tokens is not a pool"));
  }
  const int64_t bytes =
      SaturatingMul(BlockBytes(num_layers, kv_width, shape.block_tokens), shape.num_blocks);
  const auto exhausted = [&] {
    const bool overflow = bytes == std::numeric_limits<int64_t>::max();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate a KV cache of ", overflow ? "more than " : "", bytes,
        " bytes (", shape.num_blocks, " blocks of ", shape.block_tokens, " tokens)"));
  };
  if (bytes == std::numeric_limits<int64_t>::max()) return exhausted();
  std::unique_ptr<float[]> storage;
  try {
    // Left uninitialised: the pages are the OS's until a step first writes
    // them (a step writes every row before any step reads it), so a large
    // pool costs nothing at start-up and a host's memory is only taken as
    // sessions fill it. The price: on a host that overcommits memory, a pool
    // larger than the memory that is really free fails when it fills, not
    // here; --kv-cache-memory's default stays a fraction of what is free.
    storage = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(bytes) / sizeof(float));
  } catch (const std::bad_alloc&) {
    return exhausted();
  }
  return std::unique_ptr<KvCache>(new KvCache(kv_width, shape, std::move(storage)));
}

KvCache::KvCache(int64_t kv_width, const KvCacheShape& shape, std::unique_ptr<float[]> storage)
    : kv_width_(kv_width), shape_(shape), storage_(std::move(storage)) {}

size_t KvCache::RowOffset(int64_t layer, bool value, std::span<const KvBlockId> table,
                          int64_t position) const {
  const KvSlot slot = KvSlotOf(position, shape_.block_tokens);
  const int64_t pool = 2 * layer + (value ? 1 : 0);
  const int64_t block = pool * shape_.num_blocks + table[static_cast<size_t>(slot.table_index)];
  return static_cast<size_t>((block * shape_.block_tokens + slot.row) * kv_width_);
}

void KvCache::Write(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
                    const float* k, const float* v, int64_t stride) {
  for (int64_t p = begin; p < end; ++p) {
    const int64_t src = (p - begin) * stride;
    std::copy_n(k + src, kv_width_, storage_.get() + RowOffset(layer, false, table, p));
    std::copy_n(v + src, kv_width_, storage_.get() + RowOffset(layer, true, table, p));
  }
}

void KvCache::Read(int64_t layer, std::span<const KvBlockId> table, int64_t begin, int64_t end,
                   float* k_out, float* v_out) const {
  // One copy per block: from p to the end of p's block, or to `end`.
  for (int64_t p = begin; p < end;) {
    const int64_t rows = std::min(end, (p / shape_.block_tokens + 1) * shape_.block_tokens) - p;
    const int64_t dst = (p - begin) * kv_width_;
    std::copy_n(storage_.get() + RowOffset(layer, false, table, p), rows * kv_width_, k_out + dst);
    std::copy_n(storage_.get() + RowOffset(layer, true, table, p), rows * kv_width_, v_out + dst);
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
