// MeasureDeviceRates (see device_rates.h).
#include "bench/layer/device_rates.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "base/cuda/cuda_resources.h"
#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"
#include "bench/layer/random_fill.h"

namespace layerserve::bench {
namespace {

constexpr int kWarmUp = 3;
constexpr int kTimed = 10;

// Median milliseconds of what `enqueue` puts on `stream`.
absl::StatusOr<double> MedianMs(cudaStream_t stream, const std::function<absl::Status()>& enqueue) {
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent start, cuda::CreateEvent(cudaEventDefault));
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent stop, cuda::CreateEvent(cudaEventDefault));
  for (int i = 0; i < kWarmUp; ++i) LS_RETURN_IF_ERROR(enqueue());
  std::vector<float> ms(kTimed);
  for (float& m : ms) {
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream));
    LS_RETURN_IF_ERROR(enqueue());
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream));
    LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
    LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&m, start.get(), stop.get()));
  }
  std::nth_element(ms.begin(), ms.begin() + kTimed / 2, ms.end());
  return static_cast<double>(ms[kTimed / 2]);
}

}  // namespace

absl::StatusOr<double> MeasureCopyBytesPerSecond(cudaStream_t stream) {
  constexpr size_t kBytes = size_t{1} << 30;
  LS_ASSIGN_OR_RETURN(cuda::DeviceBuffer from, cuda::DeviceBuffer::Allocate(kBytes));
  LS_ASSIGN_OR_RETURN(cuda::DeviceBuffer to, cuda::DeviceBuffer::Allocate(kBytes));
  LS_RETURN_IF_ERROR(FillUniformBf16(from.data(), kBytes / 2, 7, 0.0f, 1.0f, stream));
  const auto copy = [&]() -> absl::Status {
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to.data(), from.data(), kBytes, cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  };
  LS_ASSIGN_OR_RETURN(const double ms, MedianMs(stream, copy));
  return 2.0 * static_cast<double>(kBytes) / (ms * 1e-3);
}

absl::StatusOr<DeviceRates> MeasureDeviceRates(kernels::GemmRouter& gemm, const kernels::GemmWorkspace& workspace,
                                               cudaStream_t stream) {
  DeviceRates rates;
  LS_ASSIGN_OR_RETURN(rates.copy_bytes_per_s, MeasureCopyBytesPerSecond(stream));
  {
    constexpr int64_t kN = 8192;
    constexpr size_t kBytes = size_t{kN} * kN * 2;
    LS_ASSIGN_OR_RETURN(cuda::DeviceBuffer a, cuda::DeviceBuffer::Allocate(kBytes));
    LS_ASSIGN_OR_RETURN(cuda::DeviceBuffer w, cuda::DeviceBuffer::Allocate(kBytes));
    LS_ASSIGN_OR_RETURN(cuda::DeviceBuffer d, cuda::DeviceBuffer::Allocate(kBytes));
    LS_RETURN_IF_ERROR(FillUniformBf16(a.data(), kN * kN, 8, 0.0f, 1.0f, stream));
    LS_RETURN_IF_ERROR(FillUniformBf16(w.data(), kN * kN, 9, 0.0f, 0.01f, stream));
    kernels::GemmParams p;
    p.a = a.data();
    p.lda = kN;
    p.w = w.data();
    p.ldw = kN;
    p.d = d.data();
    p.ldd = kN;
    p.m = p.n = p.k = kN;
    kernels::GemmConfig cublaslt;
    cublaslt.version = kernels::GemmVersion::kCublasLt;
    const auto product = [&] { return gemm.RunConfig(p, cublaslt, workspace, stream); };
    LS_ASSIGN_OR_RETURN(const double ms, MedianMs(stream, product));
    rates.bf16_flops_per_s = 2.0 * static_cast<double>(kN) * kN * kN / (ms * 1e-3);
  }
  LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return rates;
}

}  // namespace layerserve::bench
