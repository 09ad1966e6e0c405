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
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels::rope {

template <typename T>
__global__ void RopeKernel(const RopeParams p) {
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  extern __shared__ float cos_sin[];  // [head_dim / 2] cos, then [head_dim / 2] sin
  const int half = p.head_dim / 2;
  const int64_t token = blockIdx.x;
  const float position = static_cast<float>(p.positions[token]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(p.inv_freq[i] * position, &s, &c);
    cos_sin[i] = RoundTo<T>(c);
    cos_sin[half + i] = RoundTo<T>(s);
  }
  __syncthreads();

  const int chunks_per_half = half / kVec;
  const int items = (p.num_heads + p.num_kv_heads) * chunks_per_half;
  T* row = static_cast<T*>(p.qkv) + token * (p.num_heads + 2 * p.num_kv_heads) * p.head_dim;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / chunks_per_half;
    const int i0 = (item % chunks_per_half) * kVec;
    V* first = reinterpret_cast<V*>(row + head * p.head_dim + i0);
    V* second = reinterpret_cast<V*>(row + head * p.head_dim + half + i0);
    const V x1 = *first;
    const V x2 = *second;
    V o1, o2;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float c = cos_sin[i0 + e];
      const float s = cos_sin[half + i0 + e];
      const float a = ToFloat(x1.v[e]);
      const float b = ToFloat(x2.v[e]);
      o1.v[e] = FromFloat<T>(RoundTo<T>(a * c) - RoundTo<T>(b * s));
      o2.v[e] = FromFloat<T>(RoundTo<T>(b * c) + RoundTo<T>(a * s));
    }
    *first = o1;
    *second = o2;
  }
}

}  // namespace layerserve::kernels::rope
