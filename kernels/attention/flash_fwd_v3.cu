// Flash-attention forward, version 3: 64 query rows x 64 keys per tile, 4 warps of 16
// rows with Q held in registers: smaller tiles, more CTAs for short sequences.
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV3(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<64, 64, 4, true, 2>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
