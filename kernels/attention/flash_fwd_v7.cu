// Flash-attention forward, version 7: version 5 (v3 tiles, longest-first schedule)
// with lazy rescaling, as version 6 adds it to version 4.
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV7(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<64, 64, 4, true, 2, /*kLptSchedule=*/true, /*kLazyRescale=*/true>>(
      p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
