// Attention for batches that continue sessions: the queries of a step attend
// over the keys and values of earlier steps, kept in a paged KV cache, and
// over the step's own new ones. Per layer RopeKvAppend rotates the step's q
// and k and stores the new K and V rows in the cache, then PagedAttention
// attends (one launch, or two when its plan splits keys).
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
// (position 6) reads keys 0..3 from block 7 and keys 4..6 from block 2, rows
// 0..2. PagedAttention reads a session sequence's new keys from the cache
// too, so RopeKvAppend must have stored them (the layer runs it first).
//
// PagedAttention is a split-KV ("flash-decoding") kernel on tensor cores,
// built for decode steps (one to a few new tokens per sequence over a long
// cache), with wider tiles for prefill pieces:
// - GQA-aware: a CTA takes 16 query rows that share one KV head, a row being
//   one (new token, query head of the group) pair, so each K/V byte it reads
//   serves every query head of the group (4 for Llama-3-8B). A sequence of
//   kPagedWideMinTokens new tokens or more (a piece of a long prompt) gets
//   wide tiles of 64 rows instead, one warp per 16 of them.
// - Split over the keys: the work of a (sequence, 16-row tile) can be cut
//   into key ranges computed by different CTAs, whose partial results (fp32
//   outputs and log-sum-exps, in a caller-provided workspace) a second launch
//   combines. That fills the GPU when few sequences have long contexts.
// - Which CTA does what is a plan (PlanPagedAttention), a pure host function
//   of the batch's shape and the device's SM count, built once per batch and
//   shared by every layer of the span: a list of work items (one per CTA and
//   KV head) and of combine tasks, uploaded by the caller.
// The previous kernel (one warp per query and head, walking its keys eight
// at a time) neither filled the SMs nor shared K/V reads across a group's
// query heads. Design record 0011.
//
// Launchers validate their params (INVALID_ARGUMENT), launch on `stream`,
// check the launch, and return; nothing synchronizes. Block ids and table
// lengths are the caller's to check (Batch::Validate does): an id outside the
// pool reads or writes outside it. So is the plan: one built for other
// sequences or head counts computes the wrong rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/common.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {

// One layer's paged KV cache and where each packed sequence sits in it. All
// pointers are device memory; none is owned.
//
// In the activation dtype (fp8 false), k and v are [num_blocks, block_tokens,
// num_kv_heads * head_dim] elements of that dtype. As FP8 (fp8 true;
// block_tokens a multiple of 16): a token's row of each KV head is e4m3
// codes at one float32 scale (amax / 448 of the row:
// server/core/kv_cache_dtype.h), laid out for the attention's loads:
//   k: [num_blocks, block_tokens, num_kv_heads * head_dim] codes (rows as
//      in bf16, a byte per element);
//   v: [num_blocks, num_kv_heads, block_tokens / 16] groups of 16 keys, each
//      group 16 * (head_dim + 8) bytes: the group's V codes [head_dim][16]
//      (transposed: a dimension's 16 keys adjacent, in the order 0, 1, 8,
//      9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, so that the P V operand
//      a thread needs, keys 2t, 2t + 1, 2t + 8, 2t + 9 of one dimension, is
//      4 adjacent bytes), then its 16 K scales, then its 16 V scales
//      (float32). A group is one copy: a run of 16 keys' values and scales.
// Worked example, block_tokens 16, 8 KV heads of 128: position 5 of block 3,
// KV head 2, dimension 7 has its K code at byte (3 * 16 + 5) * 1024 + 2 *
// 128 + 7; its group starts at byte (3 * 8 + 2) * 2176 of v, its V code at
// 7 * 16 + 9 in it (key 5 sits tenth), its K scale at 2048 + 5 * 4 and its
// V scale at 2112 + 5 * 4. Design record 0017.
struct PagedKv {
  void* k = nullptr;
  void* v = nullptr;
  int64_t num_blocks = 0;  // of each pool (PagedAttention's bound on its reads)
  int block_tokens = 0;
  bool fp8 = false;                       // the FP8 layout above
  const int32_t* start = nullptr;         // [num_seqs]: position of each sequence's first new token
  const int32_t* cu_blocks = nullptr;     // [num_seqs + 1]: offsets of the tables in block_tables
  const int32_t* block_tables = nullptr;  // every sequence's table, concatenated
};

// Where RopeKvAppend stores a batch's new K and V rows: every sequence that
// has a block table, at its positions start[s] .. start[s] + len - 1; rows of
// sequences without one are not stored. Sequences must not share blocks.
struct KvAppendParams {
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  int num_seqs = 0;
  PagedKv cache;
};

// A session batch's rotary embedding and cache write, in one launch: rotates
// the q and k heads of rope.qkv in place, bit for bit as LaunchRope does
// (its positions are each token's own), then stores each session sequence's
// rotated K rows and its V rows (the K and V columns of the same qkv rows)
// in the cache, one CTA per token: the K it stores comes from the registers
// that rotated it. Into an FP8 cache it stores each head's codes and scale,
// and writes the values the cache now holds (code * scale, rounded to the
// dtype) back over the session rows' K and V columns of qkv, so that an
// attention over those rows (a batch with nothing cached yet) sees what
// later steps will read from the cache. INVALID_ARGUMENT for params
// LaunchRope refuses, head_dim other than 64 or 128, a dtype other than bf16
// or fp16, a cache or packing not set, or an FP8 cache whose block_tokens is
// not a multiple of 16.
absl::Status LaunchRopeKvAppend(const RopeParams& rope, const KvAppendParams& append, cudaStream_t stream);

// ---- The plan of a PagedAttention launch (host code, no GPU needed) ----

// Query rows per work item (one m16 tensor-core tile) and keys per K/V tile:
// key ranges of split items start at multiples of kPagedKeyTile.
inline constexpr int kPagedQueryRows = 16;
inline constexpr int kPagedKeyTile = 64;
// A sequence with at least kPagedWideMinTokens new tokens (a prefill piece)
// is cut into wide items of kPagedWideRows query rows instead, never split:
// each of a CTA's 4 warps then owns 16 of the rows and every key of a tile,
// so a K/V tile is read once per 64 rows (16 tokens of a 4-head group)
// rather than once per 16, as flash attention reads its tiles.
inline constexpr int kPagedWideRows = 64;
inline constexpr int kPagedWideMinTokens = 64;

// One sequence of the batch as the plan sees it: `new_tokens` queries at
// positions start .. start + new_tokens - 1.
struct PagedSequence {
  int32_t new_tokens = 0;
  int32_t start = 0;
};

// One CTA's work (per KV head): query rows [q_row0, q_row0 + rows) of
// sequence `seq` (row r is new token r / G and query head r % G of the KV
// head's group of G = num_heads / num_kv_heads), over keys [kv_begin,
// kv_end); rows is kPagedQueryRows, or kPagedWideRows for a wide item, or 0
// for an idle one (PadPagedPlan), which does nothing. With partial_row0 < 0
// the item covers every key its rows see and writes the output; otherwise
// (never for a wide item) it writes its rows' partial results at workspace
// rows partial_row0 + r, for a combine task to merge.
struct PagedWorkItem {
  int32_t seq = 0;
  int32_t q_row0 = 0;
  int32_t kv_begin = 0;
  int32_t kv_end = 0;
  int32_t partial_row0 = -1;
  int32_t rows = kPagedQueryRows;
};

// Merges the `splits` partial results of rows [q_row0, q_row0 + rows) of
// sequence `seq`: split s of row r sits at workspace row
// partial_row0 + s * rows + r. A task of 0 rows (PadPagedPlan) does nothing.
struct PagedCombineTask {
  int32_t seq = 0;
  int32_t q_row0 = 0;
  int32_t rows = 0;
  int32_t partial_row0 = 0;
  int32_t splits = 0;
};

struct PagedAttentionPlan {
  std::vector<PagedWorkItem> items;
  std::vector<PagedCombineTask> combines;
  int64_t partial_rows = 0;  // workspace rows the items write (0 without splits)
};

// The most work items and partial rows a plan for up to `max_tokens` new
// tokens in up to `max_seqs` sequences can hold: what a caller sizes its
// staging and workspace for once. Partial workspace bytes:
// partial_rows * num_kv_heads * (head_dim + 1) * 4.
struct PagedPlanLimits {
  int64_t items = 0;
  int64_t partial_rows = 0;
};
PagedPlanLimits PagedPlanCapacity(int64_t max_tokens, int64_t max_seqs, int num_heads, int num_kv_heads, int num_sms);

// The work of one PagedAttention launch over `seqs` (in packing order) for a
// model with these head counts on a device with `num_sms` SMs, within
// `limits` (PagedPlanCapacity). Pure: unit-tested without a GPU.
//
// Items first cover every (sequence, 16-row tile). When those leave some of
// the GPU's CTA slots (two per SM) empty, every tile's causal key range is
// cut into splits of `chunk` key tiles (then evened out within the tile),
// the chunk chosen to minimize waves x (chunk + 2): the time of the grid if
// every CTA of a wave reads `chunk` tiles after a fixed cost worth about two.
// Worked examples, Llama-3-8B heads (32 q, 8 kv: G = 4, 8 CTAs per item),
// 132 SMs (264 slots):
//   - 1 sequence decoding at context 1024: its 4 rows see 1025 keys, 17 key
//     tiles; chunk 1 gives 17 x 8 = 136 CTAs, one wave: cost 3 (chunk 2:
//     72 CTAs, cost 4). So 17 splits and one combine task.
//   - 16 sequences at context 4096: 16 items (128 CTAs) of 65 key tiles.
//     2 splits of 33 tiles are 256 CTAs, one wave: cost 35; 4 of 17 are 512
//     CTAs, two waves: 38; 65 of 1 are 32 waves: 96. So 2 splits.
//   - 64 sequences at any context: 512 CTAs fill the slots; no split.
// INVALID_ARGUMENT for bad head counts or a sequence with a negative length
// or start; RESOURCE_EXHAUSTED when even the unsplit items exceed `limits`.
absl::StatusOr<PagedAttentionPlan> PlanPagedAttention(const std::vector<PagedSequence>& seqs, int num_heads,
                                                      int num_kv_heads, int num_sms, const PagedPlanLimits& limits);

// Appends idle work items and combine tasks (0 rows) to `plan` until it has
// `items` and `combines` of them. A launch's grid is its counts, so a CUDA
// graph captured for a padded plan serves every plan that pads to the same
// counts, its contents uploaded before each replay (the CUDA backend's
// graphs, server/cuda/forward_graphs.h). INVALID_ARGUMENT when the plan
// already has more than either count.
absl::Status PadPagedPlan(int64_t items, int64_t combines, PagedAttentionPlan* plan);

// Causal grouped-query attention of every new token over its sequence's keys
// (read from an FP8 cache as code * scale, the scales applied in fp32 to the
// scores and to the probabilities before P V):
// query i of sequence s sits at position q = start[s] + i and sees key j iff
// j <= q, and with window > 0 only iff q - j < window (sliding-window
// attention, as the CPU backend and transformers define it). A session
// sequence's keys all come from the cache through its table (the new ones
// stored there by RopeKvAppend before the launch); a stateless sequence's
// from its new rows k and v. Query head h reads KV head
// h / (num_heads / num_kv_heads). Scores, the softmax and the sums are fp32;
// as in flash attention the probabilities are rounded to the dtype for the
// P V product on tensor cores, and the output is rounded once. A launch may
// load rows past a sequence's keys (the rest of its last block, or the rows
// after its own), but none of them reaches the output, a NaN included.
// Hopper only (UNIMPLEMENTED in builds without sm_90a).
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
  DType dtype = DType::kBF16;  // bf16 or fp16, of q, k, v, out and (unless cache.fp8) the cache
  // The plan (PlanPagedAttention) for exactly these sequences and head
  // counts, uploaded to the device, and the workspace its splits write:
  // partial_out [partial_rows, num_kv_heads, head_dim] and partial_lse
  // [partial_rows, num_kv_heads] fp32, for at least plan.partial_rows rows.
  const PagedWorkItem* items = nullptr;
  int num_items = 0;
  const PagedCombineTask* combines = nullptr;
  int num_combines = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
};
absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace layerserve::kernels
