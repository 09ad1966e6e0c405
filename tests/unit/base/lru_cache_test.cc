// LruCache: the least recently used entry (Find and Insert both use) is the
// one dropped, values are moved in and destroyed when dropped, and a
// replaced key keeps one entry.
#include "base/lru_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace layerserve {
namespace {

TEST(LruCacheTest, DropsTheLeastRecentlyUsedEntry) {
  LruCache<int, std::string> cache(3);
  cache.Insert(1, "one");
  cache.Insert(2, "two");
  cache.Insert(3, "three");
  ASSERT_NE(cache.Find(1), nullptr);  // 1 is now the most recent: 2 goes next
  cache.Insert(4, "four");
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(cache.Find(2), nullptr);
  ASSERT_NE(cache.Find(1), nullptr);
  EXPECT_EQ(*cache.Find(1), "one");
  EXPECT_EQ(*cache.Find(3), "three");
  EXPECT_EQ(*cache.Find(4), "four");
  // Order of use now 4, 3, 1 (most recent first): 1 goes.
  cache.Insert(5, "five");
  EXPECT_EQ(cache.Find(1), nullptr);
  EXPECT_NE(cache.Find(3), nullptr);
  EXPECT_NE(cache.Find(4), nullptr);
  EXPECT_NE(cache.Find(5), nullptr);
}

TEST(LruCacheTest, InsertingAnExistingKeyReplacesItsValue) {
  LruCache<int, std::string> cache(2);
  cache.Insert(1, "one");
  cache.Insert(2, "two");
  EXPECT_EQ(cache.Insert(1, "uno"), "uno");  // also a use of 1
  EXPECT_EQ(cache.size(), 2u);
  cache.Insert(3, "three");  // drops 2, the least recent
  EXPECT_EQ(cache.Find(2), nullptr);
  ASSERT_NE(cache.Find(1), nullptr);
  EXPECT_EQ(*cache.Find(1), "uno");
}

TEST(LruCacheTest, DestroysDroppedValuesAndHoldsMoveOnlyOnes) {
  auto watched = std::make_shared<int>(7);
  {
    LruCache<int, std::shared_ptr<int>> cache(1);
    cache.Insert(1, watched);
    EXPECT_EQ(watched.use_count(), 2);
    cache.Insert(2, nullptr);  // drops 1
    EXPECT_EQ(watched.use_count(), 1);
    cache.Insert(3, watched);
    EXPECT_EQ(watched.use_count(), 2);
  }
  EXPECT_EQ(watched.use_count(), 1);  // the cache's destructor

  LruCache<int, std::unique_ptr<int>> owners(2);
  owners.Insert(1, std::make_unique<int>(10));
  ASSERT_NE(owners.Find(1), nullptr);
  EXPECT_EQ(**owners.Find(1), 10);
}

TEST(LruCacheTest, ACapacityBelowOneHoldsOneEntry) {
  LruCache<int, int> cache(0);
  EXPECT_EQ(cache.capacity(), 1u);
  cache.Insert(1, 1);
  cache.Insert(2, 2);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.Find(1), nullptr);
  EXPECT_NE(cache.Find(2), nullptr);
}

}  // namespace
}  // namespace layerserve
