// Launcher of the in-place rotary embedding kernel: validation, one CTA per
// token, dtype dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/common/static_switch.h"
#include "kernels/rope/rope.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

constexpr int kThreads = 128;

template <typename T>
absl::Status Launch(const RopeParams& p, cudaStream_t stream) {
  const size_t smem_bytes = rope::CosSinBytes(p.head_dim);
  // A programmatic dependent of the QKV GEMM (kernels/common/pdl.cuh).
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(rope::RopeKernel<T>, dim3(static_cast<unsigned>(p.tokens)), dim3(kThreads),
                                          smem_bytes, stream, p));
  return absl::OkStatus();
}

}  // namespace

absl::Status rope::ValidateRopeParams(const RopeParams& p) {
  // Each half of a head is rotated in 16-byte chunks of 8 elements.
  if (p.head_dim <= 0 || p.head_dim % 16 != 0 || p.head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: head_dim must be a multiple of 16 up to 1024, got ", p.head_dim));
  }
  if (p.tokens < 0 || p.tokens >= (int64_t{1} << 31) || p.num_heads < 0 || p.num_kv_heads < 0) {
    return absl::InvalidArgumentError("rope: tokens and head counts must be in range");
  }
  if (p.qkv == nullptr || p.positions == nullptr || p.inv_freq == nullptr) {
    return absl::InvalidArgumentError("rope: qkv, positions and inv_freq must be set");
  }
  if (reinterpret_cast<uintptr_t>(p.qkv) % 16 != 0) {
    return absl::InvalidArgumentError("rope: qkv must be 16-byte aligned");
  }
  if ((p.q_norm == nullptr) != (p.k_norm == nullptr) || reinterpret_cast<uintptr_t>(p.q_norm) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.k_norm) % 16 != 0 || !(p.norm_eps > 0.f)) {
    return absl::InvalidArgumentError(
        "rope: q_norm and k_norm must both be set (16-byte aligned) or both null, and norm_eps "
        "positive");
  }
  return absl::OkStatus();
}

absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream) {
  LS_RETURN_IF_ERROR(rope::ValidateRopeParams(p));
  if (p.tokens == 0 || p.num_heads + p.num_kv_heads == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] { return Launch<T>(p, stream); });
}

}  // namespace layerserve::kernels
