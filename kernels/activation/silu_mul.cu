// Launcher of the SiLU-gate-multiply kernel: validation, grid, dtype dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/common/static_switch.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
absl::Status Launch(const SiluMulParams& p, cudaStream_t stream) {
  const int64_t vecs = p.rows * (p.width / kVec16<T>);
  const int64_t blocks = (vecs + kThreads - 1) / kThreads;
  activation::SiluMulKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(SiluMulKernel);
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.block <= 0 || p.block % kGateUpBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat("silu_mul: the interleave block must be a positive multiple of ",
                                                   kGateUpBlock, " (got ", p.block, ")"));
  }
  if (p.rows < 0 || p.width <= 0 || p.width % p.block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("silu_mul: width must be a positive multiple of the block ", p.block,
                                                   " (got ", p.width, ") and rows >= 0"));
  }
  if (p.gate_up == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("silu_mul: gate_up and out must be set");
  }
  if (reinterpret_cast<uintptr_t>(p.gate_up) % 16 != 0 || reinterpret_cast<uintptr_t>(p.out) % 16 != 0) {
    return absl::InvalidArgumentError("silu_mul: buffers must be 16-byte aligned");
  }
  if (p.rows * (p.width / 8) / kThreads >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("silu_mul: tensor too large for one launch");
  }
  if (p.rows == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] { return Launch<T>(p, stream); });
}

}  // namespace layerserve::kernels
