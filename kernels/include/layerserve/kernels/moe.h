// The kernels of a mixture-of-experts MLP (Mixtral's sparse MoE block)
// around the grouped GEMM (gemm.h, GemmParams::group_offsets). Over the
// normed activations n [tokens, hidden], with k = top_k choices per token:
//
//   GEMM         logits = n routerᵀ (the router's rows padded to a multiple of
//                8, GemmRouter)
//   MoeRoute     softmax of the logits, the top k experts of each token
//                and their renormalised weights; each choice's rank among
//                its expert's choices, and each expert's first row (offsets,
//                [experts + 1]): choice (t, j) of expert e takes row
//                offsets[e] + rank[t, j] of the expert-ordered activations
//   MoeGather    p [tokens k, hidden]: n's rows in that order (or their
//                FP8 codes and scales)
//   grouped GEMM gu = p W_gate_upᵀ per expert, SiLU·mul, grouped GEMM down
//   MoeCombine   x[t] += Σ_j weight[t, j] · y[row of (t, j)]
//
// Ranks come from atomics, so the order of an expert's rows varies from run
// to run; the result does not, since every row's GEMM output depends on that
// row alone and MoeCombine sums each token's choices in choice order.
//
// Plain C++ header: compiles without nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

// The most experts MoeRoute takes (one warp keeps a token's logits in shared
// memory); the grouped GEMM's kMaxGemmGroups is the same.
inline constexpr int kMaxExperts = 256;

// Routing as Hugging Face's MixtralSparseMoeBlock, over logits rounded as a
// bf16 GEMM rounds them (as HF's bf16 gate Linear does): softmax over every
// expert in fp32, the top_k experts by probability (highest first; of equal
// ones the lower index), weights = their probabilities over the sum of the
// chosen ones (with `normalize`; without, as Qwen2-MoE's norm_topk_prob =
// false, the probabilities themselves). A token with a NaN logit still gets
// valid, distinct experts (NaN ranks lowest); its weights are NaN, which
// reach only its own output. One launch: the block that finishes last turns
// the counts into offsets.
struct MoeRouteParams {
  const void* logits = nullptr;  // [tokens, logits_stride]: the first `experts` columns
  int64_t logits_stride = 0;     // >= experts
  int64_t tokens = 0;
  int experts = 0;  // 1..kMaxExperts
  int top_k = 0;    // 1..experts
  bool normalize = true;
  DType dtype = DType::kBF16;
  int32_t* expert_ids = nullptr;  // out [tokens, top_k]
  float* weights = nullptr;       // out [tokens, top_k]
  int32_t* ranks = nullptr;       // out [tokens, top_k]: the choice's place among its expert's
  int32_t* offsets = nullptr;     // out [experts + 1]
  int32_t* scratch = nullptr;     // [experts + 1]: counts and a finished-blocks counter
  int32_t* counts_out = nullptr;  // optional out [experts]: tokens per expert, for metrics
};
absl::Status LaunchMoeRoute(const MoeRouteParams& p, cudaStream_t stream);

// The choices (MoeRoute's ids, ranks and offsets) of one routed batch.
struct MoeChoices {
  const int32_t* expert_ids = nullptr;  // [tokens, top_k]
  const int32_t* ranks = nullptr;       // [tokens, top_k]
  const int32_t* offsets = nullptr;     // [experts + 1]
  int64_t tokens = 0;
  int top_k = 0;
};

// permuted[offsets[e] + rank] = x[t] for every choice (t, j) of expert e.
// FP8 experts (fp8_codes set, x and permuted unused): the same for x's e4m3
// codes and their scales, in LaunchQuantizeFp8's layout (the RMSNorm before
// wrote them), so the experts' gate/up reads its input quantized with no
// pass of its own: a row of codes moves whole, and its scales with it.
struct MoeGatherParams {
  MoeChoices choices;
  const void* x = nullptr;  // [tokens, hidden]
  int64_t hidden = 0;       // a multiple of 8 (of 16 with fp8_codes; of 128 with fp8_group 128)
  DType dtype = DType::kBF16;
  void* permuted = nullptr;           // out [tokens top_k, hidden]
  const void* fp8_codes = nullptr;    // [tokens, hidden]
  const float* fp8_scales = nullptr;  // [tokens], or [hidden / 128][tokens] with fp8_group 128
  int64_t fp8_group = 0;              // 0 (per row) or 128
  void* permuted_codes = nullptr;     // out [tokens top_k, hidden]
  float* permuted_scales = nullptr;   // out [tokens top_k], or [hidden / 128][tokens top_k]
};
absl::Status LaunchMoeGather(const MoeGatherParams& p, cudaStream_t stream);

// x[t] = x[t] + Σ_j weights[t, j] y[row of (t, j)], summed in fp32 in choice
// order and rounded once.
struct MoeCombineParams {
  MoeChoices choices;
  const void* y = nullptr;         // [tokens top_k, hidden]: the experts' outputs, expert-ordered
  const float* weights = nullptr;  // [tokens, top_k] (MoeRoute)
  void* x = nullptr;               // [tokens, hidden]: the residual stream, in place
  int64_t hidden = 0;              // a multiple of 8
  DType dtype = DType::kBF16;
};
absl::Status LaunchMoeCombine(const MoeCombineParams& p, cudaStream_t stream);

// Qwen2-MoE's shared expert: one more SiLU-gated MLP that every token passes
// through, its output scaled by sigmoid(x[t] · gate) before it joins the
// experts'. The down projection is linear, so scaling the MLP's activation
// row instead lets that GEMM add straight onto the residual stream:
//   activation[t, :] *= sigmoid(x[t] · gate)
// with the dot product in fp32, and the logit, the sigmoid and the product
// each rounded to the dtype, as Hugging Face's bf16 ops round them.
struct MoeSharedGateParams {
  const void* x = nullptr;     // [tokens, hidden]: the normed rows the MLP read
  const void* gate = nullptr;  // [hidden]: shared_expert_gate's one row
  void* activation = nullptr;  // [tokens, width]: silu(gate) * up, scaled in place
  int64_t tokens = 0;
  int64_t hidden = 0;  // a multiple of 8
  int64_t width = 0;   // a multiple of 8
  DType dtype = DType::kBF16;
  // An FP8 gate (W8A8): x is read as these e4m3 codes [tokens, hidden] times
  // their scales (LaunchQuantizeFp8's layout for x_group 0 or 128: the
  // input an FP8 gate/up read), and `gate` is float32, the dequantized row.
  const void* x_codes = nullptr;
  const float* x_scales = nullptr;
  int64_t x_group = 0;
};
absl::Status LaunchMoeSharedGate(const MoeSharedGateParams& p, cudaStream_t stream);

}  // namespace layerserve::kernels
