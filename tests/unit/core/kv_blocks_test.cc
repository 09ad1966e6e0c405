// The KV block allocator and the block-table arithmetic: pure bookkeeping,
// every case a pool, a call, an expected count.
#include "server/core/kv_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace layerserve {
namespace {

TEST(BlocksForTokensTest, Boundaries) {
  EXPECT_EQ(BlocksForTokens(0, 16), 0);
  EXPECT_EQ(BlocksForTokens(1, 16), 1);
  EXPECT_EQ(BlocksForTokens(15, 16), 1);
  EXPECT_EQ(BlocksForTokens(16, 16), 1);  // exactly a block
  EXPECT_EQ(BlocksForTokens(17, 16), 2);  // one over
  EXPECT_EQ(BlocksForTokens(32, 16), 2);
  EXPECT_EQ(BlocksForTokens(33, 16), 3);
  EXPECT_EQ(BlocksForTokens(0, 1), 0);
  EXPECT_EQ(BlocksForTokens(7, 1), 7);
}

TEST(BlocksForTokensTest, DoesNotOverflowNearTheTop) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(BlocksForTokens(kMax, 1), kMax);
  EXPECT_EQ(BlocksForTokens(kMax, 2), kMax / 2 + 1);
  EXPECT_EQ(BlocksForTokens(kMax, kMax), 1);
}

TEST(KvSlotOfTest, MapsPositionsToTableEntryAndRow) {
  EXPECT_EQ(KvSlotOf(0, 16).table_index, 0);
  EXPECT_EQ(KvSlotOf(0, 16).row, 0);
  EXPECT_EQ(KvSlotOf(15, 16).table_index, 0);
  EXPECT_EQ(KvSlotOf(15, 16).row, 15);
  EXPECT_EQ(KvSlotOf(16, 16).table_index, 1);
  EXPECT_EQ(KvSlotOf(16, 16).row, 0);
  EXPECT_EQ(KvSlotOf(17, 16).table_index, 1);
  EXPECT_EQ(KvSlotOf(17, 16).row, 1);
  // Consistent with BlocksForTokens: token p needs p + 1 tokens' worth of blocks.
  for (int64_t p = 0; p < 100; ++p) {
    EXPECT_EQ(KvSlotOf(p, 7).table_index + 1, BlocksForTokens(p + 1, 7)) << p;
  }
}

TEST(KvBlockAllocatorTest, StartsEmptyAndCountsAllocations) {
  KvBlockAllocator pool(8);
  EXPECT_EQ(pool.capacity(), 8);
  EXPECT_EQ(pool.free_blocks(), 8);
  EXPECT_EQ(pool.used_blocks(), 0);

  std::vector<KvBlockId> table;
  ASSERT_TRUE(pool.Allocate(3, &table).ok());
  EXPECT_EQ(table, (std::vector<KvBlockId>{0, 1, 2}));
  EXPECT_EQ(pool.used_blocks(), 3);
  EXPECT_EQ(pool.free_blocks(), 5);
  for (KvBlockId id : table) EXPECT_TRUE(pool.IsAllocated(id));
  EXPECT_FALSE(pool.IsAllocated(3));
  EXPECT_FALSE(pool.IsAllocated(-1));
  EXPECT_FALSE(pool.IsAllocated(8));

  // Appends to the caller's table rather than replacing it.
  ASSERT_TRUE(pool.Allocate(2, &table).ok());
  EXPECT_EQ(table, (std::vector<KvBlockId>{0, 1, 2, 3, 4}));
}

TEST(KvBlockAllocatorTest, AllocatesAllOrNothing) {
  KvBlockAllocator pool(4);
  std::vector<KvBlockId> a;
  ASSERT_TRUE(pool.Allocate(3, &a).ok());

  std::vector<KvBlockId> b = {42};  // the caller's existing entries stay as they are
  const absl::Status s = pool.Allocate(2, &b);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "out of KV cache blocks: 2 needed, 1 of 4 free");
  EXPECT_EQ(b, (std::vector<KvBlockId>{42}));
  EXPECT_EQ(pool.free_blocks(), 1);

  // Exactly what is left succeeds.
  ASSERT_TRUE(pool.Allocate(1, &b).ok());
  EXPECT_EQ(pool.free_blocks(), 0);
  EXPECT_EQ(pool.Allocate(1, &b).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(pool.Allocate(0, &b).ok());  // nothing asked, nothing needed
}

TEST(KvBlockAllocatorTest, NegativeCountIsInvalid) {
  KvBlockAllocator pool(4);
  std::vector<KvBlockId> t;
  EXPECT_EQ(pool.Allocate(-1, &t).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(pool.free_blocks(), 4);
}

TEST(KvBlockAllocatorTest, EmptyPool) {
  KvBlockAllocator pool(0);
  std::vector<KvBlockId> t;
  EXPECT_TRUE(pool.Allocate(0, &t).ok());
  EXPECT_EQ(pool.Allocate(1, &t).message(), "out of KV cache blocks: 1 needed, 0 of 0 free");
}

TEST(KvBlockAllocatorTest, FreedBlocksAreReusedInTheSameOrder) {
  KvBlockAllocator pool(6);
  std::vector<KvBlockId> a, b;
  ASSERT_TRUE(pool.Allocate(2, &a).ok());  // 0 1
  ASSERT_TRUE(pool.Allocate(3, &b).ok());  // 2 3 4
  ASSERT_TRUE(pool.Free(b).ok());
  EXPECT_EQ(pool.used_blocks(), 2);
  std::vector<KvBlockId> c;
  ASSERT_TRUE(pool.Allocate(3, &c).ok());
  EXPECT_EQ(c, b);
}

TEST(KvBlockAllocatorTest, EveryBlockIsHandedOutOnceUntilFreed) {
  KvBlockAllocator pool(64);
  std::vector<KvBlockId> all;
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(pool.Allocate(8, &all).ok());
  std::vector<KvBlockId> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  for (KvBlockId i = 0; i < 64; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  EXPECT_EQ(pool.free_blocks(), 0);
  ASSERT_TRUE(pool.Free(all).ok());
  EXPECT_EQ(pool.free_blocks(), 64);
}

TEST(KvBlockAllocatorTest, BadFreesFreeNothingAndSaySo) {
  KvBlockAllocator pool(4);
  std::vector<KvBlockId> t;
  ASSERT_TRUE(pool.Allocate(2, &t).ok());  // 0 1

  absl::Status s = pool.Free(std::vector<KvBlockId>{0, 9});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "freeing KV block 9 outside the pool of 4 blocks");
  EXPECT_TRUE(pool.IsAllocated(0));  // the good id before the bad one stays allocated

  s = pool.Free(std::vector<KvBlockId>{1, 2});
  EXPECT_EQ(s.message(), "freeing KV block 2, which is not allocated (double free)");
  EXPECT_TRUE(pool.IsAllocated(1));

  s = pool.Free(std::vector<KvBlockId>{0, 0});  // listed twice
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(pool.IsAllocated(0));
  EXPECT_EQ(pool.used_blocks(), 2);

  EXPECT_EQ(pool.Free(std::vector<KvBlockId>{-1}).code(), absl::StatusCode::kInternal);

  ASSERT_TRUE(pool.Free(t).ok());
  EXPECT_EQ(pool.Free(t).code(), absl::StatusCode::kInternal);  // the same table twice
  EXPECT_EQ(pool.free_blocks(), 4);
}

}  // namespace
}  // namespace layerserve
