// OpTimer: CUDA events between consecutive ops of a sampled batch.
#include "server/cuda/kernel_timing.h"

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"

namespace layerserve::cuda {

absl::StatusOr<OpTimer> OpTimer::Create(int max_ops) {
  std::vector<CudaEvent> events;
  events.reserve(static_cast<size_t>(max_ops) + 1);
  for (int i = 0; i <= max_ops; ++i) {
    LS_ASSIGN_OR_RETURN(CudaEvent event, CreateEvent(cudaEventDefault));
    events.push_back(std::move(event));
  }
  return OpTimer(std::move(events));
}

OpTimer::OpTimer(std::vector<CudaEvent> events) : events_(std::move(events)) {
  ops_.reserve(events_.size());
}

absl::Status OpTimer::Start(cudaStream_t stream) {
  ops_.clear();
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[0].get(), stream));
  return absl::OkStatus();
}

absl::Status OpTimer::Mark(std::string_view op, cudaStream_t stream) {
  if (ops_.size() + 1 >= events_.size()) {
    return absl::InternalError(
        absl::StrCat("op timer: more than ", events_.size() - 1, " ops in one batch"));
  }
  ops_.push_back(op);
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[ops_.size()].get(), stream));
  return absl::OkStatus();
}

absl::Status OpTimer::Report(KernelTimingSink* sink) {
  for (size_t i = 0; i < ops_.size(); ++i) {
    float ms = 0;
    LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[i].get(), events_[i + 1].get()));
    sink->OnKernelTime(ops_[i], static_cast<double>(ms) * 1e-3);
  }
  ops_.clear();
  return absl::OkStatus();
}

}  // namespace layerserve::cuda
