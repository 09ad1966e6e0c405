// The GEMMs' sizing rules (kernels/gemm/gemm_heuristics.h), each through its
// worked example: Llama-3-8B's projections (qkv n 6144, o n 4096, gate/up n
// 28672, all k 4096; down n 4096, k 14336), Mixtral's and Qwen3-30B-A3B's
// experts, on a 132-SM Hopper. Pure functions of the call and the SM count:
// no GPU needed. (The route itself, ChooseGemm, is gemm_tuning_test's.)
#include "kernels/gemm/gemm_heuristics.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace layerserve::kernels::gemm {
namespace {

constexpr int kSms = 132;
constexpr int64_t kQkv = 6144, kO = 4096, kGateUp = 28672, kHidden = 4096, kInter = 14336;

// Any non-null address stands for a grouped product's device offsets.
const int32_t* const kOffsets = reinterpret_cast<const int32_t*>(alignof(int32_t));

DenseGemm Dense(int64_t m, int64_t n, int64_t k) {
  DenseGemm p;
  p.m = m;
  p.n = n;
  p.k = k;
  return p;
}

DenseGemm Grouped(int64_t rows, int64_t n, int64_t k, int groups, int64_t max_group_rows) {
  DenseGemm p = Dense(rows, n, k);
  p.group_offsets = kOffsets;
  p.groups = groups;
  p.max_group_rows = max_group_rows;
  return p;
}

GemmParams GroupedParams(int64_t rows, int64_t n, int64_t k, int groups) {
  GemmParams p;
  p.m = rows;
  p.n = n;
  p.k = k;
  p.group_offsets = kOffsets;
  p.groups = groups;
  p.max_group_rows = rows;
  return p;
}

TEST(GemmHeuristicsTest, Version4SplitsCoverTheSmsWithTheFewestSplits) {
  EXPECT_EQ(SplitKHeuristic(kQkv, kHidden, kSms), 4);       // 48 W tiles
  EXPECT_EQ(SplitKHeuristic(kO, kHidden, kSms), 4);         // 32
  EXPECT_EQ(SplitKHeuristic(kGateUp, kHidden, kSms), 1);    // 224: the SMs are covered
  EXPECT_EQ(SplitKHeuristic(kHidden, kInter, kSms), 4);     // down: 32 tiles
  EXPECT_EQ(SplitKHeuristic(128 * 100, kHidden, kSms), 2);  // 100 tiles: 2 cover 132
  EXPECT_EQ(SplitKHeuristic(kO, 128, kSms), 2);             // never more than K's 64-wide blocks
}

TEST(GemmHeuristicsTest, Version4SplitsOfAGroupedProductCountTheGroupsThatCanHaveRows) {
  GemmConfig config;
  // Mixtral at one token: 2 rows, so two experts' W at most.
  EXPECT_EQ(SmallMSplits(GroupedParams(2, kGateUp, kHidden, 8), config, kSms), 1);  // 448 tiles
  EXPECT_EQ(SmallMSplits(GroupedParams(2, kHidden, kInter, 8), config, kSms), 4);   // 64 tiles
  // A configured count is kept, within K's blocks.
  config.split_k = 8;
  EXPECT_EQ(SmallMSplits(GroupedParams(2, kHidden, kInter, 8), config, kSms), 8);
  EXPECT_EQ(SmallMSplits(GroupedParams(2, kHidden, 256, 8), config, kSms), 4);
}

TEST(GemmHeuristicsTest, Version4PadsTokensToTheWgmmaN) {
  EXPECT_EQ(SmallMPad(1), 8);
  EXPECT_EQ(SmallMPad(8), 8);
  EXPECT_EQ(SmallMPad(9), 16);
  EXPECT_EQ(SmallMPad(17), 32);
  EXPECT_EQ(SmallMPad(33), 64);
  EXPECT_EQ(SmallMPad(64), 64);
}

TEST(GemmHeuristicsTest, Version3TileWidthFillsTheLastWave) {
  struct Case {
    int64_t m, n;
    int block_n;
  };
  for (const Case& c :
       {Case{128, kO, 128}, Case{512, kO, 128}, Case{1024, kO, 256}, Case{2048, kO, 256}, Case{128, kQkv, 128},
        Case{512, kQkv, 256}, Case{1024, kQkv, 128}, Case{2048, kQkv, 256}, Case{128, kGateUp, 256},
        Case{512, kGateUp, 128}, Case{1024, kGateUp, 256}, Case{2048, kGateUp, 256}, Case{8192, kGateUp, 256}}) {
    EXPECT_EQ(AutoBlockNV3(c.m, c.n, kSms), c.block_n) << "m " << c.m << " n " << c.n;
  }
}

TEST(GemmHeuristicsTest, Version3RowTileIsHalvedForSmallGroups) {
  EXPECT_EQ(AutoBlockMV3(Dense(256, kO, kHidden)), 128);
  // Mixtral's 8 experts at 128 tokens (256 rows: 32 an expert) and at 1024.
  EXPECT_EQ(AutoBlockMV3(Grouped(256, kGateUp, kHidden, 8, 256)), 64);
  EXPECT_EQ(AutoBlockMV3(Grouped(2048, kGateUp, kHidden, 8, 2048)), 128);
}

TEST(GemmHeuristicsTest, Version3KeepsConfiguredTilesAndSizesTheRest) {
  const V3Tiles configured = ResolveV3Tiles(Dense(512, kQkv, kHidden), 128, 128, kSms);
  EXPECT_EQ(configured.block_n, 128);
  EXPECT_EQ(configured.block_m, 128);
  const V3Tiles sized = ResolveV3Tiles(Dense(512, kQkv, kHidden), 0, 0, kSms);
  EXPECT_EQ(sized.block_n, 256);
  EXPECT_EQ(sized.block_m, 128);
  const V3Tiles grouped = ResolveV3Tiles(Grouped(256, kGateUp, kHidden, 8, 256), 0, 0, kSms);
  EXPECT_EQ(grouped.block_m, 64);
  // Its width from the tile bound: 256 / 128 + 8 partial row tiles, as M 1280.
  EXPECT_EQ(grouped.block_n, AutoBlockNV3(1280, kGateUp, kSms));
  EXPECT_EQ(TileBound(Grouped(256, kGateUp, kHidden, 8, 256), 256, 128), (2 + 8) * 112);
  EXPECT_EQ(TileBound(Dense(300, kO, kHidden), 128, 128), 3 * 32);
}

TEST(GemmHeuristicsTest, Version6TakesItsDecodeKernelUpTo64TokensAndTilesThem) {
  EXPECT_EQ(Fp8TokenTile(1), 8);
  EXPECT_EQ(Fp8TokenTile(16), 16);
  EXPECT_EQ(Fp8TokenTile(33), 64);
  EXPECT_EQ(Fp8TokenTile(65), 128);
  EXPECT_TRUE(Fp8DecodeKernelTakes(Dense(64, kO, kHidden), 0));
  EXPECT_FALSE(Fp8DecodeKernelTakes(Dense(65, kO, kHidden), 0));
  EXPECT_TRUE(Fp8DecodeKernelTakes(Grouped(1024, 1536, 2048, 128, kFp8GroupedDecodeRows), 0));
  EXPECT_FALSE(Fp8DecodeKernelTakes(Grouped(1024, 1536, 2048, 128, kFp8GroupedDecodeRows + 1), 0));
  EXPECT_TRUE(Fp8DecodeKernelTakes(Grouped(1024, 1536, 2048, 128, 1024), 64));
  EXPECT_FALSE(Fp8DecodeKernelTakes(Grouped(1024, 1536, 2048, 128, 8), 128));
}

TEST(GemmHeuristicsTest, Version6GroupedTokenTileIsTwiceAnExpertsAverageRows) {
  // Qwen3-30B-A3B: 128 experts, 8 a token. 8 tokens: 64 rows over at most 64
  // experts, one each on average, so tiles of 8; 256 tokens: 2048 rows over
  // 128, 16 each: 32; never past max_group_rows.
  EXPECT_EQ(Fp8GroupedTokenTile(Grouped(64, 1536, 2048, 128, 8)), 8);
  EXPECT_EQ(Fp8GroupedTokenTile(Grouped(2048, 1536, 2048, 128, 64)), 32);
  EXPECT_EQ(Fp8GroupedTokenTile(Grouped(2048, 1536, 2048, 128, 12)), 16);
}

TEST(GemmHeuristicsTest, Version6SplitsFollowVersion4sRuleInKBlocksOf128) {
  EXPECT_EQ(Fp8SplitKHeuristic(1, kQkv, kHidden, kSms), 4);
  EXPECT_EQ(Fp8SplitKHeuristic(1, kO, kHidden, kSms), 4);  // 8 K blocks: 2 a split
  EXPECT_EQ(Fp8SplitKHeuristic(1, kGateUp, kHidden, kSms), 1);
  EXPECT_EQ(Fp8SplitKHeuristic(64, kHidden, kInter, kSms), 4);
  EXPECT_EQ(Fp8SplitKHeuristic(65, kHidden, kInter, kSms), 1);  // the prefill kernel
  // At least two K blocks a split: 2 blocks take 1 split, 4 take 2, 8 take 4.
  EXPECT_EQ(Fp8SplitKHeuristic(1, kO, 256, kSms), 1);
  EXPECT_EQ(Fp8SplitKHeuristic(1, kO, 512, kSms), 2);
  EXPECT_EQ(Fp8SplitKHeuristic(1, kO, 1024, kSms), 4);
  // Qwen3's experts at 8 tokens: 64 experts' W tiles cover the SMs.
  EXPECT_EQ(Fp8Splits(Grouped(64, 1536, 2048, 128, 8), 0, kSms), 1);
  EXPECT_EQ(Fp8Splits(Dense(100, kO, kHidden), 0, kSms), 1);
  GemmConfig config;
  config.split_k = 8;
  EXPECT_EQ(Fp8ResolvedSplits(Dense(1, kO, 256), config, kSms), 2);  // 2 K blocks
  config.split_k = 0;
  EXPECT_EQ(Fp8ResolvedSplits(Dense(1, kO, kHidden), config, kSms), 4);
}

}  // namespace
}  // namespace layerserve::kernels::gemm
