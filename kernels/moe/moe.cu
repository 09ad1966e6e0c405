// The mixture-of-experts kernels around the grouped GEMM (moe.h): routing,
// the gather into expert order, and the weighted combine.
//
// The router's logits are a GEMM (the project's kernels or cuBLASLt, as for
// any projection): computing them here, a block per token reading the whole
// router, took 79 us for one token of Qwen3-MoE's 128 x 2048 router and 750
// us for 8192 tokens, where a GEMM takes a few. Routing then is one warp per
// token, each lane holding experts lane, lane + 32, ...: the softmax by warp
// reductions, and the top k as k rounds of a warp-wide argmax (one thread
// scanning 128 experts 8 times took 250 us), each choice taking its rank in
// its expert with the same atomicAdd that counts the expert. The block that
// finishes last (a counter after a memory fence) turns the counts into
// offsets, a thread per expert with a block-wide scan (one thread summing
// 128 counts from L2 in turn took ~35 us, most of a decode step's routing). The gather and the combine are one thread
// per 16-byte vector; the shared expert's gate one block per token.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "kernels/common/dtype.cuh"
#include "kernels/common/reduce.cuh"
#include "kernels/common/static_switch.h"
#include "layerserve/kernels/moe.h"

namespace layerserve::kernels {
namespace {

constexpr int kRouteWarps = 8;  // per routing block, a token each
constexpr int kThreads = 256;

// NaN ranks below every number, so a poisoned token still picks valid,
// distinct experts.
__device__ __forceinline__ float Rank(float p) { return isnan(p) ? -INFINITY : p; }

// The most experts one lane holds (kMaxExperts over a warp).
constexpr int kExpertsPerLane = kMaxExperts / 32;

// A candidate expert: the higher rank wins, of equal ranks the lower index;
// index -1 is no candidate.
struct Candidate {
  float rank;
  int index;
};
__device__ __forceinline__ Candidate Better(Candidate a, Candidate b) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  if (a.rank != b.rank) return a.rank > b.rank ? a : b;
  return a.index < b.index ? a : b;
}
__device__ __forceinline__ Candidate WarpBest(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Candidate other{__shfl_xor_sync(0xffffffffu, c.rank, offset), __shfl_xor_sync(0xffffffffu, c.index, offset)};
    c = Better(c, other);
  }
  return c;
}

// Softmax over one token's logits `l` (shared memory) and its top k, by a
// whole warp: lane 0 writes the ids and weights, lane j % 32 choice j's rank.
__device__ __forceinline__ void TopK(const MoeRouteParams& p, int64_t token, const float* l, int lane) {
  float prob[kExpertsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < p.experts) max_logit = fmaxf(max_logit, l[e]);
  }
  max_logit = WarpReduceMax(max_logit);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.experts ? expf(l[e] - max_logit) : 0.f;
    sum += prob[i];
  }
  sum = WarpReduceSum(sum);
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) prob[i] /= sum;
  unsigned taken = 0;  // bit i: expert lane + 32 i is chosen
  float chosen_sum = 0.f;
  int32_t* ids = p.expert_ids + token * p.top_k;
  float* weights = p.weights + token * p.top_k;
  for (int j = 0; j < p.top_k; ++j) {
    Candidate mine{0.f, -1};
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < p.experts && !(taken >> i & 1u)) mine = Better(mine, Candidate{Rank(prob[i]), e});
    }
    const Candidate best = WarpBest(mine);
    // The owner marks it and publishes its probability.
    float chosen = 0.f;
    if (best.index % 32 == lane) {
      const int i = best.index / 32;
      taken |= 1u << i;
#pragma unroll
      for (int k = 0; k < kExpertsPerLane; ++k) chosen = k == i ? prob[k] : chosen;
    }
    chosen = __shfl_sync(0xffffffffu, chosen, best.index % 32);
    chosen_sum += chosen;
    if (lane == 0) {
      ids[j] = best.index;
      weights[j] = chosen;
    }
    // Rank within the expert: one atomic per choice, spread over lanes.
    if (lane == j % 32) p.ranks[token * p.top_k + j] = atomicAdd(p.scratch + best.index, 1);
  }
  if (p.normalize && lane == 0) {
    for (int j = 0; j < p.top_k; ++j) weights[j] /= chosen_sum;
  }
}

template <typename T>
__global__ void MoeRouteKernel(const MoeRouteParams p) {
  __shared__ float logits[kRouteWarps][kMaxExperts];
  __shared__ bool last_block;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t token = int64_t{blockIdx.x} * kRouteWarps + warp;
  int32_t* const counts = p.scratch;
  int32_t* const finished = p.scratch + p.experts;
  if (token < p.tokens) {
    const T* row = static_cast<const T*>(p.logits) + token * p.logits_stride;
    float* l = logits[warp];
    for (int e = lane; e < p.experts; e += 32) l[e] = ToFloat(row[e]);
    __syncwarp();
    TopK(p, token, l, lane);
  }
  // The last block to finish sees every block's counts.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(finished, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  // Exclusive scan of the counts, expert threadIdx.x (kMaxExperts is the
  // block's width): within each warp, then over the warps' totals.
  static_assert(kMaxExperts == kRouteWarps * 32, "a thread per expert");
  __shared__ int32_t warp_totals[kRouteWarps];
  const int e = threadIdx.x;
  const int32_t count = e < p.experts ? __ldcg(counts + e) : 0;
  const int32_t inclusive = WarpInclusiveSum(count);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int32_t before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  if (e < p.experts) {
    p.offsets[e] = before + inclusive - count;
    if (p.counts_out != nullptr) p.counts_out[e] = count;
  }
  if (e == p.experts - 1) p.offsets[p.experts] = before + inclusive;
}

template <typename T>
__global__ void MoeGatherKernel(const MoeGatherParams p) {
  using V = Vec<T, kVec16<T>>;
  const MoeChoices& c = p.choices;
  const int64_t vecs = p.hidden / kVec16<T>;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= c.tokens * c.top_k * vecs) return;
  const int64_t choice = idx / vecs;
  const int64_t i = idx % vecs;
  const int64_t row = c.offsets[c.expert_ids[choice]] + c.ranks[choice];
  static_cast<V*>(p.permuted)[row * vecs + i] = static_cast<const V*>(p.x)[(choice / c.top_k) * vecs + i];
}

// One thread per 16 codes of a choice's row; the row's first threads also
// move its scales, one each (one a row, or one per 128 columns: never more
// than the row's 16-code vectors).
__global__ void MoeGatherFp8Kernel(const MoeGatherParams p) {
  const MoeChoices& c = p.choices;
  const int64_t vecs = p.hidden / 16;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t choices = c.tokens * c.top_k;
  if (idx >= choices * vecs) return;
  const int64_t choice = idx / vecs;
  const int64_t i = idx % vecs;
  const int64_t token = choice / c.top_k;
  const int64_t row = c.offsets[c.expert_ids[choice]] + c.ranks[choice];
  static_cast<uint4*>(p.permuted_codes)[row * vecs + i] = static_cast<const uint4*>(p.fp8_codes)[token * vecs + i];
  const int64_t groups = p.fp8_group == 0 ? 1 : p.hidden / p.fp8_group;
  if (i < groups) p.permuted_scales[i * choices + row] = p.fp8_scales[i * c.tokens + token];
}

template <typename T>
__global__ void MoeCombineKernel(const MoeCombineParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const MoeChoices& c = p.choices;
  const int64_t vecs = p.hidden / kVec;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= c.tokens * vecs) return;
  const int64_t t = idx / vecs;
  const int64_t i = idx % vecs;
  V* x = static_cast<V*>(p.x) + t * vecs + i;
  const V residual = *x;
  float acc[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) acc[e] = ToFloat(residual.v[e]);
  for (int j = 0; j < c.top_k; ++j) {
    const int64_t choice = t * c.top_k + j;
    const int64_t row = c.offsets[c.expert_ids[choice]] + c.ranks[choice];
    const float w = p.weights[choice];
    const V y = static_cast<const V*>(p.y)[row * vecs + i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += w * ToFloat(y.v[e]);
  }
  V out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = FromFloat<T>(acc[e]);
  *x = out;
}

// The dot product x[t] · gate in fp32: bf16/fp16 x and gate, or (an FP8
// gate) e4m3 codes times their scales and a float32 gate.
template <typename T>
__device__ float SharedGateDot(const MoeSharedGateParams& p, int64_t t) {
  float acc = 0.f;
  if (p.x_codes == nullptr) {
    constexpr int kVec = kVec16<T>;
    using V = Vec<T, kVec>;
    const V* x = static_cast<const V*>(p.x) + t * (p.hidden / kVec);
    const V* g = static_cast<const V*>(p.gate);
    for (int64_t i = threadIdx.x; i < p.hidden / kVec; i += kThreads) {
      const V a = x[i];
      const V b = g[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += ToFloat(a.v[e]) * ToFloat(b.v[e]);
    }
    return acc;
  }
  // Eight codes a thread per step (hidden % 8 == 0; a 128-column group holds
  // 16 such steps, so one scale serves all eight).
  const uint2* codes = static_cast<const uint2*>(p.x_codes) + t * (p.hidden / 8);
  const float4* g = static_cast<const float4*>(p.gate);
  for (int64_t i = threadIdx.x; i < p.hidden / 8; i += kThreads) {
    const uint2 c = codes[i];
    const float4 g0 = g[2 * i], g1 = g[2 * i + 1];
    const float s = p.x_group > 0 ? p.x_scales[(8 * i / p.x_group) * p.tokens + t] : p.x_scales[t];
    const __nv_fp8_e4m3* q = reinterpret_cast<const __nv_fp8_e4m3*>(&c);
    const float w[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    float part = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) part += static_cast<float>(q[e]) * w[e];
    acc += part * s;
  }
  return acc;
}

// One block per token: the gate's dot product over the block, then the
// row's scaling. Both passes read 16-byte vectors (8-byte ones of codes).
template <typename T>
__global__ void MoeSharedGateKernel(const MoeSharedGateParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float scale;
  const int64_t t = blockIdx.x;
  float acc = WarpReduceSum(SharedGateDot<T>(p, t));
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float logit = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) logit += warp_sums[w];
    scale = RoundTo<T>(1.f / (1.f + expf(-RoundTo<T>(logit))));
  }
  __syncthreads();
  V* row = static_cast<V*>(p.activation) + t * (p.width / kVec);
  for (int64_t i = threadIdx.x; i < p.width / kVec; i += kThreads) {
    V a = row[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) a.v[e] = FromFloat<T>(ToFloat(a.v[e]) * scale);
    row[i] = a;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

absl::Status CheckShape(const char* op, int64_t tokens, int64_t hidden, int top_k) {
  if (tokens < 0 || hidden <= 0 || hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": hidden must be a positive multiple of 8 (got ", hidden, ") and tokens >= 0"));
  }
  if (top_k < 1 || top_k > kMaxExperts) return absl::InvalidArgumentError(absl::StrCat(op, ": bad top_k ", top_k));
  if (tokens * top_k > INT32_MAX / 2) return absl::InvalidArgumentError(absl::StrCat(op, ": too many tokens"));
  return absl::OkStatus();
}

absl::Status CheckChoices(const char* op, const MoeChoices& c) {
  if (c.expert_ids == nullptr || c.ranks == nullptr || c.offsets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": choices not set"));
  }
  return absl::OkStatus();
}

unsigned Blocks(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

}  // namespace

absl::Status LaunchMoeRoute(const MoeRouteParams& p, cudaStream_t stream) {
  if (p.experts < 1 || p.experts > kMaxExperts || p.top_k < 1 || p.top_k > p.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_route: need 1 <= top_k (", p.top_k, ") <= experts (", p.experts, ") <= ", kMaxExperts));
  }
  if (p.tokens < 0 || p.tokens * p.top_k > INT32_MAX / 2 || p.logits_stride < p.experts) {
    return absl::InvalidArgumentError(absl::StrCat("moe_route: ", p.tokens, " tokens (too many?), logits_stride ",
                                                   p.logits_stride, " (below experts ", p.experts, "?)"));
  }
  if (p.logits == nullptr || p.expert_ids == nullptr || p.weights == nullptr || p.ranks == nullptr ||
      p.offsets == nullptr || p.scratch == nullptr) {
    return absl::InvalidArgumentError("moe_route: null buffer");
  }
  LS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.scratch, 0, sizeof(int32_t) * (p.experts + 1), stream));
  // At least one block, so that an empty batch still gets its offsets.
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, (p.tokens + kRouteWarps - 1) / kRouteWarps));
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeRouteKernel<T><<<blocks, kRouteWarps * 32, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeRouteKernel);
    return absl::OkStatus();
  });
}

absl::Status LaunchMoeGather(const MoeGatherParams& p, cudaStream_t stream) {
  const MoeChoices& c = p.choices;
  if (absl::Status s = CheckShape("moe_gather", c.tokens, p.hidden, c.top_k); !s.ok()) return s;
  if (absl::Status s = CheckChoices("moe_gather", c); !s.ok()) return s;
  if (p.fp8_codes != nullptr) {
    if (p.fp8_scales == nullptr || p.permuted_codes == nullptr || p.permuted_scales == nullptr ||
        !Aligned16(p.fp8_codes) || !Aligned16(p.permuted_codes)) {
      return absl::InvalidArgumentError("moe_gather: null or unaligned FP8 buffer");
    }
    if ((p.fp8_group != 0 && p.fp8_group != 128) || p.hidden % (p.fp8_group == 0 ? 16 : p.fp8_group) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("moe_gather: FP8 rows of ", p.hidden, " codes in groups of ",
                                                     p.fp8_group,
                                                     " (0 or 128, hidden a multiple of 16 and of the group)"));
    }
    if (c.tokens == 0) return absl::OkStatus();
    MoeGatherFp8Kernel<<<Blocks(c.tokens * c.top_k * (p.hidden / 16)), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeGatherFp8Kernel);
    return absl::OkStatus();
  }
  if (p.x == nullptr || p.permuted == nullptr || !Aligned16(p.x) || !Aligned16(p.permuted)) {
    return absl::InvalidArgumentError("moe_gather: null or unaligned buffer");
  }
  if (c.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeGatherKernel<T><<<Blocks(c.tokens * c.top_k * (p.hidden / kVec16<T>)), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeGatherKernel);
    return absl::OkStatus();
  });
}

absl::Status LaunchMoeCombine(const MoeCombineParams& p, cudaStream_t stream) {
  const MoeChoices& c = p.choices;
  if (absl::Status s = CheckShape("moe_combine", c.tokens, p.hidden, c.top_k); !s.ok()) return s;
  if (absl::Status s = CheckChoices("moe_combine", c); !s.ok()) return s;
  if (p.y == nullptr || p.weights == nullptr || p.x == nullptr || !Aligned16(p.y) || !Aligned16(p.x)) {
    return absl::InvalidArgumentError("moe_combine: null or unaligned buffer");
  }
  if (c.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeCombineKernel<T><<<Blocks(c.tokens * (p.hidden / kVec16<T>)), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeCombineKernel);
    return absl::OkStatus();
  });
}

absl::Status LaunchMoeSharedGate(const MoeSharedGateParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.tokens > INT32_MAX || p.hidden <= 0 || p.hidden % 8 != 0 || p.width <= 0 || p.width % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("moe_shared_gate: hidden (", p.hidden, ") and width (", p.width,
                                                   ") must be positive multiples of 8, tokens in range"));
  }
  if (p.x == nullptr || p.gate == nullptr || p.activation == nullptr || !Aligned16(p.x) || !Aligned16(p.gate) ||
      !Aligned16(p.activation)) {
    return absl::InvalidArgumentError("moe_shared_gate: null or unaligned buffer");
  }
  if (p.x_codes != nullptr && (p.x_scales == nullptr || reinterpret_cast<uintptr_t>(p.x_codes) % 8 != 0 ||
                               (p.x_group != 0 && p.x_group != 128))) {
    return absl::InvalidArgumentError(
        "moe_shared_gate: FP8 input needs 8-byte aligned codes, scales and group 0 or 128");
  }
  if (p.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeSharedGateKernel<T><<<static_cast<unsigned>(p.tokens), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeSharedGateKernel);
    return absl::OkStatus();
  });
}

}  // namespace layerserve::kernels
