// RAII owners for the CUDA objects the backend holds: device buffers, pinned
// host buffers, streams, events and instantiated graphs. (cuBLASLt's objects have their owners in
// the GEMM router, the only place that uses them.)
//
// Each owner is move-only, created by a factory that returns absl::StatusOr
// (so a failed allocation is a value, not a half-built object), and releases
// its object in the destructor. Destruction ignores errors on purpose: after
// a sticky device error every release fails, and there is nothing to do about
// it at that point. Objects must be destroyed with their device current.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace layerserve::cuda {

// Owns one object of handle type T, released with Destroy.
template <typename T, auto Destroy>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(T handle) : handle_(handle) {}
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, T{})) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, T{});
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { Reset(); }

  T get() const { return handle_; }

 private:
  void Reset() {
    if (handle_ != T{}) static_cast<void>(Destroy(handle_));
    handle_ = T{};
  }

  T handle_{};
};

using CudaStream = UniqueHandle<cudaStream_t, &cudaStreamDestroy>;
using CudaEvent = UniqueHandle<cudaEvent_t, &cudaEventDestroy>;
using CudaGraphExec = UniqueHandle<cudaGraphExec_t, &cudaGraphExecDestroy>;

// A stream that does not synchronize with the legacy default stream.
absl::StatusOr<CudaStream> CreateStream();
// `flags`: cudaEventDefault for timing, cudaEventDisableTiming for completion.
absl::StatusOr<CudaEvent> CreateEvent(unsigned int flags);
// What `record` enqueues on `stream`, captured (stream capture in `mode`)
// and instantiated. The capture always ends; `record`'s error comes first.
absl::StatusOr<CudaGraphExec> CaptureGraph(cudaStream_t stream, cudaStreamCaptureMode mode,
                                           absl::FunctionRef<absl::Status()> record);

// Device memory from cudaMalloc (256-byte aligned).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (cudaMallocHost), so copies to and from the device
// are true DMA and run asynchronously on a stream.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static absl::StatusOr<PinnedBuffer> Allocate(size_t bytes);
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  unsigned char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
};

// Carves one allocation into 256-byte-aligned pieces: first a sizing pass
// (Take with base == nullptr), then the same sequence of Takes over the real
// base pointer.
class BumpLayout {
 public:
  explicit BumpLayout(void* base) : base_(static_cast<unsigned char*>(base)) {}
  void* Take(size_t bytes) {
    void* p = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return p;
  }
  size_t bytes() const { return offset_; }

  static constexpr size_t kAlign = 256;

 private:
  unsigned char* base_;
  size_t offset_ = 0;
};

}  // namespace layerserve::cuda
