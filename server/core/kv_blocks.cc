// KV block bookkeeping: see kv_blocks.h.
#include "server/core/kv_blocks.h"

#include "absl/strings/str_cat.h"

namespace layerserve {

int64_t BlocksForTokens(int64_t tokens, int64_t block_tokens) {
  // Written so that tokens near INT64_MAX cannot overflow (no tokens + S - 1).
  return tokens / block_tokens + (tokens % block_tokens != 0 ? 1 : 0);
}

KvSlot KvSlotOf(int64_t position, int64_t block_tokens) {
  return KvSlot{position / block_tokens, position % block_tokens};
}

KvBlockAllocator::KvBlockAllocator(KvBlockId capacity)
    : in_use_(static_cast<size_t>(capacity > 0 ? capacity : 0), false) {
  free_.reserve(in_use_.size());
  // Highest id at the bottom of the stack, so block 0 is handed out first.
  for (KvBlockId id = static_cast<KvBlockId>(in_use_.size()); id > 0; --id) free_.push_back(id - 1);
}

absl::Status KvBlockAllocator::Allocate(int64_t count, std::vector<KvBlockId>* out) {
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", count, " KV blocks"));
  }
  if (count > free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("out of KV cache blocks: ", count, " needed, ",
                                                     free_blocks(), " of ", capacity(), " free"));
  }
  out->reserve(out->size() + static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const KvBlockId id = free_.back();
    free_.pop_back();
    in_use_[static_cast<size_t>(id)] = true;
    out->push_back(id);
  }
  return absl::OkStatus();
}

absl::Status KvBlockAllocator::Free(absl::Span<const KvBlockId> blocks) {
  // Validate everything first so that a bad list frees nothing. A duplicate
  // within `blocks` is found by marking as we go and unmarking on failure.
  size_t checked = 0;
  absl::Status status;
  for (; checked < blocks.size(); ++checked) {
    const KvBlockId id = blocks[checked];
    if (id < 0 || id >= capacity()) {
      status = absl::InternalError(
          absl::StrCat("freeing KV block ", id, " outside the pool of ", capacity(), " blocks"));
      break;
    }
    if (!in_use_[static_cast<size_t>(id)]) {
      status = absl::InternalError(
          absl::StrCat("freeing KV block ", id, ", which is not allocated (double free)"));
      break;
    }
    in_use_[static_cast<size_t>(id)] = false;
  }
  if (!status.ok()) {
    for (size_t i = 0; i < checked; ++i) in_use_[static_cast<size_t>(blocks[i])] = true;
    return status;
  }
  // Pushed in reverse so that re-allocating the same count returns the same
  // ids in the same order (a freed table comes back as it was).
  for (size_t i = blocks.size(); i > 0; --i) free_.push_back(blocks[i - 1]);
  return absl::OkStatus();
}

bool KvBlockAllocator::IsAllocated(KvBlockId id) const {
  return id >= 0 && id < capacity() && in_use_[static_cast<size_t>(id)];
}

}  // namespace layerserve
