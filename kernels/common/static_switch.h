// Runtime -> compile-time dispatch for the kernel launchers (STYLE rule 6).
//
// Each macro turns one runtime value (an activation dtype, a head dimension, a
// flag) into a compile-time name visible inside the lambda it is given, and
// answers INVALID_ARGUMENT for values no kernel was built for. This header is
// the one place that bounds which template combinations get instantiated.
// Only .cu launchers include it (it names the CUDA half types).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "layerserve/kernels/common.h"

// `T` is __nv_bfloat16 or __half: the 16-bit activation types.
#define LS_HALF_DTYPE_SWITCH(dtype, T, ...)                                \
  [&]() -> ::absl::Status {                                                \
    switch (dtype) {                                                       \
      case ::layerserve::kernels::DType::kBF16: {                          \
        using T = __nv_bfloat16;                                           \
        return __VA_ARGS__();                                              \
      }                                                                    \
      case ::layerserve::kernels::DType::kF16: {                           \
        using T = __half;                                                  \
        return __VA_ARGS__();                                              \
      }                                                                    \
      default:                                                             \
        return ::absl::InvalidArgumentError("dtype must be bf16 or fp16"); \
    }                                                                      \
  }()

// `T` is float, __nv_bfloat16 or __half.
#define LS_ANY_DTYPE_SWITCH(dtype, T, ...)                \
  [&]() -> ::absl::Status {                               \
    switch (dtype) {                                      \
      case ::layerserve::kernels::DType::kF32: {          \
        using T = float;                                  \
        return __VA_ARGS__();                             \
      }                                                   \
      case ::layerserve::kernels::DType::kBF16: {         \
        using T = __nv_bfloat16;                          \
        return __VA_ARGS__();                             \
      }                                                   \
      case ::layerserve::kernels::DType::kF16: {          \
        using T = __half;                                 \
        return __VA_ARGS__();                             \
      }                                                   \
    }                                                     \
    return ::absl::InvalidArgumentError("unknown dtype"); \
  }()

// `kHeadDim` is 64 or 128: the head sizes the attention kernels are built for.
#define LS_HEAD_DIM_SWITCH(head_dim, kHeadDim, ...)                                                      \
  [&]() -> ::absl::Status {                                                                              \
    if ((head_dim) == 64) {                                                                              \
      constexpr int kHeadDim = 64;                                                                       \
      return __VA_ARGS__();                                                                              \
    }                                                                                                    \
    if ((head_dim) == 128) {                                                                             \
      constexpr int kHeadDim = 128;                                                                      \
      return __VA_ARGS__();                                                                              \
    }                                                                                                    \
    return ::absl::InvalidArgumentError(::absl::StrCat("head_dim must be 64 or 128, got ", (head_dim))); \
  }()

// `kName` is a constexpr bool equal to `cond`.
#define LS_BOOL_SWITCH(cond, kName, ...) \
  [&]() -> ::absl::Status {              \
    if (cond) {                          \
      constexpr bool kName = true;       \
      return __VA_ARGS__();              \
    }                                    \
    constexpr bool kName = false;        \
    return __VA_ARGS__();                \
  }()
