// Flash-attention forward, version 6: version 4 (v1 tiles, longest-first schedule)
// with lazy rescaling: the output accumulator is rescaled only when a row's max
// grows by more than 2^8 in exp space (kLazyRescale in flash_fwd_kernel.cuh).
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV6(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<128, 64, 4, false, 2, /*kLptSchedule=*/true, /*kLazyRescale=*/true>>(
      p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
