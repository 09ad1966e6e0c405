// The CUDA backend's options from the flags (a CUDA build only; the CPU build
// accepts and ignores the CUDA flags). Beside server_options.h, which builds
// every other part's options, because only a build with the CUDA backend can
// compile it.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "server/cuda/cuda_backend.h"
#include "server/server_flags.h"

namespace layerserve {

// --streams, --cuda-device, --cuda-graph-max-tokens, --cuda-warmup,
// --cuda-wait, --max-batch-tokens and the GEMM flags; `version` keys the
// tune cache and `timing_sink` (not owned) receives per-op device times.
// INVALID_ARGUMENT for a --gemm or --gemm-override that does not parse, and
// for --gemm-override without --gemm=auto.
absl::StatusOr<CudaBackendOptions> CudaBackendOptionsFromFlags(const ServerFlags& flags,
                                                               std::string_view version,
                                                               KernelTimingSink* timing_sink);

}  // namespace layerserve
