// Flash-attention forward, version 1: 128 query rows x 64 keys per tile, 4 warps of 32
// rows (two m16 tiles each, so every K/V fragment read from shared memory feeds two
// MMAs); Q is re-read from shared memory each key tile. The FlashAttention-2 shape.
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV1(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<128, 64, 4, false, 2>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
