// Flash-attention forward, version 8: the Hopper wgmma kernel of
// flash_fwd_sm90.cuh (128 x 128 tiles, two warpgroups, longest-first
// sections). Only head_dim 128 and bf16, and only where the library was built
// for sm_90a and runs on a compute capability 9.0 device; elsewhere it answers
// UNIMPLEMENTED and the default-version rule never picks it.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_sm90.cuh"
#include "layerserve/kernels/attention.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels::flash {

absl::Status FlashFwdV8Available(const FlashAttentionParams& p, const DeviceInfo& dev) {
  if (p.head_dim != sm90::kHeadDim) {
    return absl::UnimplementedError(absl::StrCat("flash attention v8 takes head_dim 128 only, got ", p.head_dim));
  }
  if (p.dtype != DType::kBF16) return absl::UnimplementedError("flash attention v8 takes bf16 only");
#if !defined(LAYERSERVE_ATTENTION_HAVE_SM90A)
  return absl::UnimplementedError("flash attention v8: library built without sm_90a");
#else
  if (!dev.IsHopper()) {
    return absl::UnimplementedError(absl::StrCat("flash attention v8 needs a compute capability 9.0 device, got ",
                                                 dev.cc_major, ".", dev.cc_minor));
  }
  if (dev.max_smem_optin < sm90::kSmemBytes) {
    return absl::UnimplementedError(absl::StrCat("flash attention v8 needs ", sm90::kSmemBytes,
                                                 " bytes of shared memory per block, device has ", dev.max_smem_optin));
  }
  return absl::OkStatus();
#endif
}

absl::Status RunFlashFwdV8(const FlashAttentionParams& p, const DeviceInfo& dev, int heads_per_section,
                           cudaStream_t stream) {
  if (absl::Status s = FlashFwdV8Available(p, dev); !s.ok()) return s;
  if (heads_per_section <= 0 || p.num_heads % heads_per_section != 0) {
    return absl::InvalidArgumentError("flash attention: heads_per_section must divide num_heads");
  }
  const int m_blocks = (p.max_seqlen + sm90::kBlockM - 1) / sm90::kBlockM;
  if (int64_t{m_blocks} * p.num_heads > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError("flash attention: query tiles x heads exceed the grid limit");
  }
  auto kernel = &sm90::FlashFwdSm90Kernel;
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sm90::kSmemBytes));
  const dim3 grid(m_blocks * p.num_heads, p.num_seqs);
  kernel<<<grid, sm90::kThreads, sm90::kSmemBytes, stream>>>(p, heads_per_section);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(FlashFwdSm90Kernel);
  return absl::OkStatus();
}

}  // namespace layerserve::kernels::flash
