// Host launcher of version 6, the FP8 GEMM. M <= 64: the decode kernel
// (gemm_fp8_sm90.cuh) with the token tile (the wgmma N, 8..64, M padded up),
// tensor maps over the e4m3 codes of W (128-row boxes) and A (token-tile
// boxes, rows past m zero-filled), and tiles x splits CTAs in clusters of
// `splits`, with programmatic dependent launch (the kernel reads W before it
// waits for the preceding grid, as version 4 does). M > 64: the persistent
// prefill kernel (gemm_fp8_prefill_sm90.cuh), one CTA per SM at most, 128 x
// 128 tiles of A and W. Grouped products (a mixture of experts) take the
// decode kernel while a group's rows are bounded by kFp8GroupedDecodeRows (a
// grid row per slot: a bound on the (group with rows, token tile) pairs), and
// the prefill kernel's grouped schedule above.
#include <algorithm>
#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/gemm/gemm_fp8_prefill_sm90.cuh"
#include "kernels/gemm/gemm_fp8_sm90.cuh"
#include "kernels/gemm/gemm_heuristics.h"
#include "kernels/gemm/gemm_internal.h"

namespace layerserve::kernels::gemm {
namespace {

static_assert(fp8::kMaxSplits == kMaxSplitK, "kernel and host agree on the largest split");

fp8::Fp8GemmArgs MakeArgs(const DenseGemm& p, int splits) {
  fp8::Fp8GemmArgs args{};
  args.a_scale = p.a_scale;
  args.w_scale = p.w_scale;
  args.bias = static_cast<const __nv_bfloat16*>(p.bias);
  args.residual = static_cast<const __nv_bfloat16*>(p.residual);
  args.c = static_cast<__nv_bfloat16*>(p.c);
  args.m = static_cast<int>(p.m);
  args.n = static_cast<int>(p.n);
  args.k = static_cast<int>(p.k);
  args.ldc = static_cast<int>(p.silu_mul ? p.n / 2 : p.n);
  args.kblocks = static_cast<int>((p.k + fp8::kBlockK - 1) / fp8::kBlockK);
  args.splits = splits;
  args.silu_mul = p.silu_mul;
  args.group_offsets = p.group_offsets;
  args.groups = p.group_offsets != nullptr ? p.groups : 1;
  // One group's scales: per row, or per 64 rows and K block.
  args.w_scale_stride = p.fp8 == Fp8Scaling::kBlock ? (p.n + fp8::kHalfRows - 1) / fp8::kHalfRows * args.kblocks : p.n;
  return args;
}

template <int kTokN, bool kBlockScaled, int kBlocks = 2>
absl::Status Launch(const DenseGemm& p, int splits, cudaStream_t stream) {
  using L = fp8::Layout<kTokN, kBlocks>;
  const fp8::Fp8GemmArgs args = MakeArgs(p, splits);
  absl::StatusOr<CUtensorMap> map_w = MakeFp8TensorMap(p.w, args.groups * p.n, p.k, fp8::kBlockN);
  if (!map_w.ok()) return map_w.status();
  absl::StatusOr<CUtensorMap> map_a = MakeFp8TensorMap(p.a, p.m, p.k, kTokN);
  if (!map_a.ok()) return map_a.status();
  const auto kernel = fp8::Fp8GemmKernel<kTokN, kBlockScaled, kBlocks>;
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes));
  const int64_t tiles_n = (p.n + fp8::kBlockN - 1) / fp8::kBlockN;
  // Dense: one token tile (m <= kTokN). Grouped: a grid row per slot, a
  // bound on the (group, token tile) pairs with rows: at most one partial
  // tile per group with rows besides the full ones, and no group past
  // max_group_rows.
  int64_t slots = 1;
  if (p.group_offsets != nullptr) {
    const int64_t with_rows = std::min<int64_t>(p.groups, p.m);
    slots = std::min(p.m / kTokN + with_rows, with_rows * ((p.max_group_rows + kTokN - 1) / kTokN));
  }
  LS_CUDA_RETURN_IF_ERROR(LaunchDependentInClusters(
      kernel, dim3(static_cast<unsigned>(tiles_n * splits), static_cast<unsigned>(slots)), dim3(fp8::kThreads),
      L::kSmemBytes, static_cast<unsigned>(splits), stream, *map_w, *map_a, args));
  return absl::OkStatus();
}

template <bool kBlockScaled>
absl::Status LaunchPrefill(const DenseGemm& p, const DeviceInfo& dev, cudaStream_t stream) {
  namespace pf = fp8_prefill;
  const fp8::Fp8GemmArgs args = MakeArgs(p, 1);
  absl::StatusOr<CUtensorMap> map_a = MakeFp8TensorMap(p.a, p.m, p.k, pf::kBlockM);
  if (!map_a.ok()) return map_a.status();
  absl::StatusOr<CUtensorMap> map_w = MakeFp8TensorMap(p.w, args.groups * p.n, p.k, pf::kBlockN);
  if (!map_w.ok()) return map_w.status();
  const auto kernel = pf::Fp8PrefillKernel<kBlockScaled>;
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pf::kSmemBytes));
  // (A grouped product's tiles are known on the device only: a bound.)
  const int64_t tiles = TileBound(p, pf::kBlockN, pf::kBlockM);
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(kernel, dim3(static_cast<unsigned>(std::min<int64_t>(tiles, dev.num_sms))),
                                          dim3(pf::kThreads), pf::kSmemBytes, stream, *map_a, *map_w, args));
  return absl::OkStatus();
}

template <bool kBlockScaled>
absl::Status LaunchScaled(const DenseGemm& p, int splits, int block_m, const DeviceInfo& dev, cudaStream_t stream) {
  if (!Fp8DecodeKernelTakes(p, block_m)) return LaunchPrefill<kBlockScaled>(p, dev, stream);
  if (p.group_offsets != nullptr) {
    // Grouped: three CTAs an SM for token tiles of up to 16.
    switch (Fp8GroupedTokenTile(p)) {
      case 8:
        return Launch<8, kBlockScaled, 3>(p, splits, stream);
      case 16:
        return Launch<16, kBlockScaled, 3>(p, splits, stream);
      case 32:
        return Launch<32, kBlockScaled>(p, splits, stream);
      default:
        return Launch<64, kBlockScaled>(p, splits, stream);
    }
  }
  switch (Fp8TokenTile(p.m)) {
    case 8:
      return Launch<8, kBlockScaled>(p, splits, stream);
    case 16:
      return Launch<16, kBlockScaled>(p, splits, stream);
    case 32:
      return Launch<32, kBlockScaled>(p, splits, stream);
    default:
      return Launch<64, kBlockScaled>(p, splits, stream);
  }
}

}  // namespace

absl::Status LaunchGemmV6(const DenseGemm& p, int splits, int block_m, const DeviceInfo& dev, cudaStream_t stream) {
  if (dev.max_smem_optin < fp8_prefill::kSmemBytes) {
    return absl::ResourceExhaustedError("gemm v6: not enough shared memory");
  }
  if (splits < 1 || splits > fp8::kMaxSplits) return absl::InvalidArgumentError("gemm v6: splits must be 1..8");
  if (p.fp8 == Fp8Scaling::kBlock) return LaunchScaled<true>(p, splits, block_m, dev, stream);
  return LaunchScaled<false>(p, splits, block_m, dev, stream);
}

}  // namespace layerserve::kernels::gemm
