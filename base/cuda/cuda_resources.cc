// Factories and destructors of the RAII owners in cuda_resources.h.
#include "base/cuda/cuda_resources.h"

#include "base/cuda/cuda_status.h"

namespace layerserve::cuda {

absl::StatusOr<CudaStream> CreateStream() {
  cudaStream_t stream = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return CudaStream(stream);
}

absl::StatusOr<CudaEvent> CreateEvent(unsigned int flags) {
  cudaEvent_t event = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, flags));
  return CudaEvent(event);
}

absl::StatusOr<CudaGraphExec> CaptureGraph(cudaStream_t stream, cudaStreamCaptureMode mode,
                                           absl::FunctionRef<absl::Status()> record) {
  LS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, mode));
  const absl::Status recorded = record();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!recorded.ok()) {
    if (graph != nullptr) static_cast<void>(cudaGraphDestroy(graph));
    return recorded;
  }
  LS_CUDA_RETURN_IF_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  static_cast<void>(cudaGraphDestroy(graph));
  LS_CUDA_RETURN_IF_ERROR(instantiated);
  return CudaGraphExec(exec);
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buffer;
  if (bytes == 0) return buffer;
  LS_CUDA_RETURN_IF_ERROR(cudaMalloc(&buffer.data_, bytes));
  buffer.bytes_ = bytes;
  return buffer;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) static_cast<void>(cudaFree(data_));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) static_cast<void>(cudaFree(data_));
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer buffer;
  if (bytes == 0) return buffer;
  void* p = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, bytes));
  buffer.data_ = static_cast<unsigned char*>(p);
  buffer.bytes_ = bytes;
  return buffer;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) static_cast<void>(cudaFreeHost(data_));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) static_cast<void>(cudaFreeHost(data_));
}

}  // namespace layerserve::cuda
