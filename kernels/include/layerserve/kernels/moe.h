// The kernels of a mixture-of-experts MLP (Mixtral's sparse MoE block)
// around the grouped GEMM (gemm.h, GemmParams::group_offsets). Over the
// normed activations n [tokens, hidden], with k = top_k choices per token:
//
//   MoeRoute     logits = n routerᵀ, softmax, the top k experts of each
//                token and their renormalised weights; tokens per expert
//   MoePermute   each expert's first row (offsets, [experts + 1]), the row
//                each choice (t, j) takes in expert order, and the permuted
//                activations p [tokens k, hidden]: expert e's rows are
//                [offsets[e], offsets[e + 1])
//   grouped GEMM gu = p W_gate_upᵀ per expert, SiLU·mul, grouped GEMM down
//   MoeCombine   x[t] += Σ_j weight[t, j] · y[row of (t, j)]
//
// Within an expert the order of its rows depends on atomics, i.e. varies from
// run to run; it changes nothing in the result, since every row's GEMM output
// depends on that row alone and MoeCombine sums each token's choices in
// choice order.
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

// Routing as Hugging Face's MixtralSparseMoeBlock: logits accumulated in
// fp32, softmax over every expert in fp32, the top_k experts by probability
// (highest first; of equal ones the lower index), weights = their
// probabilities over the sum of the chosen ones. A token with a NaN logit
// still gets valid, distinct experts (NaN ranks lowest); its weights are NaN,
// which reach only its own output.
struct MoeRouteParams {
  const void* x = nullptr;       // [tokens, hidden]
  const void* router = nullptr;  // [experts, hidden]
  int64_t tokens = 0;
  int64_t hidden = 0;  // a multiple of 8
  int experts = 0;     // 1..kMaxExperts
  int top_k = 0;       // 1..experts
  DType dtype = DType::kBF16;
  int32_t* expert_ids = nullptr;  // out [tokens, top_k]
  float* weights = nullptr;       // out [tokens, top_k]
  int32_t* counts = nullptr;      // out [experts]: tokens per expert (zeroed by the launch)
};
absl::Status LaunchMoeRoute(const MoeRouteParams& p, cudaStream_t stream);

struct MoePermuteParams {
  const int32_t* expert_ids = nullptr;  // [tokens, top_k] (MoeRoute)
  const int32_t* counts = nullptr;      // [experts] (MoeRoute)
  const void* x = nullptr;              // [tokens, hidden]
  int64_t tokens = 0;
  int64_t hidden = 0;  // a multiple of 8
  int experts = 0;
  int top_k = 0;
  DType dtype = DType::kBF16;
  int32_t* offsets = nullptr;  // out [experts + 1]
  int32_t* rows = nullptr;     // out [tokens, top_k]: the permuted row of choice (t, j)
  void* permuted = nullptr;    // out [tokens top_k, hidden]
};
absl::Status LaunchMoePermute(const MoePermuteParams& p, cudaStream_t stream);

// x[t] = x[t] + Σ_j weights[t, j] y[rows[t, j]], summed in fp32 in choice
// order and rounded once.
struct MoeCombineParams {
  const void* y = nullptr;         // [tokens top_k, hidden]: the experts' outputs, permuted
  const int32_t* rows = nullptr;   // [tokens, top_k] (MoePermute)
  const float* weights = nullptr;  // [tokens, top_k] (MoeRoute)
  void* x = nullptr;               // [tokens, hidden]: the residual stream, in place
  int64_t tokens = 0;
  int64_t hidden = 0;  // a multiple of 8
  int top_k = 0;
  DType dtype = DType::kBF16;
};
absl::Status LaunchMoeCombine(const MoeCombineParams& p, cudaStream_t stream);

}  // namespace layerserve::kernels
