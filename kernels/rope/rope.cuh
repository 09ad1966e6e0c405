// Device code of rotary position embedding (rotate-half), in place on the q
// and k heads of a fused qkv row.
//
// One CTA per token. Its threads first compute the head_dim/2 angles
// inv_freq[i] * position in fp32 and their cos/sin with the precise sincosf,
// rounded to T: Hugging Face computes cos/sin in fp32 and casts them to the
// activation dtype before multiplying, and this matches that rounding. Then
// each thread rotates 8-element chunks (16-byte loads) of the first and
// second halves of a head together:
//   out[i]       = x[i] * cos[i] - x[i + d/2] * sin[i]
//   out[i + d/2] = x[i + d/2] * cos[i] + x[i] * sin[i]
// with every product and the sum rounded to T, as the T ops of
// q * cos + rotate_half(q) * sin are.
//
// Qwen3 normalises each q and k head first (NormHeads, a warp per head).
//
// The steps are device functions of their own (ComputeCosSin, NormHeads, RotateRow),
// so that the session path's kernel (RoPE and the KV-cache write in one
// launch, kernels/attention/paged_attention.cuh) rotates exactly as this one
// does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/dtype.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/reduce.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels::rope {

// INVALID_ARGUMENT for params LaunchRope refuses (defined in rope.cu; shared
// with the session path's launcher of RoPE and the cache write).
absl::Status ValidateRopeParams(const RopeParams& p);

// Shared memory a CTA needs: [head_dim / 2] cos, then [head_dim / 2] sin.
inline size_t CosSinBytes(int head_dim) { return static_cast<size_t>(head_dim) * sizeof(float); }

// Fills cos_sin with the rounded cos and sin of `position`'s angles; every
// thread of the CTA calls it (it ends with a barrier).
template <typename T>
__device__ __forceinline__ void ComputeCosSin(const float* inv_freq, int32_t position, int half, float* cos_sin) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(inv_freq[i] * static_cast<float>(position), &s, &c);
    cos_sin[i] = RoundTo<T>(c);
    cos_sin[half + i] = RoundTo<T>(s);
  }
  __syncthreads();
}

// Rotates chunk [i0, i0 + kVec) of a head's first half (x1) with the same
// chunk of its second half (x2), in registers.
template <typename T, int N>
__device__ __forceinline__ void RotateChunk(const float* cos_sin, int half, int i0, Vec<T, N>& x1, Vec<T, N>& x2) {
  Vec<T, N> o1, o2;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float c = cos_sin[i0 + e];
    const float s = cos_sin[half + i0 + e];
    const float a = ToFloat(x1.v[e]);
    const float b = ToFloat(x2.v[e]);
    o1.v[e] = FromFloat<T>(RoundTo<T>(a * c) - RoundTo<T>(b * s));
    o2.v[e] = FromFloat<T>(RoundTo<T>(b * c) + RoundTo<T>(a * s));
  }
  x1 = o1;
  x2 = o2;
}

// Rotates every q and k head of one token's fused qkv row in place, the
// CTA's threads taking 16-byte chunks of both halves of a head together.
// on_k_chunk(kv_head, i0, x1, x2) sees each rotated k chunk pair (elements
// [i0, i0 + kVec) and [i0 + d/2, i0 + d/2 + kVec) of that head) while it is
// still in registers.
template <typename T, typename OnKChunk>
__device__ __forceinline__ void RotateRow(T* row, const float* cos_sin, int num_heads, int num_kv_heads, int head_dim,
                                          OnKChunk on_k_chunk) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const int half = head_dim / 2;
  const int chunks_per_half = half / kVec;
  const int items = (num_heads + num_kv_heads) * chunks_per_half;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / chunks_per_half;
    const int i0 = (item % chunks_per_half) * kVec;
    V* first = reinterpret_cast<V*>(row + head * head_dim + i0);
    V* second = reinterpret_cast<V*>(row + head * head_dim + half + i0);
    V x1 = *first;
    V x2 = *second;
    RotateChunk(cos_sin, half, i0, x1, x2);
    *first = x1;
    *second = x2;
    if (head >= num_heads) on_k_chunk(head - num_heads, i0, x1, x2);
  }
}

// Qwen3's head norms: RMSNorm over each q head (weight q_norm) and each k
// head (k_norm) of one token's row, in place, one warp per head, its lanes
// on 16-byte chunks. Rounds as the layer RMSNorm does: h * rsqrt(mean(h^2) +
// eps) to T, then weight * that to T. Every thread of the CTA calls it (it
// ends with a barrier, after which the CTA reads the normed heads).
template <typename T>
__device__ __forceinline__ void NormHeads(T* row, const RopeParams& p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const int chunks = p.head_dim / kVec;  // at most 128 (head_dim <= 1024)
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  for (int head = threadIdx.x / 32; head < p.num_heads + p.num_kv_heads; head += warps) {
    V* h = reinterpret_cast<V*>(row + head * p.head_dim);
    const V* w = static_cast<const V*>(head < p.num_heads ? p.q_norm : p.k_norm);
    V x[4];  // this lane's chunks lane, lane + 32, ...
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (lane + 32 * c >= chunks) break;
      x[c] = h[lane + 32 * c];
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_sq += ToFloat(x[c].v[e]) * ToFloat(x[c].v[e]);
    }
    const float r = rsqrtf(WarpReduceSum(sum_sq) / static_cast<float>(p.head_dim) + p.norm_eps);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (lane + 32 * c >= chunks) break;
      const V weight = w[lane + 32 * c];
      V y;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        y.v[e] = FromFloat<T>(ToFloat(weight.v[e]) * RoundTo<T>(ToFloat(x[c].v[e]) * r));
      }
      h[lane + 32 * c] = y;
    }
  }
  __syncthreads();
}

template <typename T>
__global__ void RopeKernel(const RopeParams p) {
  extern __shared__ float cos_sin[];
  AllowDependentLaunch();
  WaitForPrerequisiteGrids();  // launched as a dependent of the QKV GEMM
  const int64_t token = blockIdx.x;
  ComputeCosSin<T>(p.inv_freq, p.positions[token], p.head_dim / 2, cos_sin);
  T* row = static_cast<T*>(p.qkv) + token * (p.num_heads + 2 * p.num_kv_heads) * p.head_dim;
  if (p.q_norm != nullptr) NormHeads(row, p);
  RotateRow(row, cos_sin, p.num_heads, p.num_kv_heads, p.head_dim, [](int, int, const auto&, const auto&) {});
}

}  // namespace layerserve::kernels::rope
