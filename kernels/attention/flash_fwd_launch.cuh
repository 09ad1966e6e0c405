// Host side of one flash-attention configuration: grid math, shared-memory
// opt-in and the dtype / head_dim dispatch. Each flash_fwd_v*.cu
// instantiates it for one tile configuration, so the versions compile in
// parallel and the set of built kernels stays explicit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/attention/flash_fwd_kernel.cuh"
#include "kernels/common/static_switch.h"
#include "layerserve/kernels/attention.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels::flash {

// A tile configuration independent of head_dim; the traits add it.
template <int kBlockM, int kBlockN, int kNWarps, bool kQInRegs, int kMinBlocksPerSm>
struct FlashFwdConfig {
  template <int kHeadDim>
  using Traits = FlashFwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kQInRegs, kMinBlocksPerSm>;
};

// `heads_per_section` must divide p.num_heads.
template <typename Traits, typename T>
absl::Status LaunchFlashFwdKernel(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  constexpr size_t kSmemBytes = Traits::kSmemElems * sizeof(T);
  static_assert(sizeof(T) == 2, "tensor-core path takes 16-bit inputs");
  auto kernel = &FlashFwdKernel<Traits, T>;
  // Above 48 KiB of dynamic shared memory a kernel must opt in; the call fails
  // (and we report it) on a device with less shared memory per block.
  LS_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
  if (heads_per_section <= 0 || p.num_heads % heads_per_section != 0) {
    return absl::InvalidArgumentError("flash attention: heads_per_section must divide num_heads");
  }
  const int m_blocks = (p.max_seqlen + Traits::kBlockM - 1) / Traits::kBlockM;
  if (int64_t{m_blocks} * p.num_heads > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError("flash attention: query tiles x heads exceed the grid limit");
  }
  const dim3 grid(m_blocks * p.num_heads, p.num_seqs);
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p, heads_per_section);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(FlashFwdKernel);
  return absl::OkStatus();
}

// Params must already be validated (ValidateFlashAttentionParams).
template <typename Config>
absl::Status RunFlashFwd(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return LS_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&] {
    return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&] {
      return LaunchFlashFwdKernel<typename Config::template Traits<kHeadDim>, T>(p, heads_per_section, stream);
    });
  });
}

}  // namespace layerserve::kernels::flash
