// The mixture-of-experts kernels around the grouped GEMM (moe.h): routing,
// the permutation into expert order, and the weighted combine.
//
// Routing is one warp per token: the lanes split the hidden dimension in
// 16-byte vectors, each expert's logit is a warp sum, and lane 0 picks the
// top k from the logits in shared memory (k passes of an argmax: k and the
// expert count are small). The permutation is one block: a scan of the
// per-expert counts into offsets, then each choice claims the next row of its
// expert with a shared-memory atomic; a second, wide kernel copies each
// token's activations into its rows. The combine is one thread per 16-byte
// vector of a token's output, summing its k rows in choice order.
#include <cuda_runtime.h>

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

constexpr int kRouteWarps = 8;  // tokens per routing block
constexpr int kPermuteThreads = 1024;
constexpr int kThreads = 256;

// NaN ranks below every number, so a poisoned token still picks valid,
// distinct experts.
__device__ __forceinline__ float Rank(float p) { return isnan(p) ? -INFINITY : p; }

template <typename T>
__global__ void MoeRouteKernel(const MoeRouteParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  __shared__ float logits[kRouteWarps][kMaxExperts];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t token = int64_t{blockIdx.x} * kRouteWarps + warp;
  if (token >= p.tokens) return;
  const int64_t vecs = p.hidden / kVec;
  const V* x = static_cast<const V*>(p.x) + token * vecs;
  const V* router = static_cast<const V*>(p.router);
  float* l = logits[warp];
  for (int e = 0; e < p.experts; ++e) {
    float acc = 0.f;
    for (int64_t i = lane; i < vecs; i += 32) {
      const V a = x[i];
      const V b = router[e * vecs + i];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc += ToFloat(a.v[j]) * ToFloat(b.v[j]);
    }
    acc = WarpReduceSum(acc);
    if (lane == 0) l[e] = acc;
  }
  if (lane != 0) return;
  float max_logit = -INFINITY;
  for (int e = 0; e < p.experts; ++e) max_logit = fmaxf(max_logit, l[e]);
  float sum = 0.f;
  for (int e = 0; e < p.experts; ++e) {
    l[e] = expf(l[e] - max_logit);
    sum += l[e];
  }
  for (int e = 0; e < p.experts; ++e) l[e] /= sum;
  float chosen_sum = 0.f;
  int32_t* ids = p.expert_ids + token * p.top_k;
  float* weights = p.weights + token * p.top_k;
  for (int j = 0; j < p.top_k; ++j) {
    int best = -1;
    float best_rank = 0.f;
    for (int e = 0; e < p.experts; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= ids[i] == e;
      if (taken) continue;
      const float r = Rank(l[e]);
      if (best < 0 || r > best_rank) {
        best = e;
        best_rank = r;
      }
    }
    ids[j] = best;
    weights[j] = l[best];
    chosen_sum += l[best];
    atomicAdd(p.counts + best, 1);
  }
  for (int j = 0; j < p.top_k; ++j) weights[j] /= chosen_sum;
}

// One block: offsets from the counts, then a row for every choice.
__global__ void MoeOffsetsKernel(const MoePermuteParams p) {
  __shared__ int32_t next[kMaxExperts];
  if (threadIdx.x == 0) {
    int32_t running = 0;
    for (int e = 0; e < p.experts; ++e) {
      p.offsets[e] = running;
      next[e] = running;
      running += p.counts[e];
    }
    p.offsets[p.experts] = running;
  }
  __syncthreads();
  const int64_t choices = p.tokens * p.top_k;
  for (int64_t c = threadIdx.x; c < choices; c += blockDim.x) {
    p.rows[c] = atomicAdd(&next[p.expert_ids[c]], 1);
  }
}

// permuted[rows[c]] = x[c / top_k], one 16-byte vector per thread.
template <typename T>
__global__ void MoeGatherKernel(const MoePermuteParams p) {
  using V = Vec<T, kVec16<T>>;
  const int64_t vecs = p.hidden / kVec16<T>;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * p.top_k * vecs) return;
  const int64_t c = idx / vecs;
  const int64_t i = idx % vecs;
  static_cast<V*>(p.permuted)[p.rows[c] * vecs + i] = static_cast<const V*>(p.x)[(c / p.top_k) * vecs + i];
}

template <typename T>
__global__ void MoeCombineKernel(const MoeCombineParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const int64_t vecs = p.hidden / kVec;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * vecs) return;
  const int64_t t = idx / vecs;
  const int64_t i = idx % vecs;
  V* x = static_cast<V*>(p.x) + t * vecs + i;
  const V residual = *x;
  float acc[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) acc[e] = ToFloat(residual.v[e]);
  for (int j = 0; j < p.top_k; ++j) {
    const float w = p.weights[t * p.top_k + j];
    const V y = static_cast<const V*>(p.y)[p.rows[t * p.top_k + j] * vecs + i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += w * ToFloat(y.v[e]);
  }
  V out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = FromFloat<T>(acc[e]);
  *x = out;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

absl::Status CheckShape(const char* op, int64_t tokens, int64_t hidden, int experts, int top_k) {
  if (tokens < 0 || hidden <= 0 || hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": hidden must be a positive multiple of 8 (got ", hidden, ") and tokens >= 0"));
  }
  if (experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": need 1 <= top_k (", top_k, ") <= experts (", experts, ") <= ", kMaxExperts));
  }
  if (tokens * top_k > INT32_MAX / 2) return absl::InvalidArgumentError(absl::StrCat(op, ": too many tokens"));
  return absl::OkStatus();
}

unsigned Blocks(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

}  // namespace

absl::Status LaunchMoeRoute(const MoeRouteParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckShape("moe_route", p.tokens, p.hidden, p.experts, p.top_k); !s.ok()) return s;
  if (p.x == nullptr || p.router == nullptr || p.expert_ids == nullptr || p.weights == nullptr || p.counts == nullptr ||
      !Aligned16(p.x) || !Aligned16(p.router)) {
    return absl::InvalidArgumentError("moe_route: null or unaligned buffer");
  }
  LS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * p.experts, stream));
  if (p.tokens == 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>((p.tokens + kRouteWarps - 1) / kRouteWarps);
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeRouteKernel<T><<<blocks, kRouteWarps * 32, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeRouteKernel);
    return absl::OkStatus();
  });
}

absl::Status LaunchMoePermute(const MoePermuteParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckShape("moe_permute", p.tokens, p.hidden, p.experts, p.top_k); !s.ok()) return s;
  if (p.expert_ids == nullptr || p.counts == nullptr || p.x == nullptr || p.offsets == nullptr || p.rows == nullptr ||
      p.permuted == nullptr || !Aligned16(p.x) || !Aligned16(p.permuted)) {
    return absl::InvalidArgumentError("moe_permute: null or unaligned buffer");
  }
  MoeOffsetsKernel<<<1, kPermuteThreads, 0, stream>>>(p);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeOffsetsKernel);
  if (p.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeGatherKernel<T><<<Blocks(p.tokens * p.top_k * (p.hidden / kVec16<T>)), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeGatherKernel);
    return absl::OkStatus();
  });
}

absl::Status LaunchMoeCombine(const MoeCombineParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckShape("moe_combine", p.tokens, p.hidden, p.top_k, p.top_k); !s.ok()) return s;
  if (p.y == nullptr || p.rows == nullptr || p.weights == nullptr || p.x == nullptr || !Aligned16(p.y) ||
      !Aligned16(p.x)) {
    return absl::InvalidArgumentError("moe_combine: null or unaligned buffer");
  }
  if (p.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    MoeCombineKernel<T><<<Blocks(p.tokens * (p.hidden / kVec16<T>)), kThreads, 0, stream>>>(p);
    LS_CUDA_RETURN_IF_LAUNCH_ERROR(MoeCombineKernel);
    return absl::OkStatus();
  });
}

}  // namespace layerserve::kernels
