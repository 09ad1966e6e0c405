// Device-side element types: conversions to and from fp32 and 16-byte vectors.
//
// Every kernel computes in fp32 and rounds to the activation dtype exactly
// where PyTorch/Hugging Face would round (round-to-nearest-even), so the
// helpers here are the only place conversions are spelled.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace layerserve::kernels {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}

// x rounded to T and back: models one PyTorch op whose result has dtype T.
template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  return ToFloat(FromFloat<T>(x));
}

// N elements of T loaded or stored as one aligned vector (16 bytes per
// instruction when N * sizeof(T) is a multiple of 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements of T in one 16-byte access.
template <typename T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

}  // namespace layerserve::kernels
