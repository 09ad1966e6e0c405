// Flash-attention forward, version 2: 128 query rows x 64 keys per tile, 8 warps of 16
// rows: twice the warps per CTA to hide latency, at twice the shared-memory reads per
// MMA.
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV2(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<128, 64, 8, false, 2>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
