#include "server/cuda/batch_launch.h"

#include <algorithm>

#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"
#include "layerserve/kernels/layer_ops.h"
#include "server/cuda/forward_graphs.h"

namespace layerserve::cuda {
namespace {

kernels::DType KernelDType(DType t) {
  switch (t) {
    case DType::kF32:
      return kernels::DType::kF32;
    case DType::kF16:
      return kernels::DType::kF16;
    case DType::kBF16:
      return kernels::DType::kBF16;
    case DType::kF8E4M3:  // weights only: never a request's dtype
      break;
  }
  return kernels::DType::kF32;
}

bool WireIsActivation(const Batch& batch, kernels::DType act) {
  return std::all_of(batch.requests.begin(), batch.requests.end(),
                     [&](const auto& request) { return KernelDType(request->dtype) == act; });
}

}  // namespace

BatchLaunch::BatchLaunch(StreamSlot& slot, const Batch& batch, const BatchStaging& staging,
                         const LayerExecutor& executor, KvPool* kv_pool, bool timed)
    : slot_(slot),
      batch_(batch),
      staging_(staging),
      executor_(executor),
      kv_pool_(kv_pool),
      timed_(timed),
      wire_is_activation_(WireIsActivation(batch, executor.shape().dtype)),
      geometry_(staging.geometry()) {}

absl::StatusOr<std::string_view> BatchLaunch::Launch(bool graph) {
  LS_RETURN_IF_ERROR(CopyIn(graph));
  if (graph) {
    LS_ASSIGN_OR_RETURN(const GraphLaunch launch,
                        slot_.graphs->Run(
                            GraphKeyOf(geometry_), slot_.stream.get(), [this] { return Layers(); },
                            [this] { return CopyOut(); }));
    return GraphLaunchName(launch);
  }
  LS_RETURN_IF_ERROR(Layers());
  LS_RETURN_IF_ERROR(CopyOut());
  return GraphLaunchName(GraphLaunch::kDirect);
}

absl::Status BatchLaunch::CopyIn(bool graph) {
  const cudaStream_t stream = slot_.stream.get();
  void* staging = wire_is_activation_ ? slot_.arena.x : slot_.io_device.data();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging, slot_.io_host.data(), staging_.io_bytes(),
                                          cudaMemcpyHostToDevice, stream));
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot_.arena.meta, slot_.meta_host.data(),
                                          staging_.meta_bytes(), cudaMemcpyHostToDevice, stream));
  if (batch_.has_sessions) {
    if (kv_pool_ == nullptr) {
      return absl::FailedPreconditionError("cuda backend: a session step before the KV cache");
    }
    LS_ASSIGN_OR_RETURN(const BatchKvMeta kv,
                        kv_pool_->Upload(batch_, slot_.index, stream, /*pad_plan=*/graph));
    AttachKv(kv_pool_, kv, &geometry_);
  }
  return wire_is_activation_ ? absl::OkStatus() : Convert(/*to_activation=*/true);
}

absl::Status BatchLaunch::Layers() const {
  const kernels::GemmWorkspace workspace{slot_.workspace.data(), slot_.workspace.bytes()};
  return executor_.Forward(slot_.arena, geometry_, workspace, slot_.stream.get(),
                           timed_ ? &slot_.timer : nullptr);
}

absl::Status BatchLaunch::CopyOut() {
  const cudaStream_t stream = slot_.stream.get();
  if (!wire_is_activation_) LS_RETURN_IF_ERROR(Convert(/*to_activation=*/false));
  const void* staging = wire_is_activation_ ? slot_.arena.x : slot_.io_device.data();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot_.io_host.data(), staging, staging_.io_bytes(),
                                          cudaMemcpyDeviceToHost, stream));
  if (slot_.arena.expert_tokens != nullptr) {
    LS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot_.expert_tokens_host.data(), slot_.arena.expert_tokens,
                        slot_.expert_tokens_host.bytes(), cudaMemcpyDeviceToHost, stream));
  }
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot_.done.get(), stream));
  return absl::OkStatus();
}

absl::Status BatchLaunch::Convert(bool to_activation) const {
  const kernels::DType act = executor_.shape().dtype;
  const size_t row_bytes = static_cast<size_t>(executor_.shape().hidden) * kernels::DTypeBytes(act);
  auto* io_device = static_cast<unsigned char*>(slot_.io_device.data());
  auto* x = static_cast<unsigned char*>(slot_.arena.x);
  const auto& requests = batch_.requests;
  size_t row = 0;
  for (size_t i = 0; i < requests.size();) {
    const kernels::DType wire_dtype = KernelDType(requests[i]->dtype);
    size_t end = i;
    size_t bytes = 0, rows_in_run = 0;
    int64_t elements = 0;
    for (; end < requests.size() && KernelDType(requests[end]->dtype) == wire_dtype; ++end) {
      const InferRequest& request = *requests[end];
      bytes += static_cast<size_t>(request.batch) * BatchStaging::PieceBytes(request);
      rows_in_run += static_cast<size_t>(request.batch_tokens());
      elements += request.batch_tokens() * request.hidden;
    }
    void* wire = io_device + staging_.offsets()[i];
    void* rows = x + row * row_bytes;
    if (wire_dtype == act) {
      // A run in the activation dtype beside runs in others.
      LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to_activation ? rows : wire,
                                              to_activation ? wire : rows, bytes,
                                              cudaMemcpyDeviceToDevice, slot_.stream.get()));
    } else {
      kernels::CastParams cast;
      cast.src = to_activation ? wire : rows;
      cast.src_dtype = to_activation ? wire_dtype : act;
      cast.dst = to_activation ? rows : wire;
      cast.dst_dtype = to_activation ? act : wire_dtype;
      cast.n = elements;
      LS_RETURN_IF_ERROR(kernels::LaunchCast(cast, slot_.stream.get()));
    }
    row += rows_in_run;
    i = end;
  }
  return absl::OkStatus();
}

}  // namespace layerserve::cuda
