// The CUDA backend's options from the flags (see cuda_backend_flags.h).
#include "server/cuda_backend_flags.h"

#include <string>
#include <utility>
#include <vector>

#include "base/status_macros.h"

namespace layerserve {

absl::StatusOr<CudaBackendOptions> CudaBackendOptionsFromFlags(const ServerFlags& flags,
                                                               std::string_view version,
                                                               KernelTimingSink* timing_sink) {
  CudaBackendOptions options;
  options.device = flags.cuda_device;
  options.num_streams = flags.streams;
  options.cuda_graph_max_tokens = flags.cuda_graph_max_tokens;
  options.warm_up = flags.cuda_warmup;
  options.blocking_wait = flags.cuda_wait == "block";
  options.max_batch_tokens = flags.max_batch_tokens;
  options.timing_sink = timing_sink;
  LS_ASSIGN_OR_RETURN(options.gemm_mode, kernels::ParseGemmMode(flags.gemm));
  LS_ASSIGN_OR_RETURN(std::vector<cuda::GemmPin> pins, cuda::ParseGemmPins(flags.gemm_override));
  if (!pins.empty() && options.gemm_mode != kernels::GemmMode::kAuto) {
    return absl::InvalidArgumentError("--gemm-override needs --gemm=auto");
  }
  options.gemm_tuning.autotune = flags.gemm_autotune;
  options.gemm_tuning.cache_path = flags.gemm_tune_cache;
  options.gemm_tuning.build = std::string(version);
  options.gemm_tuning.pins = std::move(pins);
  options.kv_cache_dtype = KvCacheDTypeOf(flags);
  return options;
}

}  // namespace layerserve
