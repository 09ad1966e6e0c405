// The KV cache's paged storage, as bookkeeping only: a pool of fixed-size
// blocks (ids 0..N-1) handed out to sessions' block tables, and the arithmetic
// that maps token positions to blocks.
//
// A backend owns the storage (one pool per backend, sized in bytes, holding
// for every layer of its span the K and V of `block_tokens` tokens per block)
// and tells the core how many blocks it has; the core decides which block ids
// a sequence uses. Token p of a sequence lives in block table entry
// p / block_tokens, at row p % block_tokens of that block.
//
// Worked example, block_tokens S = 16: a sequence of length L = 0 holds no
// block; L = 16 exactly one; L = 17 two, the second holding one token.
// Appending T = 3 tokens at L = 15 writes positions 15, 16, 17: one row of the
// last block and two of a newly reserved one.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace layerserve {

// Index of a block in a backend's KV pool.
using KvBlockId = int32_t;

// Blocks a sequence of `tokens` tokens occupies at `block_tokens` tokens per
// block: ceil(tokens / block_tokens), 0 for no tokens. Requires tokens >= 0 and
// block_tokens > 0; never overflows.
int64_t BlocksForTokens(int64_t tokens, int64_t block_tokens);

// Where token `position` of a sequence lives: its block table entry and the
// row within that block. Requires position >= 0 and block_tokens > 0.
struct KvSlot {
  int64_t table_index = 0;  // position / block_tokens
  int64_t row = 0;          // position % block_tokens
};
KvSlot KvSlotOf(int64_t position, int64_t block_tokens);

// Hands out the ids of a pool of `capacity` blocks.
//
// Threading: not thread-safe. It is meant to be owned by one SessionTable and
// used only under that table's lock (every call here is O(blocks touched) and
// allocates nothing beyond the caller's vector, so it is cheap to hold a lock
// across); any other owner must serialize calls itself.
//
// Freed blocks are reused last-in first-out, so a pool that is mostly idle
// keeps reusing the same few blocks.
class KvBlockAllocator {
 public:
  // A pool of `capacity` blocks, ids 0..capacity-1, all free. Requires
  // capacity >= 0.
  explicit KvBlockAllocator(KvBlockId capacity);

  KvBlockAllocator(const KvBlockAllocator&) = delete;
  KvBlockAllocator& operator=(const KvBlockAllocator&) = delete;

  // Reserves `count` blocks and appends their ids to `*out`, or reserves none:
  // RESOURCE_EXHAUSTED saying how many are needed and how many are free (the
  // caller may prefix the message with who asked). count 0 always succeeds;
  // a negative count is INVALID_ARGUMENT. `*out` is untouched on failure.
  absl::Status Allocate(int64_t count, std::vector<KvBlockId>* out);

  // Returns `blocks` to the pool. Every id must be in range, currently
  // allocated and listed once; otherwise nothing is freed and the status is
  // INTERNAL naming the first bad id (a double free is a bug of the caller,
  // reported rather than crashing the server).
  absl::Status Free(absl::Span<const KvBlockId> blocks);

  int64_t capacity() const { return static_cast<int64_t>(in_use_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_blocks() const { return capacity() - free_blocks(); }
  // Whether block `id` is currently allocated (false when out of range).
  bool IsAllocated(KvBlockId id) const;

 private:
  std::vector<KvBlockId> free_;  // stack: the next id handed out is free_.back()
  std::vector<bool> in_use_;     // indexed by id
};

}  // namespace layerserve
