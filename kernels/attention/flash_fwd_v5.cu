// Flash-attention forward, version 5: version 3's tiles (64 query rows x 64 keys,
// 4 warps of 16 rows, Q in registers) dispatched longest causal tile first across
// each L2-sized section of heads (kLptSchedule in flash_fwd_kernel.cuh).
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV5(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<64, 64, 4, true, 2, /*kLptSchedule=*/true>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
