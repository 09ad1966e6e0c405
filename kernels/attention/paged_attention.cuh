// Device code of the paged KV cache's two kernels (paged_attention.h): the
// append of a step's new K/V rows and the one-warp-per-query attention.
//
// Both find a packed token's sequence by binary search over cu_seqlens
// (log2(num_seqs) loads, against the hundreds of key steps of an attention
// warp), and both address a position of a sequence the same way (KvRow).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels::paged {

// Warps per CTA of the attention kernel: each takes one query head of the
// CTA's token, so the CTA's four heads usually share a KV head (GQA groups of
// 4 or more) and its rows in L1.
constexpr int kAttentionWarps = 4;
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

// One CTA per packed token: copies its K and V rows into the cache, 16 bytes
// per thread per step. Rows of sequences without a table are left alone.
template <typename T>
__global__ void __launch_bounds__(kAppendThreads) KvAppendKernel(const KvAppendParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const int token = blockIdx.x;
  const int s = SequenceOf(p.cu_seqlens, p.num_seqs, token);
  const int32_t table_begin = p.cache.cu_blocks[s];
  if (table_begin == p.cache.cu_blocks[s + 1]) return;  // stateless: nothing to keep
  const int pos = p.cache.start[s] + (token - p.cu_seqlens[s]);
  const int64_t kv_width = int64_t{p.num_kv_heads} * p.head_dim;
  const int64_t dst = KvRow(p.cache.block_tables + table_begin, p.cache.block_tokens, pos) * kv_width;
  const T* k_src = static_cast<const T*>(p.k) + token * p.k_row_stride;
  const T* v_src = static_cast<const T*>(p.v) + token * p.v_row_stride;
  T* k_dst = static_cast<T*>(p.cache.k) + dst;
  T* v_dst = static_cast<T*>(p.cache.v) + dst;
  for (int64_t i = threadIdx.x * kVec; i < kv_width; i += kAppendThreads * kVec) {
    *reinterpret_cast<V*>(k_dst + i) = *reinterpret_cast<const V*>(k_src + i);
    *reinterpret_cast<V*>(v_dst + i) = *reinterpret_cast<const V*>(v_src + i);
  }
}

// Keys a warp loads before it uses any: their K and V loads are independent,
// so kKeyGroup of them are in flight at once instead of one. A decode query
// over a long cache is bound by the latency of those loads, not by their
// bytes (one warp per query and head keeps few loads in flight per SM): one
// key at a time cost ~0.5 ms per layer for a 768-token session on the H100.
constexpr int kKeyGroup = 8;

// Grid (tokens, ceil(num_heads / kAttentionWarps)): warp w of CTA (t, y)
// computes query head y * kAttentionWarps + w of packed token t. Each lane
// holds kHeadDim / 32 consecutive dimensions of q, of every key and value row
// it reads, and of the output.
//
// Keys are visited in order, kKeyGroup at a time: the scores
// s_j = (q . k_j) * scale of the group (each summed across the warp), then
// the online softmax keeps the running maximum m, the running sum
// l = sum_j exp(s_j - m) and acc = sum_j exp(s_j - m) v_j, both rescaled by
// exp(m_old - m_new) when a group raises the maximum. The first group
// rescales from m = -inf, a factor of 0 on the zero-initialised sums. Every
// query sees at least itself, so l >= 1 at the end and out = acc / l.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kAttentionWarps * 32) PagedAttentionKernel(const PagedAttentionParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  using V = Vec<T, kPerLane>;
  const int head = blockIdx.y * kAttentionWarps + threadIdx.x / 32;
  if (head >= p.num_heads) return;  // a whole warp leaves: the shuffles below stay full-warp
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x;
  const int s = SequenceOf(p.cu_seqlens, p.num_seqs, token);
  const int first_row = p.cu_seqlens[s];  // packed row of the sequence's first new token
  const int start = p.cache.start[s];
  const int q_pos = start + (token - first_row);
  const int lo = p.window > 0 ? max(0, q_pos - p.window + 1) : 0;
  const int32_t* table = p.cache.block_tables + p.cache.cu_blocks[s];
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int64_t kv_width = int64_t{p.num_kv_heads} * kHeadDim;
  const int64_t column = int64_t{kv_head} * kHeadDim + lane * kPerLane;  // of this lane, in a K or V row
  float q[kPerLane];
  const V q_vec = *reinterpret_cast<const V*>(static_cast<const T*>(p.q) + token * p.q_row_stride +
                                              int64_t{head} * kHeadDim + lane * kPerLane);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) q[e] = ToFloat(q_vec.v[e]);
  float m = -INFINITY, l = 0.f, acc[kPerLane] = {};
  for (int j0 = lo; j0 <= q_pos; j0 += kKeyGroup) {
    const int n = min(kKeyGroup, q_pos - j0 + 1);  // keys of this group the query sees
    V k_vec[kKeyGroup], v_vec[kKeyGroup];
#pragma unroll
    for (int g = 0; g < kKeyGroup; ++g) {
      if (g >= n) continue;  // not break: a fully unrolled loop keeps the arrays in registers
      const int j = j0 + g;
      const T* k_row;
      const T* v_row;
      if (j < start) {  // an earlier step's key, in the cache
        const int64_t row = KvRow(table, p.cache.block_tokens, j);
        k_row = static_cast<const T*>(p.cache.k) + row * kv_width;
        v_row = static_cast<const T*>(p.cache.v) + row * kv_width;
      } else {  // one of this step's keys, in the activation
        const int64_t row = first_row + (j - start);
        k_row = static_cast<const T*>(p.k) + row * p.k_row_stride;
        v_row = static_cast<const T*>(p.v) + row * p.v_row_stride;
      }
      k_vec[g] = *reinterpret_cast<const V*>(k_row + column);
      v_vec[g] = *reinterpret_cast<const V*>(v_row + column);
    }
    // The group's partial dot products, summed across the warp together so
    // that the shuffles of different keys overlap.
    float score[kKeyGroup];
#pragma unroll
    for (int g = 0; g < kKeyGroup; ++g) {
      score[g] = 0.f;
      if (g < n) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) score[g] += q[e] * ToFloat(k_vec[g].v[e]);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
      for (int g = 0; g < kKeyGroup; ++g) score[g] += __shfl_xor_sync(0xffffffffu, score[g], offset);
    }
    float m_new = m;
#pragma unroll
    for (int g = 0; g < kKeyGroup; ++g) {
      score[g] *= p.softmax_scale;
      if (g < n) m_new = fmaxf(m_new, score[g]);
    }
    const float rescale = expf(m - m_new);
    l *= rescale;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] *= rescale;
#pragma unroll
    for (int g = 0; g < kKeyGroup; ++g) {
      if (g >= n) continue;
      const float weight = expf(score[g] - m_new);
      l += weight;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] += weight * ToFloat(v_vec[g].v[e]);
    }
    m = m_new;
  }
  V out;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) out.v[e] = FromFloat<T>(acc[e] / l);
  *reinterpret_cast<V*>(static_cast<T*>(p.out) + token * p.out_row_stride + int64_t{head} * kHeadDim +
                        lane * kPerLane) = out;
}

}  // namespace layerserve::kernels::paged
