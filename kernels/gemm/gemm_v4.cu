// Host launcher of version 4 (gemm_v4_small_m_sm90.cuh): picks the token
// padding (the wgmma N), builds tensor maps over W (128-row boxes) and A
// (m_pad-row boxes, rows past m zero-filled) and launches tiles x splits CTAs
// in clusters of `splits` (the CTAs that share one W tile), with programmatic
// dependent launch. The kernel reads W before it waits for the preceding
// grid, so the kernel just before it on the stream must not write W (weights
// are written once, at load); A, the residual and C are free of that rule.
// A grouped product launches a grid row per group (blockIdx.y).
#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/gemm/gemm_heuristics.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/gemm/gemm_v4_small_m_sm90.cuh"

namespace layerserve::kernels::gemm {
namespace {

static_assert(v4::kMaxSplits == kMaxSplitK, "kernel and host agree on the largest split");

template <int kMPad>
absl::Status Launch(const DenseGemm& p, int splits, cudaStream_t stream) {
  using L = v4::Layout<kMPad>;
  GemmArgs args = MakeGemmArgs(p, /*block_m=*/kMPad, v4::kBlockN);
  args.splits = splits;
  const int64_t w_rows = p.group_offsets != nullptr ? p.groups * p.n : p.n;
  absl::StatusOr<CUtensorMap> map_w = MakeBf16TensorMap(p.w, w_rows, p.k, v4::kBlockN);
  if (!map_w.ok()) return map_w.status();
  absl::StatusOr<CUtensorMap> map_a = MakeBf16TensorMap(p.a, p.m, p.k, kMPad);
  if (!map_a.ok()) return map_a.status();
  LS_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(v4::GemmSmallMKernel<kMPad>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes));
  // Programmatic dependent launch: the kernel may start before the preceding
  // kernel on the stream completes, and streams W meanwhile. Grouped
  // products: one grid row per group.
  const dim3 grid(static_cast<unsigned>(args.tiles_n * splits),
                  static_cast<unsigned>(p.group_offsets != nullptr ? p.groups : 1));
  LS_CUDA_RETURN_IF_ERROR(LaunchDependentInClusters(v4::GemmSmallMKernel<kMPad>, grid, dim3(v4::kThreads),
                                                    L::kSmemBytes, static_cast<unsigned>(splits), stream, *map_w,
                                                    *map_a, args));
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchGemmV4(const DenseGemm& p, int splits, const DeviceInfo& dev, cudaStream_t stream) {
  if (dev.max_smem_optin < v4::Layout<v4::kMaxM>::kSmemBytes) {
    return absl::ResourceExhaustedError("gemm v4: not enough shared memory");
  }
  if (splits < 1 || splits > v4::kMaxSplits) return absl::InvalidArgumentError("gemm v4: splits must be 1..8");
  // Tokens padded to the wgmma N; a grouped product pads every group to a
  // bound on its rows.
  switch (SmallMPad(p.group_offsets != nullptr ? p.max_group_rows : p.m)) {
    case 8:
      return Launch<8>(p, splits, stream);
    case 16:
      return Launch<16>(p, splits, stream);
    case 32:
      return Launch<32>(p, splits, stream);
    case 64:
      return Launch<64>(p, splits, stream);
    default:
      return absl::InvalidArgumentError("gemm v4: m must be <= 64");
  }
}

}  // namespace layerserve::kernels::gemm
