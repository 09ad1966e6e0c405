// MakeCudaBackend (see cuda_backend.h): validates the model and options,
// uploads the weights, tunes the GEMM routes, allocates one slot per stream
// (stream_slot.h) and starts the stream pool (stream_pool.h), which runs
// each batch in its parts (batch_staging.h, batch_launch.h).
#include "server/cuda/cuda_backend.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "server/cuda/device_weights.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/layer_executor.h"
#include "server/cuda/stream_pool.h"
#include "server/cuda/stream_slot.h"

namespace layerserve {
namespace {

std::string_view KernelDTypeName(kernels::DType t) {
  return t == kernels::DType::kF16 ? "fp16" : t == kernels::DType::kBF16 ? "bf16" : "fp32";
}

absl::Status ValidateOptions(const ModelSpan& model, const CudaBackendOptions& options) {
  if (model.layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: model '", model.name, "' has no layers"));
  }
  const LlamaConfig& c = model.config;
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_attention_heads <= 0 ||
      c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0 ||
      c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: model '", model.name, "' has an inconsistent configuration"));
  }
  if (c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: head_dim ", c.head_dim, " is not supported (flash attention: 64 or 128)"));
  }
  if (options.num_streams < 1 || options.num_streams > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: num_streams must be in [1, 64], got ", options.num_streams));
  }
  if (options.max_batch_tokens < 1 || options.max_batch_tokens > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: max_batch_tokens must be in [1, 16777216], got ", options.max_batch_tokens));
  }
  if (options.cuda_graph_max_tokens < 0) {
    return absl::InvalidArgumentError("cuda backend: cuda_graph_max_tokens must be >= 0");
  }
  if (options.timing_sample_every < 0) {
    return absl::InvalidArgumentError("cuda backend: timing_sample_every must be >= 0");
  }
  return absl::OkStatus();
}

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> MakeCudaBackend(const ModelSpan& model,
                                                             const CudaBackendOptions& options) {
  LS_RETURN_IF_ERROR(ValidateOptions(model, options));
  int device_count = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&device_count));
  if (options.device < 0 || options.device >= device_count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: device ", options.device,
                                                   " does not exist (", device_count, " devices)"));
  }
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  cudaDeviceProp props{};
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, options.device));

  const bool moe = model.config.IsMixtureOfExperts();
  if (moe) LS_RETURN_IF_ERROR(cuda::CheckExpertsCanRun(model.config, props));
  LS_RETURN_IF_ERROR(cuda::CheckFp8CanRun(model.config, props));
  const kernels::DType dtype = cuda::ActivationDTypeFor(model);
  LS_ASSIGN_OR_RETURN(cuda::DeviceWeights weights, cuda::DeviceWeights::Upload(model, dtype));
  const cuda::LayerShape shape = cuda::LayerShape::FromConfig(model.config, dtype);
  LogStream gemm_log(LogLevel::kInfo);  // the tuning table, one record per line
  const std::vector<cuda::TunedShape> gemm_shapes =
      cuda::TunedShapesFor(shape, weights.layers().front());
  LS_ASSIGN_OR_RETURN(std::unique_ptr<kernels::GemmRouter> gemm,
                      cuda::MakeGemmRouter(options.gemm_mode, gemm_shapes, options.max_batch_tokens,
                                           options.gemm_tuning, gemm_log));
  std::vector<cuda::GemmRoute> gemm_routes =
      cuda::GemmRoutes(*gemm, gemm_shapes, options.max_batch_tokens);
  std::vector<std::unique_ptr<cuda::StreamSlot>> slots;
  for (int i = 0; i < options.num_streams; ++i) {
    LS_ASSIGN_OR_RETURN(std::unique_ptr<cuda::StreamSlot> slot,
                        cuda::MakeStreamSlot(i, shape,
                                             {.max_tokens = options.max_batch_tokens,
                                              .num_layers = static_cast<int>(model.layers.size()),
                                              .workspace_bytes = gemm->workspace_bytes(),
                                              .copy_threads = options.host_copy_threads,
                                              .blocking_wait = options.blocking_wait}));
    slots.push_back(std::move(slot));
  }
  // Each layer's sliding window, for flash and paged attention alike; windows
  // past any int32 position are no window at all.
  std::vector<int> windows;
  for (int64_t l = 0; l < static_cast<int64_t>(model.layers.size()); ++l) {
    windows.push_back(static_cast<int>(
        std::min<int64_t>(model.config.AttentionWindow(model.first_layer + l), INT32_MAX)));
  }
  LS_ASSIGN_OR_RETURN(const kernels::DeviceInfo device, kernels::QueryDeviceInfo(options.device));
  auto backend = std::make_unique<cuda::StreamPool>(
      options, model.config, std::move(windows), props.name, std::move(weights), std::move(gemm),
      std::move(gemm_routes), dtype, device, std::move(slots));
  if (options.warm_up) LS_RETURN_IF_ERROR(backend->WarmUp());
  const absl::StatusOr<int64_t> used = backend->DeviceMemoryUsedBytes();
  LogInfo(absl::StrCat(
      "cuda backend: device ", options.device, " (", props.name, ", sm_", props.major, props.minor,
      ", ", props.multiProcessorCount, " SMs); ",
      model.config.fp8 ? absl::StrCat(model.config.fp8->Describe(), " weights (the FP8 GEMM), ",
                                      ToAbsl(KernelDTypeName(dtype)), " activations, ")
                       : absl::StrCat(ToAbsl(KernelDTypeName(dtype)), " weights, "),
      backend->WeightBytes(), " bytes uploaded for ", model.layers.size(), " layers; ",
      options.num_streams, " streams, ", backend->ActivationBytes(),
      " activation bytes for max_batch_tokens=", options.max_batch_tokens,
      "; CUDA graphs for batches of up to ", options.cuda_graph_max_tokens,
      " tokens; device memory used ", used.ok() ? absl::StrCat(*used) : "unknown", " bytes"));
  return std::unique_ptr<CudaBackend>(std::move(backend));
}

}  // namespace layerserve
