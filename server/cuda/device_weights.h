// A ModelSpan's weights on the device, uploaded once when the backend is
// built: converted to the activation dtype (fp16 checkpoints stay fp16; bf16
// and f32 ones become bf16), with q/k/v fused into one [qkv_width, hidden]
// weight (and bias) and gate/up into one [2 intermediate, hidden] weight, so
// each layer runs two GEMMs fewer; a mixture of experts keeps its experts
// stacked as loaded ([experts, 2 intermediate, hidden] and [experts, hidden,
// intermediate]), which is the layout the grouped GEMM reads; a shared
// expert's gate/up is fused as the dense MLP's. An FP8 checkpoint's FP8
// linears stay FP8: their codes and scales as fp8_weights.h lays them out,
// for the FP8 GEMM (dense layers without q/k/v biases; anything else is
// UNIMPLEMENTED, naming the format, and served by the CPU backend).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "layerserve/kernels/common.h"
#include "server/cuda/layer_executor.h"
#include "server/model/model.h"

namespace layerserve::cuda {

// The dtype a span computes in: fp16 when its projections are stored fp16,
// bf16 otherwise (fp16 has too little range for f32 checkpoints' activations),
// and always bf16 for a mixture of experts (its grouped GEMMs take bf16).
kernels::DType ActivationDTypeFor(const ModelSpan& model);

// OK when the device (`props`) and this build can run `config`'s mixture of
// experts: the grouped GEMM is the project's Hopper kernel only, so anything
// but compute capability 9.0 with sm_90a code, more than kMaxGemmGroups
// experts, or sizes not multiples of 8 are UNIMPLEMENTED, with the reason.
absl::Status CheckExpertsCanRun(const LlamaConfig& config, const cudaDeviceProp& props);

// OK when the device and this build can run an FP8 checkpoint's linears:
// the FP8 GEMM is the project's Hopper kernel only (UNIMPLEMENTED, with the
// reason, elsewhere; --backend=cpu serves FP8 checkpoints anywhere).
absl::Status CheckFp8CanRun(const LlamaConfig& config, const cudaDeviceProp& props);

class DeviceWeights {
 public:
  // Validates every tensor's size against the config (INVALID_ARGUMENT naming
  // the layer and tensor) and uploads. The current device must be set.
  static absl::StatusOr<DeviceWeights> Upload(const ModelSpan& model, kernels::DType dtype);

  const std::vector<LayerDeviceWeights>& layers() const { return views_; }
  const float* inv_freq() const { return static_cast<const float*>(inv_freq_.data()); }
  // Bytes of weight data on the device (excluding allocation padding).
  size_t bytes() const { return bytes_; }

 private:
  std::vector<DeviceBuffer> buffers_;  // one per layer
  std::vector<LayerDeviceWeights> views_;
  DeviceBuffer inv_freq_;
  size_t bytes_ = 0;
};

}  // namespace layerserve::cuda
