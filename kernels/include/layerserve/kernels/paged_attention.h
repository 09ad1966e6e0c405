// Attention for batches that continue sessions: the queries of a step attend
// over the keys and values of earlier steps, kept in a paged KV cache, and
// over the step's own new ones. Two launches per layer: KvAppend stores the
// new (already rotated) K and V rows in the cache, PagedAttention attends.
//
// The cache of one layer is a K pool and a V pool of
// [num_blocks][block_tokens][num_kv_heads * head_dim] elements: a row per
// token, laid out as the fused qkv projection lays out its K (or V) part.
// Each packed sequence s of the batch (rows [cu_seqlens[s], cu_seqlens[s+1])
// of the activation, as for flash attention) has a start position start[s]
// and a block table block_tables[cu_blocks[s] .. cu_blocks[s+1]): its new
// token i sits at position start[s] + i, and the sequence's token at position
// p lives in block table[p / block_tokens], row p % block_tokens
// (server/core/kv_blocks.h). A stateless sequence has start 0 and an empty
// table: it attends over its own rows only and stores nothing.
//
// Worked example, block_tokens 4: a step of 2 tokens at start 5 with table
// {7, 2} stores positions 5 and 6 at block 2, rows 1 and 2; its second query
// (position 6) reads keys 0..3 from block 7, key 4 from block 2 row 0, and
// keys 5 and 6 from the step's own qkv rows.
//
// This is the first, correctness-first version: one warp per (query token,
// query head) walks that query's keys in order, eight at a time (their loads
// in flight together, the dot products reduced across the warp, then one
// online-softmax update per group), so a query at position P costs
// (P + 1) / 8 dependent steps, and a prefill of T tokens T^2 / 16 of them per
// head; nothing is shared between the query heads of a KV head. Decode
// batches (many sequences, one query each) want split-K over the keys and
// tiles shared by a KV head's queries: the decode work replaces this kernel.
//
// Launchers validate their params (INVALID_ARGUMENT), launch on `stream`,
// check the launch, and return; nothing synchronizes. Block ids and table
// lengths are the caller's to check (Batch::Validate does): an id outside the
// pool reads or writes outside it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

// One layer's paged KV cache and where each packed sequence sits in it. All
// pointers are device memory; none is owned.
struct PagedKv {
  void* k = nullptr;  // [num_blocks, block_tokens, num_kv_heads * head_dim]
  void* v = nullptr;  // same
  int block_tokens = 0;
  const int32_t* start = nullptr;         // [num_seqs]: position of each sequence's first new token
  const int32_t* cu_blocks = nullptr;     // [num_seqs + 1]: offsets of the tables in block_tables
  const int32_t* block_tables = nullptr;  // every sequence's table, concatenated
};

// Stores the new K and V rows of every sequence that has a block table at its
// positions start[s] .. start[s] + len - 1; rows of sequences without one are
// not stored. Sequences must not share blocks.
struct KvAppendParams {
  const void* k = nullptr;  // [tokens, num_kv_heads * head_dim], row stride k_row_stride
  const void* v = nullptr;  // [tokens, num_kv_heads * head_dim], row stride v_row_stride
  int64_t k_row_stride = 0;
  int64_t v_row_stride = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  int num_seqs = 0;
  int64_t tokens = 0;  // cu_seqlens[num_seqs]
  PagedKv cache;
  int num_kv_heads = 0;
  int head_dim = 0;            // 64 or 128
  DType dtype = DType::kBF16;  // bf16 or fp16, of k, v and the cache
};
absl::Status LaunchKvAppend(const KvAppendParams& p, cudaStream_t stream);

// Causal grouped-query attention of every new token over its sequence's keys:
// query i of sequence s sits at position q = start[s] + i and sees key j iff
// j <= q, and with window > 0 only iff q - j < window (sliding-window
// attention, as the CPU backend and transformers define it). Keys below
// start[s] come from the cache through the sequence's table, keys from
// start[s] on from the new rows k and v. Query head h reads KV head
// h / (num_heads / num_kv_heads). Scores, the softmax and the weighted sum are
// fp32; only the output is rounded to the dtype. A query reads only the keys
// it sees, so a NaN elsewhere in the cache cannot reach it.
struct PagedAttentionParams {
  const void* q = nullptr;  // [tokens, num_heads * head_dim], row stride q_row_stride
  const void* k = nullptr;  // the new tokens' keys: [tokens, num_kv_heads * head_dim]
  const void* v = nullptr;  // the new tokens' values, as k
  void* out = nullptr;      // [tokens, num_heads * head_dim], row stride out_row_stride
  int64_t q_row_stride = 0;
  int64_t k_row_stride = 0;
  int64_t v_row_stride = 0;
  int64_t out_row_stride = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  int num_seqs = 0;
  int64_t tokens = 0;  // cu_seqlens[num_seqs]
  PagedKv cache;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  int window = 0;    // sliding window in tokens; 0: full causal
  float softmax_scale = 0.f;
  DType dtype = DType::kBF16;  // bf16 or fp16, of q, k, v, out and the cache
};
absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace layerserve::kernels
