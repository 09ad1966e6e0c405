// Flash-attention forward, version 4: version 1's tiles (128 query rows x 64 keys,
// 4 warps of 32 rows, Q in shared memory) dispatched longest causal tile first
// across each L2-sized section of heads (kLptSchedule in flash_fwd_kernel.cuh).
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV4(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<128, 64, 4, false, 2, /*kLptSchedule=*/true>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
