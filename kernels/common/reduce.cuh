// Warp-level reductions shared by the normalization, attention and
// mixture-of-experts kernels.
#pragma once

namespace layerserve::kernels {

__device__ __forceinline__ float WarpReduceSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float WarpReduceMax(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Inclusive prefix sum over the warp's lanes: lane i gets x of lanes 0..i.
// Every lane of the warp must call it.
__device__ __forceinline__ int WarpInclusiveSum(int x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += other;
  }
  return x;
}

// Reduces over the 4 lanes of a quad (lanes 4k..4k+3): the lanes that hold one
// row of an mma.sync accumulator fragment.
__device__ __forceinline__ float QuadReduceSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

__device__ __forceinline__ float QuadReduceMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}

}  // namespace layerserve::kernels
