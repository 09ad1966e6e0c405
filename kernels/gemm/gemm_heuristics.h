// Every launch decision of the GEMMs as a pure function of the call and the
// device, in one place: the route a call takes (ChooseGemm, declared in
// layerserve/kernels/gemm.h with the M buckets it tunes by, defined here),
// then each version's sizing where its configuration leaves it open (0):
// version 4's K splits, version 3's tiles, version 6's kernel, token tile and
// K splits. The worked examples are Llama-3-8B's projections (qkv n 6144, o
// n 4096, gate/up n 28672 with k 4096; down n 4096, k 14336) on a 132-SM
// Hopper; tests/gpu/gemm_heuristics_test.cc checks each on the host. The
// measurements behind a rule are in the design record it names.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels::gemm {

// The M at which Autotune times M bucket `bucket`: its largest M, at most
// 8192 (the last bucket has no upper bound). Example: buckets up to 2048
// and up to 16384 are timed at 2048 and 8192.
int64_t GemmTunedM(int bucket);

// Version 0 (cuBLASLt): how many of its heuristic's answers Autotune times
// for an M bucket (at GemmTunedM), keeping the fastest as
// GemmConfig::cublaslt_answer, which every M of the bucket then runs. The
// first answer is not always the fastest: the best of the first 8 ran
// 1-10% faster at M = 2048 and 8192 on Llama-3-8B's shapes (H200; qkv at
// 8192 10%), and up to 7% at M = 64-128 (design record 0016).
inline constexpr int kCublasLtTunedAnswers = 8;

// Version 4 (M <= 64): the token count padded to the wgmma N it runs, 8, 16,
// 32 or 64.
int SmallMPad(int64_t m);

// Version 4's K splits for (n, k) on `num_sms` SMs: the fewest of 1, 2, 4
// whose CTAs (128-row W tiles x splits) cover the SMs, else 4 (design record
// 0008: 4-CTA clusters beat 8-CTA ones), at most one a 64-wide K block.
// Examples: qkv (48 tiles) 4, o (32 tiles) 4, gate/up (224 tiles) 1, down 4.
int SplitKHeuristic(int64_t n, int64_t k, int num_sms);
// The splits a version 4 call runs: the configuration's, else the rule above
// over the W rows it reads (a grouped product: n for every group that can
// have rows, at most one per row of A), never more than K's 64-wide blocks.
// Example: a Mixtral expert's gate/up (n 28672, 8 experts) at 1 token (2
// rows: two experts' W) 1 split; its down (n 4096, k 14336) at 1 token 4.
int SmallMSplits(const GemmParams& p, const GemmConfig& config, int num_sms);

// The tiles of `p` at block_n x block_m (versions 3 and 6's persistent
// kernels); for a grouped product, a bound.
int64_t TileBound(const DenseGemm& p, int block_n, int block_m);
// Version 3's row tile for block_m = 0: 128, or 64 for a grouped product
// whose groups average under 128 rows (design record 0009: 64-row tiles
// waste half as much of a sparsely filled tile, but move twice the W per
// flop). Example: Mixtral's experts at 128 tokens (256 rows, 8 groups) 64; at
// 1024 tokens 128.
int AutoBlockMV3(const DenseGemm& p);
// Version 3's tile width for block_n = 0: 256 unless 128 fills the SMs' last
// wave clearly better (by more than 5% of a wave); the wider tile moves a
// third less data per flop. Examples at M = 128 / 512 / 1024 / 2048: o 128,
// 128, 256, 256; qkv 128, 256, 128, 256; gate/up 256, 128, 256, 256.
int AutoBlockNV3(int64_t m, int64_t n, int num_sms);
struct V3Tiles {
  int block_n;
  int block_m;
};
// The tiles a version 3 call runs: the configuration's, else the rules
// above (a grouped product's width from its tile bound, since its row tiles
// are only known on the device).
V3Tiles ResolveV3Tiles(const DenseGemm& p, int block_n, int block_m, int num_sms);

// Version 6 (FP8): the decode kernel's token tile, the wgmma N (8, 16, 32, 64
// for m <= 64, padded up); 128, the prefill kernel's row tile, above.
int Fp8TokenTile(int64_t m);
// Whether version 6 runs `p` on its decode kernel: a dense product of m <= 64;
// a grouped one at block_m 64, or at block_m 0 where its groups hold at most
// kFp8GroupedDecodeRows rows (a CTA row per group with rows and token tile;
// the grid is launched for a bound on them, and the rows past the true count
// end at once, so the bound keeps those empty CTAs few). Else the prefill
// kernel.
inline constexpr int64_t kFp8GroupedDecodeRows = 128;
bool Fp8DecodeKernelTakes(const DenseGemm& p, int block_m);
// A grouped product's token tile on the decode kernel: the tile for twice
// the rows an expert with rows averages (min(groups, m) of them share m),
// within max_group_rows and 64. Larger groups take several tiles (slots).
// Example: Qwen3-30B-A3B's experts (128) at 8 tokens: 64 rows over 64
// experts, one an expert on average: tile 8.
int Fp8GroupedTokenTile(const DenseGemm& p);
// Version 6's K splits for M <= 64 (design record 0008's rule with K blocks
// of 128): the fewest of 1, 2, 4 whose CTAs (W tiles x splits) cover the
// SMs, else 4, keeping at least two K blocks per split; 1 above (the prefill
// kernel is persistent and takes no split). Examples: qkv 4, o 4 (of 8 K
// blocks each), gate/up 1, down 4 (of 28).
int Fp8SplitKHeuristic(int64_t m, int64_t n, int64_t k, int num_sms);
// The same for a call: a grouped product on the decode kernel counts the W
// tiles of every group that can have rows.
int Fp8Splits(const DenseGemm& p, int block_m, int num_sms);
// The splits a version 6 call runs: the configuration's, else Fp8Splits,
// never more than K's 128-wide blocks.
int Fp8ResolvedSplits(const DenseGemm& p, const GemmConfig& config, int num_sms);

}  // namespace layerserve::kernels::gemm
