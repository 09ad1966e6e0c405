// Device code of the paged KV cache's kernels (paged_attention.h): the append
// of a step's new K/V rows (alone, or with the rotary embedding of the step's
// q and k), the split-KV attention over the cache and the combine of split
// results. All address a position of a sequence the same way (KvRow).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/reduce.cuh"
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
  int64_t dst = 0;
  if (keep) {
    const int pos = a.cache.start[s] + (token - a.cu_seqlens[s]);
    dst = KvRow(a.cache.block_tables + table_begin, a.cache.block_tokens, pos) * kv_width;
  }
  T* k_dst = static_cast<T*>(a.cache.k) + dst;
  T* row = static_cast<T*>(r.qkv) + int64_t{token} * (r.num_heads + 2 * r.num_kv_heads) * r.head_dim;
  rope::RotateRow(row, cos_sin, r.num_heads, r.num_kv_heads, r.head_dim,
                  [&](int kv_head, int i0, const V& x1, const V& x2) {
                    if (!keep) return;
                    T* k_head = k_dst + kv_head * r.head_dim;
                    *reinterpret_cast<V*>(k_head + i0) = x1;
                    *reinterpret_cast<V*>(k_head + half + i0) = x2;
                  });
  if (!keep) return;
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
// through shared memory in tiles of kBlockN = 64 keys on a kStages-deep
// cp.async ring. Each of the 4 warps takes 16 keys of every tile (keys
// 16w .. 16w + 15) for all 16 rows: S = Q K^T and O += P V are one m16 tile
// of mma.sync each, and each warp keeps its own online softmax (running max
// m, sum l, output o) over the keys it saw. At the end the warps' results
// are merged through shared memory: with M the largest of the four maxima,
// O = sum_w 2^(m_w - M) o_w and L = sum_w 2^(m_w - M) l_w (scores in log2
// units). An item that covers all of its rows' keys writes O / L rounded to
// T; a split item writes O / L and its log-sum-exp M + log2 L in fp32 for the
// combine kernel.
//
// Why this shape: a decode step is bound by reading K/V, and a KV head's G
// query heads all read the same rows, so a CTA that holds the whole group
// reads them once (the old one-warp-per-(query, head) kernel read them G
// times, one dependent key group at a time). Splitting the keys over warps
// rather than the rows keeps every warp busy when a tile has only G rows (4
// of 16 for Llama-3-8B decode: the tensor cores idle 3/4 of the time, which
// they can afford). Shared tiles use the flash kernel's XOR swizzle, so
// ldmatrix reads are conflict-free.
constexpr int kPagedWarps = 4;
constexpr int kPagedThreads = kPagedWarps * 32;
constexpr int kPagedStages = 3;
constexpr int kCombineThreads = 128;
static_assert(kPagedKeyTile == kPagedWarps * 16, "each warp takes 16 keys of a tile");
static_assert(kPagedQueryRows == 16, "a work item is one m16 tile");

template <int kHeadDim>
struct PagedTraits {
  static constexpr int kBlockN = kPagedKeyTile;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks
  static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of the output
  static constexpr int kTileElems = kBlockN * kHeadDim;
  // Q (a wide item's 64 rows; a narrow one uses the first 16), then kStages
  // (K, V) tile pairs; the narrow merge reuses the ring.
  static constexpr int kSmemBytes = (kPagedWideRows * kHeadDim + 2 * kPagedStages * kTileElems) * 2;
  static constexpr int kMergeBytes = kPagedWarps * kPagedQueryRows * (kHeadDim + 2) * 4;
  static_assert(kMergeBytes <= kSmemBytes, "the merge fits in the ring");
  static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes");
  static_assert((kBlockN * kChunksPerRow) % kPagedThreads == 0, "K/V tile loads split evenly");
};

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile
// (the same layout as the flash kernel's).
template <int kHeadDim>
__device__ __forceinline__ int PagedSwizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Where one sequence's keys live: below `start` in the pool through `table`,
// from `start` on in the step's own rows, from packed row first_row.
struct SeqKeys {
  const int32_t* table;
  int start;
  int first_row;
};

// Starts the async copy of keys [key0, key0 + 64) of KV head kv_head into a
// K and a V tile; keys at or past key_end are zero-filled, not read.
template <typename T, int kHeadDim>
__device__ __forceinline__ void LoadKvTile(T* sK, T* sV, const PagedAttentionParams& p, const SeqKeys& seq, int kv_head,
                                           int key0, int key_end, int tid) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kIters = Traits::kBlockN * Traits::kChunksPerRow / kPagedThreads;
  const int64_t kv_width = int64_t{p.num_kv_heads} * kHeadDim;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * kPagedThreads + tid;
    const int row = idx / Traits::kChunksPerRow;
    const int chunk = idx % Traits::kChunksPerRow;
    const int j = key0 + row;
    const bool valid = j < key_end;
    const T* k_src = static_cast<const T*>(p.k);
    const T* v_src = static_cast<const T*>(p.v);
    if (valid) {
      const int64_t column = int64_t{kv_head} * kHeadDim + chunk * 8;
      if (j < seq.start) {
        const int64_t pool_row = KvRow(seq.table, p.cache.block_tokens, j);
        k_src = static_cast<const T*>(p.cache.k) + pool_row * kv_width + column;
        v_src = static_cast<const T*>(p.cache.v) + pool_row * kv_width + column;
      } else {
        const int64_t r = seq.first_row + (j - seq.start);
        k_src += r * p.k_row_stride + column;
        v_src += r * p.v_row_stride + column;
      }
    }
    CpAsync16(sK + PagedSwizzle<kHeadDim>(row, chunk), k_src, valid);
    CpAsync16(sV + PagedSwizzle<kHeadDim>(row, chunk), v_src, valid);
  }
}

// A narrow item: 16 rows, the warps splitting each key tile (above).
template <typename T, int kHeadDim>
__device__ __forceinline__ void PagedNarrowTile(const PagedAttentionParams& p, const PagedWorkItem& item,
                                                unsigned char* smem_raw) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kDTiles = Traits::kDTiles;
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_row = p.cu_seqlens[item.seq];
  const int q_rows = (p.cu_seqlens[item.seq + 1] - first_row) * group;  // valid rows of the sequence
  const int start = p.cache.start[item.seq];
  const SeqKeys seq{p.cache.block_tables + p.cache.cu_blocks[item.seq], start, first_row};

  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kPagedQueryRows * kHeadDim;         // [kStages][kBlockN][kHeadDim]
  T* sV = sK + kPagedStages * Traits::kTileElems;  // [kStages][kBlockN][kHeadDim]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int quad_row = lane >> 2;
  const int quad_col = (lane & 3) * 2;

  // The 16 query rows: row r is token (q_row0 + r) / G, head (q_row0 + r) % G
  // of the group; rows past the sequence's are zero-filled and never written.
  for (int idx = tid; idx < kPagedQueryRows * Traits::kChunksPerRow; idx += kPagedThreads) {
    const int r = idx / Traits::kChunksPerRow;
    const int chunk = idx % Traits::kChunksPerRow;
    const int row = item.q_row0 + r;
    const bool valid = row < q_rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      src += int64_t{first_row + row / group} * p.q_row_stride + int64_t{kv_head * group + row % group} * kHeadDim +
             chunk * 8;
    }
    CpAsync16(sQ + PagedSwizzle<kHeadDim>(r, chunk), src, valid);
  }

  // Positions of this thread's two rows (g and g + 8) and of the CTA's first
  // and last valid row: the causal and window bounds of every score.
  int q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) q_pos[h] = start + (item.q_row0 + quad_row + 8 * h) / group;
  const int last_row = min(item.q_row0 + kPagedQueryRows, q_rows) - 1;
  const int min_pos = start + item.q_row0 / group;
  const int max_pos = start + last_row / group;
  // Keys below the window of the CTA's first query are skipped whole tiles
  // at a time (kv_begin is a multiple of kBlockN).
  int key_begin = item.kv_begin;
  if (p.window > 0) {
    const int lo = min_pos - p.window + 1;
    if (lo > key_begin) key_begin += (lo - key_begin) / kBlockN * kBlockN;
  }
  const int key_end = item.kv_end;
  const int n_tiles = key_end > key_begin ? (key_end - key_begin + kBlockN - 1) / kBlockN : 0;

  // Prologue: Q with the first tile, then up to kStages - 2 more tiles, one
  // commit group each (empty groups keep the count uniform).
#pragma unroll
  for (int t = 0; t < kPagedStages - 1; ++t) {
    if (t < n_tiles) {
      LoadKvTile<T, kHeadDim>(sK + t * Traits::kTileElems, sV + t * Traits::kTileElems, p, seq, kv_head,
                              key_begin + t * kBlockN, key_end, tid);
    }
    CpAsyncCommit();
  }

  float acc_o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint32_t q_frag[kKSteps][4];

  for (int t = 0; t < n_tiles; ++t) {
    // Tile t has landed once at most kStages - 2 younger groups are pending;
    // the barrier also says every warp is done with tile t - 1's stage, which
    // the load below refills.
    CpAsyncWait<kPagedStages - 2>();
    __syncthreads();
    if (t + kPagedStages - 1 < n_tiles) {
      const int stage = (t + kPagedStages - 1) % kPagedStages;
      LoadKvTile<T, kHeadDim>(sK + stage * Traits::kTileElems, sV + stage * Traits::kTileElems, p, seq, kv_head,
                              key_begin + (t + kPagedStages - 1) * kBlockN, key_end, tid);
    }
    CpAsyncCommit();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        LdMatrixX4(q_frag[kk], sQ + PagedSwizzle<kHeadDim>(lane & 15, kk * 2 + (lane >> 4)));
      }
    }
    const T* sKs = sK + (t % kPagedStages) * Traits::kTileElems;
    const T* sVs = sV + (t % kPagedStages) * Traits::kTileElems;
    const int key0 = key_begin + t * kBlockN + warp * 16;  // this warp's first key

    // S = Q K^T over this warp's 16 keys: n8 tiles 0 (keys 0-7) and 1 (8-15).
    float acc_s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t b[4];
      const int row = warp * 16 + (lane & 7) + ((lane >> 4) << 3);
      LdMatrixX4(b, sKs + PagedSwizzle<kHeadDim>(row, kk * 2 + ((lane >> 3) & 1)));
      MmaM16N8K16<T>(acc_s[0], q_frag[kk], b[0], b[1]);
      MmaM16N8K16<T>(acc_s[1], q_frag[kk], b[2], b[3]);
    }

    // Mask keys past the item's range, after the query, or below its window;
    // only tiles that reach past the first query or the range need it.
    const bool need_mask = key0 + 15 > min_pos || key0 + 15 >= key_end || (p.window > 0 && key0 <= max_pos - p.window);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = q_pos[e >> 1];
          const int key = key0 + nt * 8 + quad_col + (e & 1);
          if (key >= key_end || key > pos || (p.window > 0 && pos - key >= p.window)) acc_s[nt][e] = -INFINITY;
        }
    }

    // Online softmax over this warp's keys (rows g and g + 8 of the thread).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(fmaxf(acc_s[0][2 * h], acc_s[0][2 * h + 1]), fmaxf(acc_s[1][2 * h], acc_s[1][2 * h + 1]));
      mx = fmaxf(QuadReduceMax(mx), row_max[h]);
      // A row that has seen no key yet keeps max -inf; its scale base is 0
      // so that 2^(-inf - base) = 0 rather than NaN.
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
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const float prob = FastExp2(acc_s[nt][e] * scale_log2 - base);
          acc_s[nt][e] = prob;
          row_sum[h] += prob;
        }
    }

    // O += P V: the two n8 score tiles are one k16 A fragment.
    uint32_t a[4];
    a[0] = PackPair<T>(acc_s[0][0], acc_s[0][1]);
    a[1] = PackPair<T>(acc_s[0][2], acc_s[0][3]);
    a[2] = PackPair<T>(acc_s[1][0], acc_s[1][1]);
    a[3] = PackPair<T>(acc_s[1][2], acc_s[1][3]);
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      uint32_t b[4];
      const int row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      LdMatrixX4Trans(b, sVs + PagedSwizzle<kHeadDim>(row, dp * 2 + (lane >> 4)));
      MmaM16N8K16<T>(acc_o[2 * dp], a, b[0], b[1]);
      MmaM16N8K16<T>(acc_o[2 * dp + 1], a, b[2], b[3]);
    }
  }

  // Merge the warps through shared memory (the ring is free once every copy
  // has landed and every warp has left the loop).
  CpAsyncWait<0>();
  __syncthreads();
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
  __syncthreads();

  // Each thread finishes 4 consecutive dimensions of a row at a time.
  constexpr int kGroups = kPagedQueryRows * kHeadDim / 4;
  for (int g = tid; g < kGroups; g += kPagedThreads) {
    const int r = g / (kHeadDim / 4);
    const int col = (g % (kHeadDim / 4)) * 4;
    const int row = item.q_row0 + r;
    if (row >= q_rows) continue;
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
      T* out = static_cast<T*>(p.out) + int64_t{first_row + row / group} * p.out_row_stride +
               int64_t{kv_head * group + row % group} * kHeadDim + col;
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

// A wide item (a prefill piece): 64 query rows, warp w owning rows
// 16w .. 16w + 15 and every key of each tile, as flash attention's warps do:
// S = Q K^T is 8 n8 score tiles per warp, each warp keeps the online softmax
// of its own rows, and O needs no merge between warps. Never split, so it
// writes the output directly. Same K/V ring, loader, swizzle and masks as
// the narrow tile.
template <typename T, int kHeadDim>
__device__ __forceinline__ void PagedWideTile(const PagedAttentionParams& p, const PagedWorkItem& item,
                                              unsigned char* smem_raw) {
  using Traits = PagedTraits<kHeadDim>;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kNTiles = kBlockN / 8;  // n8 score tiles per key tile
  static_assert(kPagedWideRows == kPagedWarps * 16, "each warp owns one m16 row tile");
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_row = p.cu_seqlens[item.seq];
  const int q_rows = (p.cu_seqlens[item.seq + 1] - first_row) * group;
  const int start = p.cache.start[item.seq];
  const SeqKeys seq{p.cache.block_tables + p.cache.cu_blocks[item.seq], start, first_row};

  T* sQ = reinterpret_cast<T*>(smem_raw);          // [64][kHeadDim]
  T* sK = sQ + kPagedWideRows * kHeadDim;          // [kStages][kBlockN][kHeadDim]
  T* sV = sK + kPagedStages * Traits::kTileElems;  // [kStages][kBlockN][kHeadDim]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int quad_row = lane >> 2;
  const int quad_col = (lane & 3) * 2;

  for (int idx = tid; idx < kPagedWideRows * Traits::kChunksPerRow; idx += kPagedThreads) {
    const int r = idx / Traits::kChunksPerRow;
    const int chunk = idx % Traits::kChunksPerRow;
    const int row = item.q_row0 + r;
    const bool valid = row < q_rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      src += int64_t{first_row + row / group} * p.q_row_stride + int64_t{kv_head * group + row % group} * kHeadDim +
             chunk * 8;
    }
    CpAsync16(sQ + PagedSwizzle<kHeadDim>(r, chunk), src, valid);
  }

  // This thread's two rows (g and g + 8 of its warp's 16) and the bounds of
  // the warp's and of the CTA's valid rows.
  const int warp_row0 = item.q_row0 + warp * 16;
  int q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) q_pos[h] = start + (warp_row0 + quad_row + 8 * h) / group;
  const int last_row = min(item.q_row0 + kPagedWideRows, q_rows) - 1;
  const int warp_min_pos = start + warp_row0 / group;
  const int warp_max_pos = start + min(warp_row0 + 15, last_row) / group;
  int key_begin = item.kv_begin;
  if (p.window > 0) {
    const int lo = start + item.q_row0 / group - p.window + 1;
    if (lo > key_begin) key_begin += (lo - key_begin) / kBlockN * kBlockN;
  }
  const int key_end = item.kv_end;
  const int n_tiles = key_end > key_begin ? (key_end - key_begin + kBlockN - 1) / kBlockN : 0;

#pragma unroll
  for (int t = 0; t < kPagedStages - 1; ++t) {
    if (t < n_tiles) {
      LoadKvTile<T, kHeadDim>(sK + t * Traits::kTileElems, sV + t * Traits::kTileElems, p, seq, kv_head,
                              key_begin + t * kBlockN, key_end, tid);
    }
    CpAsyncCommit();
  }

  float acc_o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint32_t q_frag[kKSteps][4];

  for (int t = 0; t < n_tiles; ++t) {
    CpAsyncWait<kPagedStages - 2>();
    __syncthreads();
    if (t + kPagedStages - 1 < n_tiles) {
      const int stage = (t + kPagedStages - 1) % kPagedStages;
      LoadKvTile<T, kHeadDim>(sK + stage * Traits::kTileElems, sV + stage * Traits::kTileElems, p, seq, kv_head,
                              key_begin + (t + kPagedStages - 1) * kBlockN, key_end, tid);
    }
    CpAsyncCommit();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        LdMatrixX4(q_frag[kk], sQ + PagedSwizzle<kHeadDim>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      }
    }
    const T* sKs = sK + (t % kPagedStages) * Traits::kTileElems;
    const T* sVs = sV + (t % kPagedStages) * Traits::kTileElems;
    const int key0 = key_begin + t * kBlockN;
    // A warp whose rows all start past the tile's keys (causally) or end
    // below its window has nothing to do with it; the loads above and the
    // barrier still involve it.
    if (key0 > warp_max_pos || (p.window > 0 && key0 + kBlockN - 1 <= warp_min_pos - p.window)) continue;

    float acc_s[kNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int n16 = 0; n16 < kNTiles / 2; ++n16) {
        uint32_t b[4];
        const int row = n16 * 16 + (lane & 7) + ((lane >> 4) << 3);
        LdMatrixX4(b, sKs + PagedSwizzle<kHeadDim>(row, kk * 2 + ((lane >> 3) & 1)));
        MmaM16N8K16<T>(acc_s[2 * n16], q_frag[kk], b[0], b[1]);
        MmaM16N8K16<T>(acc_s[2 * n16 + 1], q_frag[kk], b[2], b[3]);
      }
    }

    const bool need_mask = key0 + kBlockN - 1 > warp_min_pos || key0 + kBlockN - 1 >= key_end ||
                           (p.window > 0 && key0 <= warp_max_pos - p.window);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = q_pos[e >> 1];
          const int key = key0 + nt * 8 + quad_col + (e & 1);
          if (key >= key_end || key > pos || (p.window > 0 && pos - key >= p.window)) acc_s[nt][e] = -INFINITY;
        }
    }

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

    // O += P V, one k16 step per 16 keys of the tile.
#pragma unroll
    for (int k16 = 0; k16 < kNTiles / 2; ++k16) {
      uint32_t a[4];
      a[0] = PackPair<T>(acc_s[2 * k16][0], acc_s[2 * k16][1]);
      a[1] = PackPair<T>(acc_s[2 * k16][2], acc_s[2 * k16][3]);
      a[2] = PackPair<T>(acc_s[2 * k16 + 1][0], acc_s[2 * k16 + 1][1]);
      a[3] = PackPair<T>(acc_s[2 * k16 + 1][2], acc_s[2 * k16 + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];
        const int row = k16 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        LdMatrixX4Trans(b, sVs + PagedSwizzle<kHeadDim>(row, dp * 2 + (lane >> 4)));
        MmaM16N8K16<T>(acc_o[2 * dp], a, b[0], b[1]);
        MmaM16N8K16<T>(acc_o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }
  CpAsyncWait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + quad_row + 8 * h;
    const float sum = QuadReduceSum(row_sum[h]);
    if (row >= q_rows) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* out = static_cast<T*>(p.out) + int64_t{first_row + row / group} * p.out_row_stride +
             int64_t{kv_head * group + row % group} * kHeadDim;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      *reinterpret_cast<uint32_t*>(out + dt * 8 + quad_col) =
          PackPair<T>(acc_o[dt][2 * h] * inv, acc_o[dt][2 * h + 1] * inv);
    }
  }
}

// One CTA per (work item, KV head): the item's width picks the tile.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kPagedThreads, 2) PagedAttentionKernel(const PagedAttentionParams p) {
  AllowDependentLaunch();  // o_proj may start streaming its weights
  // Launched as a programmatic dependent of RopeKvAppend: its rotated rows
  // and cache writes are complete and visible past this point.
  WaitForPrerequisiteGrids();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const PagedWorkItem item = p.items[blockIdx.x];
  if (item.rows == kPagedWideRows) {
    PagedWideTile<T, kHeadDim>(p, item, smem_raw);
  } else {
    PagedNarrowTile<T, kHeadDim>(p, item, smem_raw);
  }
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
