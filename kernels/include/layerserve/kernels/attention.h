// Fused flash-attention forward over variable-length packed sequences.
//
// Sequence s occupies rows [cu_seqlens[s], cu_seqlens[s+1]) of q, k, v and out;
// attention is causal within each sequence (the only kind a decoder layer
// runs), optionally through a sliding window, and never crosses sequences.
// Grouped-query attention: query head h reads kv head h / (num_heads /
// num_kv_heads). Scores are never materialized in global memory: each CTA
// streams K/V tiles through shared memory with an online softmax.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

struct FlashAttentionParams {
  // Row strides are in elements, so q/k/v may point into one fused qkv buffer.
  const void* q = nullptr;  // [tokens, num_heads * head_dim] (row stride q_row_stride)
  const void* k = nullptr;  // [tokens, num_kv_heads * head_dim]
  const void* v = nullptr;
  void* out = nullptr;  // [tokens, num_heads * head_dim]
  int64_t q_row_stride = 0;
  int64_t k_row_stride = 0;
  int64_t v_row_stride = 0;
  int64_t out_row_stride = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  int num_seqs = 0;
  int max_seqlen = 0;  // longest sequence (sizes the grid)
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;           // 64 or 128
  float softmax_scale = 0.f;  // usually 1/sqrt(head_dim)
  // Sliding-window attention with Hugging Face's semantics (Mistral's
  // `sliding_window`, and what the CPU backend and paged attention compute):
  // query i of a sequence sees key j iff 0 <= i - j < window. 0: no window
  // (full causal). Each query tile then reads only the key tiles its rows can
  // see, so the work is O(tokens x window) rather than O(tokens^2).
  int window = 0;
  DType dtype = DType::kBF16;  // bf16 or fp16
};

// Launches the version DefaultFlashAttentionVersion picks for `p` on `dev`
// (the device the stream belongs to; DeviceInfo is captured once by the
// caller, so nothing is queried per launch).
absl::Status LaunchFlashAttention(const FlashAttentionParams& p, const DeviceInfo& dev, cudaStream_t stream);

}  // namespace layerserve::kernels
