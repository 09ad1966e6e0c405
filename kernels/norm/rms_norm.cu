// Launcher of the fused residual-add + RMSNorm kernel: validation, the choice
// between a warp and a CTA per row, and the dtype dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/common/static_switch.h"
#include "kernels/norm/rms_norm.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
// Up to this width a single warp owns a row (at most 4 vectors per lane),
// and a CTA normalizes 8 rows at once; wider rows get a whole CTA each.
constexpr int64_t kMaxWarpRowCols = 1024;
// The parked row lives in shared memory; 48 KiB needs no opt-in.
constexpr int64_t kMaxSmemBytes = 48 * 1024;

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, int kWarpsPerRow>
absl::Status Launch(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kWarpsPerBlock / kWarpsPerRow;
  const size_t smem_bytes = static_cast<size_t>(kRowsPerBlock) * p.cols * sizeof(T);
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  // A programmatic dependent of the GEMM that wrote x (kernels/common/pdl.cuh).
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(norm::RmsNormKernel<T, kWarpsPerRow, kWarpsPerBlock>,
                                          dim3(static_cast<unsigned>(blocks)), dim3(kWarpsPerBlock * 32), smem_bytes,
                                          stream, p));
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols <= 0 || p.cols % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm: cols must be a positive multiple of 8 (got ", p.cols, ") and rows >= 0"));
  }
  if (p.cols * 2 > kMaxSmemBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rms_norm: cols ", p.cols, " wider than supported"));
  }
  if (p.rows >= (int64_t{1} << 31)) return absl::InvalidArgumentError("rms_norm: too many rows");
  if (p.x == nullptr || p.weight == nullptr || p.y == nullptr || (p.residual != nullptr && p.h_out == nullptr)) {
    return absl::InvalidArgumentError("rms_norm: x, weight, y (and h_out with a residual) must be set");
  }
  if (!Aligned16(p.x) || !Aligned16(p.weight) || !Aligned16(p.y) || !Aligned16(p.residual) || !Aligned16(p.h_out)) {
    return absl::InvalidArgumentError("rms_norm: buffers must be 16-byte aligned");
  }
  if (!(p.eps >= 0.f)) return absl::InvalidArgumentError("rms_norm: eps must be >= 0");
  if (p.fp8_codes != nullptr) {
    if (p.dtype != DType::kBF16 || p.fp8_scales == nullptr || !Aligned16(p.fp8_codes)) {
      return absl::InvalidArgumentError("rms_norm: an FP8 output takes bf16 rows, scales and 16-byte aligned codes");
    }
    if ((p.fp8_group != 0 && p.fp8_group != 128) || (p.fp8_group == 128 && p.cols % 128 != 0) ||
        (p.fp8_group != 0 && p.fp8_static_scale > 0.f)) {
      return absl::InvalidArgumentError(absl::StrCat("rms_norm: FP8 groups of 0 or 128 columns (cols ", p.cols,
                                                     " a multiple of them; static scales per row only), got ",
                                                     p.fp8_group));
    }
  }
  if (p.rows == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
    return p.cols <= kMaxWarpRowCols ? Launch<T, 1>(p, stream) : Launch<T, kWarpsPerBlock>(p, stream);
  });
}

}  // namespace layerserve::kernels
