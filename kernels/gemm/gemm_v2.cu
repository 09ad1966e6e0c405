// Host launcher of version 2 (gemm_v2_tma_wgmma_sm90.cuh): tensor maps for A
// and W, one persistent CTA per SM.
#include <algorithm>

#include "kernels/gemm/gemm_internal.h"
#include "kernels/gemm/gemm_v2_tma_wgmma_sm90.cuh"

namespace layerserve::kernels::gemm {

absl::Status LaunchGemmV2(const GemmParams& p, const DeviceInfo& dev, cudaStream_t stream) {
  const GemmArgs args = MakeGemmArgs(p, v2::kBlockM, v2::kBlockN);
  absl::StatusOr<CUtensorMap> map_a = MakeBf16TensorMap(p.a, p.m, p.k, v2::kBlockM);
  if (!map_a.ok()) return map_a.status();
  absl::StatusOr<CUtensorMap> map_w = MakeBf16TensorMap(p.w, p.n, p.k, v2::kBlockN);
  if (!map_w.ok()) return map_w.status();
  if (dev.max_smem_optin < v2::kSmemBytes) return absl::ResourceExhaustedError("gemm v2: not enough shared memory");
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(v2::GemmTmaWgmmaKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               v2::kSmemBytes));
  const int grid = std::min(args.tiles_m * args.tiles_n, dev.num_sms);
  v2::GemmTmaWgmmaKernel<<<grid, v2::kThreads, v2::kSmemBytes, stream>>>(*map_a, *map_w, args);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(GemmTmaWgmmaKernel);
  return absl::OkStatus();
}

}  // namespace layerserve::kernels::gemm
