// The float32 operators the CPU backend composes into a decoder layer, spread
// over a ThreadPool (base/thread_pool.h).
//
// All matrices are row-major float32. Operators that work on the packed batch
// take `cu_seqlens` (num_sequences + 1 offsets into the token rows); a
// sequence's positions start at 0 unless the operator is told where it starts
// (a session step continues a sequence whose earlier keys are cached). Operators that read a slice
// of a wider activation, such as q inside the fused qkv projection, take a row stride in elements.
// GEMMs go through CBLAS (OpenBLAS), one call per thread on a slice of the work. Each operator is
// tested against the float64 reference in tests/reference.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/thread_pool.h"

namespace layerserve::cpu {

// Makes every OpenBLAS call run on its calling thread (a process-wide setting).
// The CPU backend parallelises with its own pool, GEMMs included, so BLAS
// threads and pool threads never compete for the same cores.
void UseSingleThreadedBlas();

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)); statistics in at least
// float32 precision, as Hugging Face's LlamaRMSNorm. `out` may equal `x`.
void RmsNorm(const float* x, int64_t rows, int64_t cols, const float* weight, float eps, float* out,
             ThreadPool* pool);

// Qwen3's q/k norm, in place: RMSNorm over each head_dim-wide head of each
// row of x (rows `stride` floats apart), its first q_heads heads with
// q_weight and the k_heads after them with k_weight (both [head_dim]).
void HeadRmsNorm(float* x, int64_t rows, int64_t stride, int64_t q_heads, int64_t k_heads,
                 int64_t head_dim, const float* q_weight, const float* k_weight, float eps,
                 ThreadPool* pool);

// y[rows, out] = x[rows, in] W^T + bias, W: [out, in]; bias may be null.
// Split by output columns over `pool` (null: the calling thread only).
void Linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
            int64_t out_features, const float* bias, float* y, ThreadPool* pool);
// y[rows, out] += x[rows, in] W^T (the residual add, fused into the GEMM).
void LinearAccumulate(const float* x, int64_t rows, int64_t in_features, const float* weight,
                      int64_t out_features, float* y, ThreadPool* pool);

// Rotate-half RoPE in place on the first `num_heads` heads of each row of x
// (row stride `stride`); the fused qkv layout [q heads | k heads | v] needs one
// call with num_heads = heads + kv_heads. Row i of sequence s sits at position
// start_positions[s] + i (a session step continues its sequences where the
// previous step stopped); empty start_positions: every sequence starts at 0.
// Angles are float32(pos * inv_freq), as Hugging Face computes them.
void ApplyRope(float* x, int64_t stride, int64_t num_heads, int64_t head_dim,
               std::span<const int32_t> cu_seqlens, std::span<const int64_t> start_positions,
               std::span<const float> inv_freq, ThreadPool* pool);

// Causal grouped-query attention over packed sequences, softmax scale
// 1/sqrt(head_dim): query head h reads KV head h / (num_heads / num_kv_heads).
// q rows have stride q_stride, k and v rows kv_stride, out rows out_stride;
// head h occupies columns [h * head_dim, (h + 1) * head_dim) of its row.
//
// Sequence s has queries [cu_seqlens_q[s], cu_seqlens_q[s+1]) and keys
// [cu_seqlens_k[s], cu_seqlens_k[s+1]), lq <= lk of them (empty cu_seqlens_k:
// the keys are the queries' own rows). The queries are the last lq of the
// sequence's lk positions (bottom-right aligned, as flash-attn's varlen
// kernels with cu_seqlens_q / cu_seqlens_k): query i sits at position
// p = lk - lq + i and sees key j iff j <= p, and with window > 0 only iff
// 0 <= p - j < window (sliding-window attention). Example: a session step of
// lq = 2 new tokens after 5 cached ones has lk = 7 keys; its queries sit at
// positions 5 and 6 and see keys 0..5 and 0..6. A query's output reads only
// the value rows it sees, so a NaN or Inf in one token cannot reach an
// earlier token or one outside the window.
struct AttentionArgs {
  const float* q = nullptr;
  int64_t q_stride = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;
};
void CausalAttention(const AttentionArgs& args, std::span<const int32_t> cu_seqlens_q,
                     std::span<const int32_t> cu_seqlens_k, ThreadPool* pool);

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, intermediate + j]: gate_up holds
// the fused [gate | up] projection, rows of 2 * intermediate.
void SiluMul(const float* gate_up, int64_t rows, int64_t intermediate, float* out,
             ThreadPool* pool);

// Mixture-of-experts routing as Hugging Face's MixtralSparseMoeBlock: for each
// row of `logits` [rows, experts], the softmax over all experts, the top_k
// experts by probability (highest first; of equal ones the lower index), and
// their probabilities, divided by the sum of the chosen ones when
// `normalize` (Qwen2-MoE's norm_topk_prob; Mixtral always). Writes ids and
// weights, both [rows, top_k]. A row with a NaN logit still gets valid expert
// ids (its weights are NaN), so a poisoned token cannot index out of bounds.
void RouteTopK(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool normalize,
               int32_t* ids, float* weights);

// The activation quantization in front of an FP8 linear (W8A8; server/model's
// Fp8Quantization): each element x becomes e4m3(x / s) x s, rounded to
// nearest even and saturated at 448, with s = amax / 448 over its token's
// group of `group` channels (0: the whole row), or s = `static_scale` when
// that is set. A group whose amax is 0 stays 0. Disabled: nothing changes.
struct Fp8InputQuant {
  bool enabled = false;
  int64_t group = 0;
  float static_scale = 0;
};

// Applies `q` to each row of x [rows, cols] in place.
void QuantizeDequantizeFp8(float* x, int64_t rows, int64_t cols, const Fp8InputQuant& q,
                           ThreadPool* pool);

// Stacked expert MLP weights (LayerWeights::experts_gate_up / experts_down).
struct ExpertWeights {
  const float* gate_up = nullptr;  // [experts, 2 intermediate, hidden]: gate rows, then up rows
  const float* down = nullptr;     // [experts, hidden, intermediate]
  int64_t experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  // FP8 experts: the quantization of each projection's input rows.
  Fp8InputQuant gate_up_input;
  Fp8InputQuant down_input;
};

// out[r] += sum over j < top_k of weights[r, j] * expert_{ids[r, j]}(x[r]),
// where expert e computes (silu(x G_e^T) * (x U_e^T)) D_e^T. Rows are grouped
// by expert first, so each chosen expert runs one GEMM per projection over
// all the rows that chose it, and an expert no row chose is never read. Each
// row sums its experts' outputs in its choice order. x: [rows, hidden], out:
// [rows, hidden], ids and weights: [rows, top_k] (RouteTopK).
void ExpertMlps(const float* x, int64_t rows, const int32_t* ids, const float* weights,
                int64_t top_k, const ExpertWeights& w, float* out, ThreadPool* pool);

}  // namespace layerserve::cpu
