// Host launcher of version 1 (gemm_v1_mma_sync.cuh): a persistent grid of as
// many CTAs as fit on the device at once, capped by the tile count.
#include <algorithm>

#include "kernels/gemm/gemm_internal.h"
#include "kernels/gemm/gemm_v1_mma_sync.cuh"

namespace layerserve::kernels::gemm {

absl::Status LaunchGemmV1(const GemmParams& p, const DeviceInfo& dev, cudaStream_t stream) {
  const GemmArgs args = MakeGemmArgs(p, v1::kBlockM, v1::kBlockN);
  LS_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(v1::GemmMmaSyncKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v1::kSmemBytes));
  int per_sm = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v1::GemmMmaSyncKernel,
                                                                        v1::kThreads, v1::kSmemBytes));
  if (per_sm < 1) return absl::ResourceExhaustedError("gemm v1: kernel does not fit on an SM");
  const int grid = std::min(args.tiles_m * args.tiles_n, per_sm * dev.num_sms);
  v1::GemmMmaSyncKernel<<<grid, v1::kThreads, v1::kSmemBytes, stream>>>(args);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(GemmMmaSyncKernel);
  return absl::OkStatus();
}

}  // namespace layerserve::kernels::gemm
