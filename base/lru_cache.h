// A map of at most `capacity` entries that makes room by dropping the entry
// used least recently. Find and Insert both count as a use. Not thread-safe:
// the CUDA backend keeps one per stream, touched by that stream's thread
// only (its captured graphs, server/cuda/forward_graphs.h).
//
// A list holds the entries, most recent first, so that a use moves its entry
// to the front without copying it; a hash map finds the list node of a key.
#pragma once

#include <cstddef>
#include <list>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"

namespace layerserve {

template <typename K, typename V, typename Hash = absl::Hash<K>>
class LruCache {
 public:
  // `capacity` below 1 counts as 1.
  explicit LruCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The value stored for `key`, now the most recently used; null if none.
  // The pointer stays valid until the entry is dropped.
  V* Find(const K& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    entries_.splice(entries_.begin(), entries_, it->second);
    return &it->second->second;
  }

  // Stores `value` for `key` (replacing what was there) as the most recently
  // used entry; when that makes one entry too many, drops the least recently
  // used one first (its value is destroyed).
  V& Insert(const K& key, V value) {
    if (V* existing = Find(key); existing != nullptr) {
      *existing = std::move(value);
      return *existing;
    }
    if (entries_.size() == capacity_) {
      index_.erase(entries_.back().first);
      entries_.pop_back();
    }
    entries_.emplace_front(key, std::move(value));
    index_.emplace(key, entries_.begin());
    return entries_.front().second;
  }

  size_t size() const { return entries_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  using Entries = std::list<std::pair<K, V>>;

  const size_t capacity_;
  Entries entries_;  // most recently used first
  absl::flat_hash_map<K, typename Entries::iterator, Hash> index_;
};

}  // namespace layerserve
