// Flash-attention forward, version 6: 128 query rows x 64 keys per tile, 4
// warps of 32 rows (two m16 tiles each, so every K/V fragment read from shared
// memory feeds two MMAs), Q re-read from shared memory each key tile (the
// FlashAttention-2 shape of v1), longest-first schedule (v4) and lazy
// rescaling (flash_fwd_kernel.cuh). The sm80 path for every shape v8 does not
// take, except short grids of short sequences (v7).
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV6(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<128, 64, 4, /*kQInRegs=*/false, 2>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
