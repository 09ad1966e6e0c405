// Launcher of the dtype conversion kernel: validation, vector width choice by
// alignment, and the (source, destination) dtype dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cast/cast.cuh"
#include "kernels/common/static_switch.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVecElems = 8;  // 16 bytes of a 16-bit type, 32 of fp32

template <typename Src, typename Dst>
absl::Status Launch(const CastParams& p, cudaStream_t stream) {
  const auto* src = static_cast<const Src*>(p.src);
  auto* dst = static_cast<Dst*>(p.dst);
  // Vector access needs each thread's first element aligned to the vector.
  const bool vector_ok = reinterpret_cast<uintptr_t>(src) % (kVecElems * sizeof(Src)) == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % (kVecElems * sizeof(Dst)) == 0;
  if (vector_ok) {
    const int64_t blocks = (p.n + int64_t{kThreads} * kVecElems - 1) / (int64_t{kThreads} * kVecElems);
    cast::CastKernel<Src, Dst, kVecElems><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, dst, p.n);
  } else {
    const int64_t blocks = (p.n + kThreads - 1) / kThreads;
    cast::CastKernel<Src, Dst, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, dst, p.n);
  }
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(CastKernel);
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchCast(const CastParams& p, cudaStream_t stream) {
  if (p.n < 0 || p.n / kThreads >= (int64_t{1} << 31)) return absl::InvalidArgumentError("cast: n out of range");
  if (p.n == 0) return absl::OkStatus();
  if (p.src == nullptr || p.dst == nullptr) return absl::InvalidArgumentError("cast: src and dst must be set");
  return LS_ANY_DTYPE_SWITCH(p.src_dtype, Src, [&] {
    return LS_ANY_DTYPE_SWITCH(p.dst_dtype, Dst, [&] { return Launch<Src, Dst>(p, stream); });
  });
}

}  // namespace layerserve::kernels
