// Device code of the paged KV cache's kernels (paged_attention.h): the append
// of a step's new K/V rows (alone, or with the rotary embedding of the step's
// q and k), the split-KV attention over the cache and the combine of split
// results. All address a position of a sequence the same way (KvRow).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/e4m3.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/pipeline_sm90.cuh"
#include "kernels/common/reduce.cuh"
#include "kernels/common/sm90_utils.cuh"
#include "kernels/rope/rope.cuh"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels::paged {

constexpr int kAppendThreads = 128;

// The sequence that packed row `token` belongs to: the last s with
// cu_seqlens[s] <= token. (Among empty sequences, which repeat an offset, the
// last one is the next non-empty one's predecessor, so the search lands on
// the sequence that holds the row.)
__device__ __forceinline__ int SequenceOf(const int32_t* cu_seqlens, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Row index (in rows of kv_width elements) of position `pos` in a layer's K
// or V pool, for a sequence whose block table is `table`.
__device__ __forceinline__ int64_t KvRow(const int32_t* table, int block_tokens, int pos) {
  return int64_t{table[pos / block_tokens]} * block_tokens + pos % block_tokens;
}

// Where the V code of key `slot` of a block goes within its head's row of
// block_tokens codes for one dimension: keys 16a .. 16a + 15 stay in their
// 16-byte group, ordered 0, 1, 8, 9, 2, 3, 10, 11, ..., so that bytes 4t ..
// 4t + 3 hold keys 2t, 2t + 1, 2t + 8, 2t + 9: the two key pairs a P V
// operand register of lane quad t needs (AccumulateCodes).
__host__ __device__ constexpr int ValueCodeSlot(int slot) {
  const int k = slot & 15;
  return (slot & ~15) | (4 * ((k & 7) >> 1) + (k & 1) + 2 * (k >> 3));
}

// Bytes of one FP8 V group (paged_attention.h): 16 keys' V codes of one KV
// head, then their 16 K and 16 V scales.
__host__ __device__ constexpr int ValueGroupBytes(int head_dim) { return 16 * (head_dim + 8); }

// An FP8 cache's append of one token (paged_attention.h's layout): every K
// and V head row of `kv` (the token's qkv row past its q heads: the K heads,
// then the V heads, already rotated) becomes its scale s = amax / 448 and
// the codes of x / s (kernels/common/e4m3.cuh, as the CPU cache computes
// them), stored at slot `slot` of block `block`; the row is overwritten with
// code * s rounded to T, the values the cache now holds. Eight lanes a head
// row (kElems elements each), so that the CTA's 128 threads take 16 rows at
// once: a decode step's whole token for Llama-3-8B's 8 KV heads, in one
// pass with a 3-step reduction.
template <typename T, int kHeadDim>
__device__ __forceinline__ void StoreKvCodes(T* kv, const PagedKv& cache, int64_t block, int slot, int kv_heads) {
  constexpr int kLanes = 8;
  constexpr int kElems = kHeadDim / kLanes;  // 16 or 8
  static_assert(kAppendThreads % kLanes == 0 && kElems % 4 == 0, "whole code words a lane");
  const int part = threadIdx.x % kLanes;
  const int64_t kv_width = int64_t{kv_heads} * kHeadDim;
  // Every thread runs every pass (the shuffles need the whole warp); rows
  // past the last are all zeros and store nothing.
  for (int h0 = 0; h0 < 2 * kv_heads; h0 += kAppendThreads / kLanes) {
    const int h = h0 + static_cast<int>(threadIdx.x) / kLanes;
    const bool active = h < 2 * kv_heads;
    const bool value = h >= kv_heads;
    const int head = value ? h - kv_heads : h;
    T* x = kv + int64_t{h} * kHeadDim + part * kElems;
    float v[kElems];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      v[i] = active ? ToFloat(x[i]) : 0.f;
      amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float s = amax / kE4m3MaxValue;
    uint32_t words[kElems / 4];
    E4m3Scale(s, /*bounded=*/true).Codes(v, words);
    if (!active) continue;
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      const auto code = static_cast<__nv_fp8_storage_t>((words[i / 4] >> (8 * (i % 4))) & 0xffu);
      x[i] = FromFloat<T>(__half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3))) * s);
    }
    // The token's V group: its head's group of 16 keys in the block.
    unsigned char* group =
        static_cast<unsigned char*>(cache.v) +
        ((block * kv_heads + head) * (cache.block_tokens / 16) + slot / 16) * int64_t{ValueGroupBytes(kHeadDim)};
    if (value) {
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        group[(part * kElems + i) * 16 + ValueCodeSlot(slot % 16)] =
            static_cast<unsigned char>(words[i / 4] >> (8 * (i % 4)));
      }
    } else {
      auto* codes = static_cast<unsigned char*>(cache.k) + (block * cache.block_tokens + slot) * kv_width +
                    int64_t{head} * kHeadDim + part * kElems;
#pragma unroll
      for (int w = 0; w < kElems / 4; ++w) reinterpret_cast<uint32_t*>(codes)[w] = words[w];
    }
    if (part == 0) reinterpret_cast<float*>(group + kHeadDim * 16)[(value ? 16 : 0) + slot % 16] = s;
  }
}

// RoPE and the append in one launch (LaunchRopeKvAppend), one CTA per packed
// token: the CTA computes its position's cos/sin as RopeKernel does, rotates
// every q and k head of its qkv row in place and, when its sequence has a
// block table, stores each rotated k chunk at the token's cache slot from the
// same registers, then copies the token's V row there (16 bytes per thread
// per step). Launched as a programmatic dependent of the QKV GEMM: it waits
// for the GEMM's rows before reading them, and lets the attention after it
// be scheduled at once.
template <typename T>
__global__ void __launch_bounds__(kAppendThreads) RopeKvAppendKernel(const RopeParams r, const KvAppendParams a) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  extern __shared__ float cos_sin[];
  AllowDependentLaunch();
  WaitForPrerequisiteGrids();
  const int half = r.head_dim / 2;
  const int token = blockIdx.x;
  rope::ComputeCosSin<T>(r.inv_freq, r.positions[token], half, cos_sin);

  const int s = SequenceOf(a.cu_seqlens, a.num_seqs, token);
  const int32_t table_begin = a.cache.cu_blocks[s];
  const bool keep = table_begin != a.cache.cu_blocks[s + 1];  // stateless rows are not stored
  const int64_t kv_width = int64_t{r.num_kv_heads} * r.head_dim;
  const bool codes = a.cache.fp8;
  int64_t dst = 0;
  int pos = 0;
  if (keep) {
    pos = a.cache.start[s] + (token - a.cu_seqlens[s]);
    dst = KvRow(a.cache.block_tables + table_begin, a.cache.block_tokens, pos) * kv_width;
  }
  T* k_dst = static_cast<T*>(a.cache.k) + dst;
  T* row = static_cast<T*>(r.qkv) + int64_t{token} * (r.num_heads + 2 * r.num_kv_heads) * r.head_dim;
  if (r.q_norm != nullptr) rope::NormHeads(row, r);
  rope::RotateRow(row, cos_sin, r.num_heads, r.num_kv_heads, r.head_dim,
                  [&](int kv_head, int i0, const V& x1, const V& x2) {
                    if (!keep || codes) return;
                    T* k_head = k_dst + kv_head * r.head_dim;
                    *reinterpret_cast<V*>(k_head + i0) = x1;
                    *reinterpret_cast<V*>(k_head + half + i0) = x2;
                  });
  if (!keep) return;
  if (codes) {
    __syncthreads();  // every rotated K head is in the row (keep and codes are the CTA's)
    const int block_tokens = a.cache.block_tokens;
    const int64_t block = a.cache.block_tables[table_begin + pos / block_tokens];
    T* kv = row + int64_t{r.num_heads} * r.head_dim;
    if (r.head_dim == 128) {
      StoreKvCodes<T, 128>(kv, a.cache, block, pos % block_tokens, r.num_kv_heads);
    } else {
      StoreKvCodes<T, 64>(kv, a.cache, block, pos % block_tokens, r.num_kv_heads);
    }
    return;
  }
  const T* v_src = row + (r.num_heads + r.num_kv_heads) * r.head_dim;
  T* v_dst = static_cast<T*>(a.cache.v) + dst;
  for (int64_t i = threadIdx.x * kVec; i < kv_width; i += kAppendThreads * kVec) {
    *reinterpret_cast<V*>(v_dst + i) = *reinterpret_cast<const V*>(v_src + i);
  }
}

// ---- Split-KV attention ----
//
// One CTA per (work item, KV head): 16 query rows (pairs of a new token and a
// query head of the KV head's group) against the item's keys, which stream
// through shared memory in tiles of kBlockN = 64 keys on a kStages-deep ring
// that a producer warp fills by TMA. Each of the 4 consumer warps takes 16
// keys of every tile (keys 16w .. 16w + 15) for all 16 rows: S = Q K^T and
// O += P V are one m16 tile of mma.sync each, and each warp keeps its own
// online softmax (running max m, sum l, output o) over the keys it saw. At
// the end the warps' results are merged through shared memory: with M the
// largest of the four maxima, O = sum_w 2^(m_w - M) o_w and L = sum_w
// 2^(m_w - M) l_w (scores in log2 units). An item that covers all of its
// rows' keys writes O / L rounded to T; a split item writes O / L and its
// log-sum-exp M + log2 L in fp32 for the combine kernel.
//
// Why this shape: a decode step is bound by reading K/V, and a KV head's G
// query heads all read the same rows, so a CTA that holds the whole group
// reads them once (the old one-warp-per-(query, head) kernel read them G
// times, one dependent key group at a time). Splitting the keys over warps
// rather than the rows keeps every warp busy when a tile has only G rows (4
// of 16 for Llama-3-8B decode: the tensor cores idle 3/4 of the time, which
// they can afford).
//
// The loads: a tile's keys sit in runs of g = gcd(block_tokens, 64) rows of
// one cache block (or of the step's qkv rows, for a stateless sequence), and
// each run is one TMA box of g rows x 64 columns per 64-column half of the
// head, K and V (16 boxes for a tile of blocks of 16 tokens at head_dim 128),
// landing in the 128-byte swizzle the ldmatrix reads are conflict-free in.
// The producer warp reads the block table a tile ahead and runs up to
// kStages tiles ahead of the consumers, on full / empty mbarriers: no
// consumer thread computes a key's address or waits on the table (the
// cp.async ring did both for 16 chunks a thread per tile, which cost ~2.5x
// the instructions of cuDNN's kernel at the same grid and left it short of
// the memory's rate; design record 0015).
//
// A session sequence's keys are all read from the cache, its new ones
// included (RopeKvAppend stored them before); a stateless sequence's from
// its own K and V rows. Rows of a box past the item's keys are whatever the
// cache or the rows hold there (another sequence's, or never written): their
// scores are masked, and the V rows of the tile's tail are zeroed before
// P V, so that no NaN there reaches the output through a zero probability.
constexpr int kPagedWarps = 4;  // consumer warps
constexpr int kPagedConsumerThreads = kPagedWarps * 32;
constexpr int kPagedThreads = kPagedConsumerThreads + 32;  // and the producer warp
constexpr int kPagedStages = 3;
constexpr int kCombineThreads = 128;
constexpr int kKvBoxCols = 64;  // one 128-byte swizzle row of 16-bit elements
static_assert(kPagedKeyTile == kPagedWarps * 16, "each warp takes 16 keys of a tile");
static_assert(kPagedQueryRows == 16, "a work item is one m16 tile");
using KvPipeline = gemm::TmaPipeline<kPagedStages>;
using KvStage = gemm::PipeState<kPagedStages>;

// Rows of one K/V box: gcd(block_tokens, 64), the longest run of keys that
// is one cache block's for any tile start (block_tokens & -block_tokens is
// its largest power-of-two divisor). The kernel's producer and the
// launcher's tensor maps both take it from here.
__host__ __device__ constexpr int PagedKvBoxRows(int block_tokens) {
  return (block_tokens & -block_tokens) < kPagedKeyTile ? (block_tokens & -block_tokens) : kPagedKeyTile;
}

// The four tensor maps of a launch: the layer's K and V pools as [num_blocks
// * block_tokens, kv_width] and the step's K and V rows as [tokens, kv_width]
// (row strides k_row_stride, v_row_stride), boxes of g rows x 64 columns.
struct PagedKvMaps {
  CUtensorMap k_pool;
  CUtensorMap v_pool;
  CUtensorMap k_rows;
  CUtensorMap v_rows;
};

template <int kHeadDim>
struct PagedTraits {
  static constexpr int kBlockN = kPagedKeyTile;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks
  static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of the output
  static constexpr int kHalves = kHeadDim / kKvBoxCols;
  static constexpr int kTileElems = kBlockN * kHeadDim;
  static constexpr int kTileBytes = kTileElems * 2;
  // The ring first (1024-byte aligned, as the swizzle needs): kStages (K, V)
  // tile pairs; then Q (a wide item's 64 rows; a narrow one uses the first
  // 16); then each stage's full and empty mbarriers. The merge reuses the
  // ring.
  static constexpr int kRingBytes = 2 * kPagedStages * kTileBytes;
  static constexpr int kQueryOffset = kRingBytes;
  static constexpr int kBarrierOffset = kQueryOffset + kPagedWideRows * kHeadDim * 2;
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kPagedStages * 8;
  // Byte offsets of stage s's K and V tiles in the ring.
  static constexpr __host__ __device__ int KTile(int s) { return 2 * s * kTileBytes; }
  static constexpr __host__ __device__ int VTile(int s) { return KTile(s) + kTileBytes; }
  // An FP8 cache's tile (PagedKv::fp8) in the same stage: the K codes
  // [64 keys][kHeadDim] under the TMA's swizzle (CodeSwizzle) in the K slot;
  // the tile's 4 V groups (V codes, K scales, V scales of 16 keys each, as
  // the cache holds them) in the V slot.
  static constexpr int kGroupBytes = ValueGroupBytes(kHeadDim);
  static_assert(kBlockN * kHeadDim <= kTileBytes && 4 * kGroupBytes <= kTileBytes, "an FP8 tile fits a stage");
  static constexpr int kMergeBytes = kPagedWarps * kPagedQueryRows * (kHeadDim + 2) * 4;
  static_assert(kMergeBytes <= kRingBytes, "the merge fits in the ring");
  static_assert(kHeadDim % kKvBoxCols == 0, "a head is whole 64-column boxes");
};

// Element offset of 16-byte chunk `chunk` of row `row` of the query tile (an
// XOR swizzle over the row's chunks, as the flash kernel's).
template <int kHeadDim>
__device__ __forceinline__ int PagedSwizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Element offset of 16-byte chunk `chunk` of key `row` in a K or V tile as
// the TMA's 128-byte swizzle lays it out: [half][key][64 columns], the 8
// chunks of a 128-byte row permuted by the key's row within 8.
__device__ __forceinline__ int KvSwizzle(int row, int chunk) {
  return (chunk >> 3) * (kPagedKeyTile * kKvBoxCols) + row * kKvBoxCols + (((chunk & 7) ^ (row & 7)) << 3);
}

// Byte offset of 16-byte chunk `chunk` of key `key`'s codes in an FP8 K
// tile, as the TMA's swizzle lays it out: 128-byte rows under the 128-byte
// swizzle at head_dim 128, 64-byte rows under the 64-byte swizzle at 64. So
// the 8 keys a ScoreCodes load reads at one chunk sit in 8 distinct bank
// groups.
template <int kHeadDim>
__device__ __forceinline__ int CodeSwizzle(int key, int chunk) {
  if constexpr (kHeadDim == 128) {
    return key * 128 + ((chunk ^ (key & 7)) << 4);
  } else {
    return key * 64 + ((chunk ^ ((key >> 1) & 3)) << 4);
  }
}

// The four codes of `word` as two fp16 pairs (exact: every e4m3 value is an
// fp16): lo from bytes 0, 1, hi from bytes 2, 3, the first of each in the
// low half. Two conversion instructions; the FP8 tiles multiply in fp16
// whatever the activation dtype, since bf16 has no conversion from e4m3
// (design record 0017).
__device__ __forceinline__ void CodesToHalf2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

// The probabilities times their V scales are scaled by this before their
// rounding to fp16 (the scales are small: amax / 448), and the row sums
// with them, so that O / L is unchanged: 2^12 keeps P * scale within fp16's
// normal range for |V| up to 7168 and above its subnormals past 1.5e-8.
inline constexpr float kValueCodeScale = 4096.f;

// ---- Pieces both tiles share ----

// What a work item attends: its sequence's packing, cache position and
// table, and the key range it reads, [begin, end) in tiles of kBlockN (the
// tiles wholly below the window of the item's first query skipped).
struct ItemContext {
  int group;             // query heads per KV head
  int first_row;         // the sequence's first packed row
  int q_rows;            // its valid query rows (new tokens x group)
  int start;             // position of its first new token
  const int32_t* table;  // its block table
  bool pooled;           // a session sequence (a table): every key from the cache
  int key_begin;
  int key_end;
  int n_tiles;
};

__device__ __forceinline__ ItemContext ContextOf(const PagedAttentionParams& p, const PagedWorkItem& item) {
  ItemContext c;
  c.group = p.num_heads / p.num_kv_heads;
  c.first_row = p.cu_seqlens[item.seq];
  c.q_rows = (p.cu_seqlens[item.seq + 1] - c.first_row) * c.group;
  c.start = p.cache.start[item.seq];
  const int32_t table_begin = p.cache.cu_blocks[item.seq];
  c.table = p.cache.block_tables + table_begin;
  c.pooled = p.cache.cu_blocks[item.seq + 1] != table_begin;
  c.key_begin = item.kv_begin;
  if (p.window > 0) {
    const int lo = c.start + item.q_row0 / c.group - p.window + 1;
    if (lo > c.key_begin) c.key_begin += (lo - c.key_begin) / kPagedKeyTile * kPagedKeyTile;
  }
  c.key_end = item.kv_end;
  c.n_tiles = c.key_end > c.key_begin ? (c.key_end - c.key_begin + kPagedKeyTile - 1) / kPagedKeyTile : 0;
  return c;
}

// Starts the async copy of kRows query rows from item.q_row0 (row r is token
// r / G, head r % G of the KV head's group) by the consumer threads; rows
// past the sequence's are zero-filled and never written back.
template <typename T, int kHeadDim, int kRows>
__device__ __forceinline__ void LoadQueryRows(T* sQ, const PagedAttentionParams& p, const PagedWorkItem& item,
                                              const ItemContext& c, int kv_head, int tid) {
  constexpr int kChunksPerRow = PagedTraits<kHeadDim>::kChunksPerRow;
  for (int idx = tid; idx < kRows * kChunksPerRow; idx += kPagedConsumerThreads) {
    const int r = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const int row = item.q_row0 + r;
    const bool valid = row < c.q_rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      src += int64_t{c.first_row + row / c.group} * p.q_row_stride +
             int64_t{kv_head * c.group + row % c.group} * kHeadDim + chunk * 8;
    }
    CpAsync16(sQ + PagedSwizzle<kHeadDim>(r, chunk), src, valid);
  }
  CpAsyncCommit();
}

// The producer warp: fills the ring with the item's key tiles, each a box of
// `box` keys per (K or V, 64-column half) at a time, lane b issuing the boxes
// b, b + 32, ... of a tile (box >= 1, so at most 64 boxes: two a lane). The
// boxes' source rows (cache rows through the table, or the step's rows) are
// read a tile ahead. Boxes wholly past the keys are not loaded; the tile's
// expected bytes count the rest.
template <int kHeadDim>
__device__ __forceinline__ void ProduceKvTiles(const PagedAttentionParams& p, const PagedKvMaps& maps,
                                               const ItemContext& c, uint32_t ring, const KvPipeline& pipe, int kv_head,
                                               int lane) {
  using Traits = PagedTraits<kHeadDim>;
  const int bt = p.cache.block_tokens;
  const int box = PagedKvBoxRows(bt);
  const int boxes = kPagedKeyTile / box;
  const CUtensorMap* map_k = c.pooled ? &maps.k_pool : &maps.k_rows;
  const CUtensorMap* map_v = c.pooled ? &maps.v_pool : &maps.v_rows;
  // Source row of box b of tile t (valid for keys below key_end).
  const auto source_row = [&](int t, int b) {
    const int j = c.key_begin + t * kPagedKeyTile + b * box;
    if (j >= c.key_end) return 0;
    return c.pooled ? c.table[j / bt] * bt + j % bt : c.first_row + j;
  };
  int rows[2] = {source_row(0, lane), source_row(0, lane + 32)};
  KvStage stage;
  for (int t = 0; t < c.n_tiles; ++t, stage.Advance()) {
    const int key0 = c.key_begin + t * kPagedKeyTile;
    const int live = min(boxes, (c.key_end - key0 + box - 1) / box);
    // Lane 0 waits for the consumers to free the stage and announces its
    // bytes; the warp's boxes go after that.
    if (lane == 0) pipe.ProducerAcquire(stage, static_cast<uint32_t>(live * box * 128 * Traits::kHalves * 2));
    __syncwarp();
    const uint32_t full = pipe.FullBarrier(stage);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
      if (b < live) {
#pragma unroll
        for (int h = 0; h < Traits::kHalves; ++h) {
          const uint32_t offset = static_cast<uint32_t>(h * kPagedKeyTile * 128 + b * box * 128);
          const int col = kv_head * kHeadDim + h * kKvBoxCols;
          gemm::TmaLoad2d(ring + Traits::KTile(stage.index) + offset, map_k, full, col, rows[i]);
          gemm::TmaLoad2d(ring + Traits::VTile(stage.index) + offset, map_v, full, col, rows[i]);
        }
      }
    }
    rows[0] = source_row(t + 1, lane);
    rows[1] = source_row(t + 1, lane + 32);
  }
}

// The producer warp for a session sequence of an FP8 cache: per tile, the
// K codes of each run of `box` keys (one TMA box of box x kHeadDim bytes),
// and each of its V groups of 16 keys (one bulk copy: the V codes and both
// scales). Lane b issues K box b and group b; a group lies in one cache
// block, since block_tokens is a multiple of 16. The block ids are read a
// tile ahead.
template <int kHeadDim>
__device__ __forceinline__ void ProduceCodeTiles(const PagedAttentionParams& p, const PagedKvMaps& maps,
                                                 const ItemContext& c, uint32_t ring, const KvPipeline& pipe,
                                                 int kv_head, int lane) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kRun = 16;
  const int bt = p.cache.block_tokens;
  const int box = PagedKvBoxRows(bt);
  const int boxes = kPagedKeyTile / box;
  const auto* groups = static_cast<const unsigned char*>(p.cache.v);
  // The block and slot of the key that lane's K box (k_*) and group (g_*)
  // start at in tile t.
  const auto locate = [&](int t, int per_lane, int32_t* block, int32_t* slot) {
    const int j = c.key_begin + t * kPagedKeyTile + lane * per_lane;
    *block = j < c.key_end ? c.table[j / bt] : 0;
    *slot = j % bt;
  };
  int32_t k_block, k_slot, g_block, g_slot;
  locate(0, box, &k_block, &k_slot);
  locate(0, kRun, &g_block, &g_slot);
  KvStage stage;
  for (int t = 0; t < c.n_tiles; ++t, stage.Advance()) {
    const int key0 = c.key_begin + t * kPagedKeyTile;
    const int live_boxes = min(boxes, (c.key_end - key0 + box - 1) / box);
    const int live_groups = min(kPagedKeyTile / kRun, (c.key_end - key0 + kRun - 1) / kRun);
    if (lane == 0) {
      pipe.ProducerAcquire(stage,
                           static_cast<uint32_t>(live_boxes * box * kHeadDim + live_groups * Traits::kGroupBytes));
    }
    __syncwarp();
    const uint32_t full = pipe.FullBarrier(stage);
    if (lane < live_boxes) {
      gemm::TmaLoad2d(ring + Traits::KTile(stage.index) + lane * box * kHeadDim, &maps.k_pool, full, kv_head * kHeadDim,
                      k_block * bt + k_slot);
    }
    if (lane < live_groups) {
      const int64_t group = (int64_t{g_block} * p.num_kv_heads + kv_head) * (bt / kRun) + g_slot / kRun;
      gemm::BulkLoad(ring + Traits::VTile(stage.index) + lane * Traits::kGroupBytes,
                     groups + group * Traits::kGroupBytes, Traits::kGroupBytes, full);
    }
    locate(t + 1, box, &k_block, &k_slot);
    locate(t + 1, kRun, &g_block, &g_slot);
  }
}

// A warp zeroes V rows [from, to) of a tile: the rows past the item's keys
// that it reads (a NaN there would turn a zero probability into a NaN
// output). Only in an item's last tile, which no TMA writes again.
template <typename T, int kHeadDim>
__device__ __forceinline__ void ZeroValueRows(T* sVs, int from, int to, int lane) {
  constexpr int kChunksPerRow = PagedTraits<kHeadDim>::kChunksPerRow;
  for (int idx = from * kChunksPerRow + lane; idx < to * kChunksPerRow; idx += 32) {
    *reinterpret_cast<uint4*>(sVs + KvSwizzle(idx / kChunksPerRow, idx % kChunksPerRow)) = make_uint4(0, 0, 0, 0);
  }
  __syncwarp();
}

// The A fragments of the m16 query tile at rows row0 .. row0 + 15 of sQ, for
// every k16 step of the head dimension (once the query rows have landed).
template <typename T, int kHeadDim>
__device__ __forceinline__ void LoadQueryFragments(uint32_t (&q_frag)[PagedTraits<kHeadDim>::kKSteps][4], const T* sQ,
                                                   int row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < PagedTraits<kHeadDim>::kKSteps; ++kk) {
    LdMatrixX4(q_frag[kk], sQ + PagedSwizzle<kHeadDim>(row0 + (lane & 15), kk * 2 + (lane >> 4)));
  }
}

// The A fragments of the m16 query tile at rows row0 .. row0 + 15 for
// ScoreCodes, in fp16 (saturating at 65504): per k16 step kk, lane quad t
// holds dimensions 16 kk + 4t .. 4t + 3 (registers 0, 1: the first pair of
// rows g and g + 8; 2, 3: the second), where LoadQueryFragments gives it
// 2t, 2t + 1 and 2t + 8, 2t + 9, so that one 4-byte load of K codes is a
// lane's whole B fragment.
template <typename T, int kHeadDim>
__device__ __forceinline__ void LoadQueryFragmentsForCodes(uint32_t (&q_frag)[PagedTraits<kHeadDim>::kKSteps][4],
                                                           const T* sQ, int row0, int lane) {
  const int t = lane & 3;
  const auto half = [](T x) { return fminf(fmaxf(ToFloat(x), -65504.f), 65504.f); };
#pragma unroll
  for (int kk = 0; kk < PagedTraits<kHeadDim>::kKSteps; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const T* q = sQ + PagedSwizzle<kHeadDim>(row0 + (lane >> 2) + 8 * h, 2 * kk + (t >> 1)) + 4 * (t & 1);
      q_frag[kk][h] = PackPair<__half>(half(q[0]), half(q[1]));
      q_frag[kk][2 + h] = PackPair<__half>(half(q[2]), half(q[3]));
    }
  }
}

// ScoreKeys over an FP8 tile: the same scores (keys 16g + 8nt + 2t, + 1 in
// tile 2g + nt), each lane's B fragment one 4-byte load of its key's codes
// (dimensions 16 kk + 4t .. 4t + 3, matching LoadQueryFragmentsForCodes),
// then every score times its key's K scale, from the key's V group.
template <int kHeadDim, int kN16>
__device__ __forceinline__ void ScoreCodes(float (&acc_s)[2 * kN16][4],
                                           const uint32_t (&q_frag)[PagedTraits<kHeadDim>::kKSteps][4],
                                           const unsigned char* sK, const unsigned char* sGroups, int key_row0,
                                           int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < PagedTraits<kHeadDim>::kKSteps; ++kk) {
#pragma unroll
    for (int g = 0; g < kN16; ++g) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int key = key_row0 + g * 16 + nt * 8 + (lane >> 2);
        const uint32_t word = *reinterpret_cast<const uint32_t*>(sK + CodeSwizzle<kHeadDim>(key, kk) + 4 * t);
        uint32_t b0, b1;
        CodesToHalf2(word, b0, b1);
        MmaM16N8K16<__half>(acc_s[2 * g + nt], q_frag[kk], b0, b1);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kN16; ++g) {
    const float* k_scales = reinterpret_cast<const float*>(
        sGroups + (key_row0 / 16 + g) * PagedTraits<kHeadDim>::kGroupBytes + kHeadDim * 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 ks = *reinterpret_cast<const float2*>(k_scales + nt * 8 + 2 * t);
      acc_s[2 * g + nt][0] *= ks.x;
      acc_s[2 * g + nt][1] *= ks.y;
      acc_s[2 * g + nt][2] *= ks.x;
      acc_s[2 * g + nt][3] *= ks.y;
    }
  }
}

// S = Q K^T over kN16 groups of 16 keys from stage row key_row0: n8 score
// tiles 2g (keys 16g .. 16g + 7) and 2g + 1 (16g + 8 .. 16g + 15).
template <typename T, int kHeadDim, int kN16>
__device__ __forceinline__ void ScoreKeys(float (&acc_s)[2 * kN16][4],
                                          const uint32_t (&q_frag)[PagedTraits<kHeadDim>::kKSteps][4], const T* sKs,
                                          int key_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < PagedTraits<kHeadDim>::kKSteps; ++kk) {
#pragma unroll
    for (int g = 0; g < kN16; ++g) {
      uint32_t b[4];
      const int row = key_row0 + g * 16 + (lane & 7) + ((lane >> 4) << 3);
      LdMatrixX4(b, sKs + KvSwizzle(row, kk * 2 + ((lane >> 3) & 1)));
      MmaM16N8K16<T>(acc_s[2 * g], q_frag[kk], b[0], b[1]);
      MmaM16N8K16<T>(acc_s[2 * g + 1], q_frag[kk], b[2], b[3]);
    }
  }
}

// -inf for every score of keys key0 .. key0 + 8 kNTiles - 1 past the range,
// after its row's query (positions q_pos of the thread's rows g and g + 8),
// or below its window.
template <int kNTiles>
__device__ __forceinline__ void MaskScores(float (&acc_s)[kNTiles][4], int key0, int quad_col, const int (&q_pos)[2],
                                           int key_end, int window) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = q_pos[e >> 1];
      const int key = key0 + nt * 8 + quad_col + (e & 1);
      if (key >= key_end || key > pos || (window > 0 && pos - key >= window)) acc_s[nt][e] = -INFINITY;
    }
}

// The online softmax over new scores (rows g and g + 8 of the thread): the
// running max and sum, the output rescaled, the scores turned into
// probabilities in place. A row that has seen no key yet keeps max -inf; its
// scale base is 0 so that 2^(-inf - base) = 0 rather than NaN.
template <int kNTiles, int kDTiles>
__device__ __forceinline__ void SoftmaxStep(float (&acc_s)[kNTiles][4], float (&acc_o)[kDTiles][4], float (&row_max)[2],
                                            float (&row_sum)[2], float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * h], acc_s[nt][2 * h + 1]));
    mx = QuadReduceMax(mx);
    const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
    const float correction = FastExp2(row_max[h] * scale_log2 - base);
    row_max[h] = mx;
    row_sum[h] *= correction;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      acc_o[dt][2 * h] *= correction;
      acc_o[dt][2 * h + 1] *= correction;
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        const float prob = FastExp2(acc_s[nt][e] * scale_log2 - base);
        acc_s[nt][e] = prob;
        row_sum[h] += prob;
      }
  }
}

// O += P V over the kN16 groups of 16 keys ScoreKeys scored: each pair of n8
// probability tiles is one k16 A fragment.
template <typename T, int kHeadDim, int kN16>
__device__ __forceinline__ void AccumulateValues(float (&acc_o)[PagedTraits<kHeadDim>::kDTiles][4],
                                                 const float (&acc_s)[2 * kN16][4], const T* sVs, int key_row0,
                                                 int lane) {
#pragma unroll
  for (int g = 0; g < kN16; ++g) {
    uint32_t a[4];
    a[0] = PackPair<T>(acc_s[2 * g][0], acc_s[2 * g][1]);
    a[1] = PackPair<T>(acc_s[2 * g][2], acc_s[2 * g][3]);
    a[2] = PackPair<T>(acc_s[2 * g + 1][0], acc_s[2 * g + 1][1]);
    a[3] = PackPair<T>(acc_s[2 * g + 1][2], acc_s[2 * g + 1][3]);
#pragma unroll
    for (int dp = 0; dp < PagedTraits<kHeadDim>::kDTiles / 2; ++dp) {
      uint32_t b[4];
      const int row = key_row0 + g * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      LdMatrixX4Trans(b, sVs + KvSwizzle(row, dp * 2 + (lane >> 4)));
      MmaM16N8K16<T>(acc_o[2 * dp], a, b[0], b[1]);
      MmaM16N8K16<T>(acc_o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// AccumulateValues over an FP8 tile, in fp16: each probability times its
// key's V scale and kValueCodeScale before the rounding (a key at or past
// `valid`, the tile's keys in range, gets 0: its probability is 0 and its
// scale anything, and its codes, which may be NaN, are zeroed in the
// operand), and each lane's B fragment one 4-byte load of the transposed V
// codes, whose bytes 4t .. 4t + 3 are keys 2t, 2t + 1, 2t + 8, 2t + 9 of
// the group (ValueCodeSlot).
template <int kHeadDim, int kN16>
__device__ __forceinline__ void AccumulateCodes(float (&acc_o)[PagedTraits<kHeadDim>::kDTiles][4],
                                                const float (&acc_s)[2 * kN16][4], const unsigned char* sGroups,
                                                int key_row0, int valid, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int g = 0; g < kN16; ++g) {
    const int k0 = key_row0 + g * 16 + 2 * t;  // this lane's keys: k0, k0 + 1, k0 + 8, k0 + 9
    const unsigned char* group = sGroups + (key_row0 / 16 + g) * PagedTraits<kHeadDim>::kGroupBytes;
    const float* v_scales = reinterpret_cast<const float*>(group + kHeadDim * 16) + 16;
    const float2 lo = *reinterpret_cast<const float2*>(v_scales + 2 * t);
    const float2 hi = *reinterpret_cast<const float2*>(v_scales + 8 + 2 * t);
    const float s0 = k0 < valid ? lo.x * kValueCodeScale : 0.f;
    const float s1 = k0 + 1 < valid ? lo.y * kValueCodeScale : 0.f;
    const float s2 = k0 + 8 < valid ? hi.x * kValueCodeScale : 0.f;
    const float s3 = k0 + 9 < valid ? hi.y * kValueCodeScale : 0.f;
    uint32_t a[4];
    a[0] = PackPair<__half>(acc_s[2 * g][0] * s0, acc_s[2 * g][1] * s1);
    a[1] = PackPair<__half>(acc_s[2 * g][2] * s0, acc_s[2 * g][3] * s1);
    a[2] = PackPair<__half>(acc_s[2 * g + 1][0] * s2, acc_s[2 * g + 1][1] * s3);
    a[3] = PackPair<__half>(acc_s[2 * g + 1][2] * s2, acc_s[2 * g + 1][3] * s3);
    // The tile's tail: the operand halves of keys past the range.
    const bool tail = key_row0 + g * 16 + 16 > valid;
    const uint32_t mask0 = (k0 < valid ? 0xffffu : 0u) | (k0 + 1 < valid ? 0xffff0000u : 0u);
    const uint32_t mask1 = (k0 + 8 < valid ? 0xffffu : 0u) | (k0 + 9 < valid ? 0xffff0000u : 0u);
#pragma unroll
    for (int dt = 0; dt < PagedTraits<kHeadDim>::kDTiles; ++dt) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(group + (dt * 8 + (lane >> 2)) * 16 + 4 * t);
      uint32_t b0, b1;
      CodesToHalf2(word, b0, b1);
      if (tail) {
        b0 &= mask0;
        b1 &= mask1;
      }
      MmaM16N8K16<__half>(acc_o[dt], a, b0, b1);
    }
  }
}

// A narrow item: 16 rows, the consumer warps splitting each key tile
// (above).
// kCodes: the item's keys come from an FP8 cache's tiles.
template <typename T, int kHeadDim, bool kCodes>
__device__ __forceinline__ void PagedNarrowTile(const PagedAttentionParams& p, const PagedWorkItem& item,
                                                const ItemContext& c, const KvPipeline& pipe, unsigned char* smem_raw) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kDTiles = Traits::kDTiles;
  const int kv_head = blockIdx.y;
  T* sQ = reinterpret_cast<T*>(smem_raw + Traits::kQueryOffset);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int quad_row = lane >> 2;
  const int quad_col = (lane & 3) * 2;

  LoadQueryRows<T, kHeadDim, kPagedQueryRows>(sQ, p, item, c, kv_head, tid);
  // Positions of this thread's two rows (g and g + 8) and of the CTA's first
  // and last valid row: the causal and window bounds of every score.
  int q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) q_pos[h] = c.start + (item.q_row0 + quad_row + 8 * h) / c.group;
  const int last_row = min(item.q_row0 + kPagedQueryRows, c.q_rows) - 1;
  const int min_pos = c.start + item.q_row0 / c.group;
  const int max_pos = c.start + last_row / c.group;

  float acc_o[kDTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint32_t q_frag[kKSteps][4];
  CpAsyncWait<0>();
  gemm::NamedBarrierSync(1, kPagedConsumerThreads);
  if constexpr (kCodes) {
    LoadQueryFragmentsForCodes<T, kHeadDim>(q_frag, sQ, 0, lane);
  } else {
    LoadQueryFragments<T, kHeadDim>(q_frag, sQ, 0, lane);
  }

  KvStage stage;
  for (int t = 0; t < c.n_tiles; ++t, stage.Advance()) {
    pipe.ConsumerWait(stage);
    unsigned char* k_slot = smem_raw + Traits::KTile(stage.index);
    unsigned char* v_slot = smem_raw + Traits::VTile(stage.index);
    const int key0 = c.key_begin + t * kPagedKeyTile + warp * 16;  // this warp's first key
    float acc_s[2][4] = {};
    if constexpr (kCodes) {
      ScoreCodes<kHeadDim, 1>(acc_s, q_frag, k_slot, v_slot, warp * 16, lane);
    } else {
      // The tail past the keys, in this warp's 16 rows.
      if (key0 + 16 > c.key_end) {
        ZeroValueRows<T, kHeadDim>(reinterpret_cast<T*>(v_slot), max(warp * 16, c.key_end - (key0 - warp * 16)),
                                   warp * 16 + 16, lane);
      }
      ScoreKeys<T, kHeadDim, 1>(acc_s, q_frag, reinterpret_cast<const T*>(k_slot), warp * 16, lane);
    }
    // Only tiles that reach past the first query or the range, or below the
    // last query's window, need the mask.
    if (key0 + 15 > min_pos || key0 + 15 >= c.key_end || (p.window > 0 && key0 <= max_pos - p.window)) {
      MaskScores(acc_s, key0, quad_col, q_pos, c.key_end, p.window);
    }
    SoftmaxStep(acc_s, acc_o, row_max, row_sum, scale_log2);
    if constexpr (kCodes) {
      AccumulateCodes<kHeadDim, 1>(acc_o, acc_s, v_slot, warp * 16, c.key_end - (key0 - warp * 16), lane);
    } else {
      AccumulateValues<T, kHeadDim, 1>(acc_o, acc_s, reinterpret_cast<const T*>(v_slot), warp * 16, lane);
    }
    pipe.ConsumerRelease(stage);
  }
  // An FP8 tile's O carries kValueCodeScale (AccumulateCodes); so does L.
  if constexpr (kCodes) {
    row_sum[0] *= kValueCodeScale;
    row_sum[1] *= kValueCodeScale;
  }

  // Merge the warps through shared memory (the ring is free once every
  // consumer warp has left the loop: every tile has landed and been read).
  gemm::NamedBarrierSync(1, kPagedConsumerThreads);
  float* sO = reinterpret_cast<float*>(smem_raw);             // [warps][16][kHeadDim]
  float* sM = sO + kPagedWarps * kPagedQueryRows * kHeadDim;  // [warps][16], log2 units
  float* sL = sM + kPagedWarps * kPagedQueryRows;             // [warps][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = quad_row + 8 * h;
    const float sum = QuadReduceSum(row_sum[h]);
    if ((lane & 3) == 0) {
      sM[warp * kPagedQueryRows + r] = row_max[h] == -INFINITY ? -INFINITY : row_max[h] * scale_log2;
      sL[warp * kPagedQueryRows + r] = sum;
    }
    float* o_row = sO + (warp * kPagedQueryRows + r) * kHeadDim;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      *reinterpret_cast<float2*>(o_row + dt * 8 + quad_col) = make_float2(acc_o[dt][2 * h], acc_o[dt][2 * h + 1]);
    }
  }
  gemm::NamedBarrierSync(1, kPagedConsumerThreads);

  // Each thread finishes 4 consecutive dimensions of a row at a time.
  constexpr int kGroups = kPagedQueryRows * kHeadDim / 4;
  for (int g = tid; g < kGroups; g += kPagedConsumerThreads) {
    const int r = g / (kHeadDim / 4);
    const int col = (g % (kHeadDim / 4)) * 4;
    const int row = item.q_row0 + r;
    if (row >= c.q_rows) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kPagedWarps; ++w) m_all = fmaxf(m_all, sM[w * kPagedQueryRows + r]);
    float l_all = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < kPagedWarps; ++w) {
      const float m_w = sM[w * kPagedQueryRows + r];
      const float f = m_w == -INFINITY ? 0.f : FastExp2(m_w - m_all);
      l_all += f * sL[w * kPagedQueryRows + r];
      const float4 o_w = *reinterpret_cast<const float4*>(sO + (w * kPagedQueryRows + r) * kHeadDim + col);
      o[0] += f * o_w.x;
      o[1] += f * o_w.y;
      o[2] += f * o_w.z;
      o[3] += f * o_w.w;
    }
    // A split may see none of a row's keys (all above it, or below its
    // window): it contributes l = 0 and log-sum-exp -inf.
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    if (item.partial_row0 < 0) {
      T* out = static_cast<T*>(p.out) + int64_t{c.first_row + row / c.group} * p.out_row_stride +
               int64_t{kv_head * c.group + row % c.group} * kHeadDim + col;
      uint2 packed;
      packed.x = PackPair<T>(o[0] * inv, o[1] * inv);
      packed.y = PackPair<T>(o[2] * inv, o[3] * inv);
      *reinterpret_cast<uint2*>(out) = packed;
    } else {
      const int64_t slot = int64_t{item.partial_row0 + r} * p.num_kv_heads + kv_head;
      *reinterpret_cast<float4*>(p.partial_out + slot * kHeadDim + col) =
          make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      if (col == 0) p.partial_lse[slot] = l_all > 0.f ? m_all + __log2f(l_all) : -INFINITY;
    }
  }
}

// A wide item (a prefill piece): 64 query rows, consumer warp w owning rows
// 16w .. 16w + 15 and every key of each tile, as flash attention's warps do:
// S = Q K^T is 8 n8 score tiles per warp, each warp keeps the online softmax
// of its own rows, and O needs no merge between warps. Never split, so it
// writes the output directly.
template <typename T, int kHeadDim, bool kCodes>
__device__ __forceinline__ void PagedWideTile(const PagedAttentionParams& p, const PagedWorkItem& item,
                                              const ItemContext& c, const KvPipeline& pipe, unsigned char* smem_raw) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kN16 = kPagedKeyTile / 16;  // 16-key groups per tile
  static_assert(kPagedWideRows == kPagedWarps * 16, "each warp owns one m16 row tile");
  const int kv_head = blockIdx.y;
  T* sQ = reinterpret_cast<T*>(smem_raw + Traits::kQueryOffset);  // [64][kHeadDim]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int quad_row = lane >> 2;
  const int quad_col = (lane & 3) * 2;

  LoadQueryRows<T, kHeadDim, kPagedWideRows>(sQ, p, item, c, kv_head, tid);
  // This thread's two rows (g and g + 8 of its warp's 16) and the bounds of
  // the warp's valid rows.
  const int warp_row0 = item.q_row0 + warp * 16;
  int q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) q_pos[h] = c.start + (warp_row0 + quad_row + 8 * h) / c.group;
  const int last_row = min(item.q_row0 + kPagedWideRows, c.q_rows) - 1;
  const int warp_min_pos = c.start + warp_row0 / c.group;
  const int warp_max_pos = c.start + min(warp_row0 + 15, last_row) / c.group;

  float acc_o[kDTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint32_t q_frag[kKSteps][4];
  CpAsyncWait<0>();
  gemm::NamedBarrierSync(1, kPagedConsumerThreads);
  if constexpr (kCodes) {
    LoadQueryFragmentsForCodes<T, kHeadDim>(q_frag, sQ, warp * 16, lane);
  } else {
    LoadQueryFragments<T, kHeadDim>(q_frag, sQ, warp * 16, lane);
  }

  KvStage stage;
  for (int t = 0; t < c.n_tiles; ++t, stage.Advance()) {
    pipe.ConsumerWait(stage);
    const int key0 = c.key_begin + t * kPagedKeyTile;
    unsigned char* k_slot = smem_raw + Traits::KTile(stage.index);
    unsigned char* v_slot = smem_raw + Traits::VTile(stage.index);
    // Every warp reads every V row: each zeroes the tail in its 16, then
    // all meet (the same condition for every consumer warp). An FP8 tile's
    // tail needs no zeroes (AccumulateCodes).
    if (!kCodes && key0 + kPagedKeyTile > c.key_end) {
      ZeroValueRows<T, kHeadDim>(reinterpret_cast<T*>(v_slot), max(warp * 16, c.key_end - key0), warp * 16 + 16, lane);
      gemm::NamedBarrierSync(1, kPagedConsumerThreads);
    }
    // A warp whose rows all come before the tile's keys, or whose window
    // ends below them, has nothing to do with it.
    if (!(key0 > warp_max_pos || (p.window > 0 && key0 + kPagedKeyTile - 1 <= warp_min_pos - p.window))) {
      float acc_s[2 * kN16][4] = {};
      if constexpr (kCodes) {
        ScoreCodes<kHeadDim, kN16>(acc_s, q_frag, k_slot, v_slot, 0, lane);
      } else {
        ScoreKeys<T, kHeadDim, kN16>(acc_s, q_frag, reinterpret_cast<const T*>(k_slot), 0, lane);
      }
      if (key0 + kPagedKeyTile - 1 > warp_min_pos || key0 + kPagedKeyTile - 1 >= c.key_end ||
          (p.window > 0 && key0 <= warp_max_pos - p.window)) {
        MaskScores(acc_s, key0, quad_col, q_pos, c.key_end, p.window);
      }
      SoftmaxStep(acc_s, acc_o, row_max, row_sum, scale_log2);
      if constexpr (kCodes) {
        AccumulateCodes<kHeadDim, kN16>(acc_o, acc_s, v_slot, 0, c.key_end - key0, lane);
      } else {
        AccumulateValues<T, kHeadDim, kN16>(acc_o, acc_s, reinterpret_cast<const T*>(v_slot), 0, lane);
      }
    }
    pipe.ConsumerRelease(stage);
  }
  if constexpr (kCodes) {  // as in PagedNarrowTile
    row_sum[0] *= kValueCodeScale;
    row_sum[1] *= kValueCodeScale;
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + quad_row + 8 * h;
    const float sum = QuadReduceSum(row_sum[h]);
    if (row >= c.q_rows) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* out = static_cast<T*>(p.out) + int64_t{c.first_row + row / c.group} * p.out_row_stride +
             int64_t{kv_head * c.group + row % c.group} * kHeadDim;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      *reinterpret_cast<uint32_t*>(out + dt * 8 + quad_col) =
          PackPair<T>(acc_o[dt][2 * h] * inv, acc_o[dt][2 * h + 1] * inv);
    }
  }
}

// One CTA per (work item, KV head): the producer warp fills the ring, the
// consumer warps take the item's tile, by its width. Hopper only (TMA and
// mbarriers); other device passes compile it empty (the launcher refuses
// builds without sm_90a).
// kCodes: the cache is FP8 (PagedKv::fp8), its session sequences read from
// its code tiles; stateless sequences read their own rows as ever.
template <typename T, int kHeadDim, bool kCodes>
__global__ void __launch_bounds__(kPagedThreads, 2)
    PagedAttentionKernel(const PagedAttentionParams p, const __grid_constant__ PagedKvMaps maps) {
#if LS_GEMM_DEVICE_SM90A
  AllowDependentLaunch();  // o_proj may start streaming its weights
  // Launched as a programmatic dependent of RopeKvAppend: its rotated rows
  // and cache writes are complete and visible past this point.
  WaitForPrerequisiteGrids();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const PagedWorkItem item = p.items[blockIdx.x];
  if (item.rows == 0) return;  // idle: padding of a plan sized for a CUDA graph
  const uint32_t ring = gemm::SmemAddr(smem_raw);
  const KvPipeline pipe(ring + PagedTraits<kHeadDim>::kBarrierOffset);
  if (threadIdx.x == 0) {
    if (ring % 1024 != 0) __trap();  // the swizzle's atoms would be misplaced
    pipe.Init(kPagedWarps);
  }
  __syncthreads();
  const ItemContext c = ContextOf(p, item);
  if (threadIdx.x >= kPagedConsumerThreads) {
    if (threadIdx.x == kPagedConsumerThreads) {
      gemm::PrefetchTensorMap(c.pooled ? &maps.k_pool : &maps.k_rows);
      gemm::PrefetchTensorMap(c.pooled ? &maps.v_pool : &maps.v_rows);
    }
    if (kCodes && c.pooled) {
      ProduceCodeTiles<kHeadDim>(p, maps, c, ring, pipe, blockIdx.y, threadIdx.x % 32);
    } else {
      ProduceKvTiles<kHeadDim>(p, maps, c, ring, pipe, blockIdx.y, threadIdx.x % 32);
    }
    return;
  }
  if (kCodes && c.pooled) {
    if (item.rows == kPagedWideRows) {
      PagedWideTile<T, kHeadDim, kCodes>(p, item, c, pipe, smem_raw);
    } else {
      PagedNarrowTile<T, kHeadDim, kCodes>(p, item, c, pipe, smem_raw);
    }
  } else if (item.rows == kPagedWideRows) {
    PagedWideTile<T, kHeadDim, false>(p, item, c, pipe, smem_raw);
  } else {
    PagedNarrowTile<T, kHeadDim, false>(p, item, c, pipe, smem_raw);
  }
#endif
}

// One CTA per (combine task, KV head), launched as a programmatic dependent
// of PagedAttentionKernel; a warp per row at a time, each lane
// kHeadDim / 32 dimensions. out = sum_s 2^(lse_s - M) o_s / sum_s
// 2^(lse_s - M), M the largest log-sum-exp: every row sees at least its own
// key in some split, so M is finite.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads) PagedCombineKernel(const PagedAttentionParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  // Launched as a programmatic dependent of the attention kernel: nothing
  // is read before its partial results are complete and visible.
  WaitForPrerequisiteGrids();
  AllowDependentLaunch();  // o_proj may start streaming its weights
  const PagedCombineTask task = p.combines[blockIdx.x];
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_row = p.cu_seqlens[task.seq];
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x / 32; r < task.rows; r += kCombineThreads / 32) {
    float m_all = -INFINITY;
    for (int s = lane; s < task.splits; s += 32) {
      m_all = fmaxf(m_all, p.partial_lse[int64_t{task.partial_row0 + s * task.rows + r} * p.num_kv_heads + kv_head]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m_all = fmaxf(m_all, __shfl_xor_sync(0xffffffffu, m_all, offset));
    float weight_sum = 0.f;
    float o[kPerLane] = {};
    for (int s = 0; s < task.splits; ++s) {
      const int64_t slot = int64_t{task.partial_row0 + s * task.rows + r} * p.num_kv_heads + kv_head;
      const float lse = p.partial_lse[slot];
      if (lse == -INFINITY) continue;
      const float w = FastExp2(lse - m_all);
      weight_sum += w;
      const float* src = p.partial_out + slot * kHeadDim + lane * kPerLane;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) o[e] += w * src[e];
    }
    const float inv = 1.f / weight_sum;
    const int row = task.q_row0 + r;
    T* out = static_cast<T*>(p.out) + int64_t{first_row + row / group} * p.out_row_stride +
             int64_t{kv_head * group + row % group} * kHeadDim + lane * kPerLane;
#pragma unroll
    for (int e = 0; e < kPerLane; e += 2) {
      *reinterpret_cast<uint32_t*>(out + e) = PackPair<T>(o[e] * inv, o[e + 1] * inv);
    }
  }
}

}  // namespace layerserve::kernels::paged
