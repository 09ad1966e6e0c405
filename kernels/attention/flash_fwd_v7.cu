// Flash-attention forward, version 7: 64 query rows x 64 keys per tile, 4 warps
// of 16 rows, Q held in registers (the tiles of v3), longest-first schedule
// and lazy rescaling as in version 6. Twice v6's CTAs for the same problem:
// the sm80 path for short grids of short sequences (flash_attention.cu).
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/attention/flash_fwd_launch.cuh"

namespace layerserve::kernels::flash {

absl::Status RunFlashFwdV7(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream) {
  return RunFlashFwd<FlashFwdConfig<64, 64, 4, /*kQInRegs=*/true, 2>>(p, heads_per_section, stream);
}

}  // namespace layerserve::kernels::flash
