// What the attention benchmarks (flash_attention_bench, decode_attention_bench)
// share: fail-fast checks, device-filled random bf16 inputs, and the timing
// method (CUDA events around each launch after a warm-up, input sets rotated
// past the L2, the median). Included by one .cu file per benchmark program.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"

// A benchmark is a program, not library code: a CUDA failure ends it.
#define BENCH_CHECK_CUDA(expr)                                                                      \
  do {                                                                                              \
    const cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

#define BENCH_CHECK_OK(expr)                                                                       \
  do {                                                                                             \
    const absl::Status st_ = (expr);                                                               \
    if (!st_.ok()) {                                                                               \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, std::string(st_.message()).c_str()); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace layerserve::kernels::attention_bench {

// Uniform in [-1, 1] from a hash of the index and seed.
__global__ void FillUniform(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    x[i] = __float2bfloat16_rn(static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f);
  }
}

// Holds the stream for `ns` nanoseconds of the device's global timer.
__global__ void Spin(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// base's device buffer (at least one byte); a failed allocation ends the
// benchmark.
inline std::unique_ptr<cuda::DeviceBuffer> MustAllocate(size_t bytes) {
  absl::StatusOr<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 1));
  BENCH_CHECK_OK(buffer.status());
  return std::make_unique<cuda::DeviceBuffer>(*std::move(buffer));
}

inline std::unique_ptr<cuda::DeviceBuffer> RandomBuffer(int64_t elems, uint32_t seed) {
  auto buf = MustAllocate(elems * sizeof(__nv_bfloat16));
  FillUniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(buf->data()), elems, seed);
  BENCH_CHECK_CUDA(cudaGetLastError());
  return buf;
}

inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Median device time in ms of `launch(set)` over `iters` launches, rotating
// through `sets` input sets, after `warmup` launches. With `hold_stream`, a
// spin kernel holds the stream while the host enqueues the timed launches,
// so that microsecond kernels are timed without the host's launch latency
// between them.
inline double MedianMs(int sets, int warmup, int iters, const std::function<void(int)>& launch,
                       bool hold_stream = false) {
  for (int i = 0; i < warmup; ++i) launch(i % sets);
  std::vector<cudaEvent_t> events(2 * iters);
  for (cudaEvent_t& e : events) BENCH_CHECK_CUDA(cudaEventCreate(&e));
  if (hold_stream) {
    // 50 ms is far longer than enqueueing the timed launches takes.
    Spin<<<1, 1>>>(50'000'000);
    BENCH_CHECK_CUDA(cudaGetLastError());
  }
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK_CUDA(cudaEventRecord(events[2 * i]));
    launch(i % sets);
    BENCH_CHECK_CUDA(cudaEventRecord(events[2 * i + 1]));
  }
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms(iters);
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]));
    ms[i] = t;
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return ms[iters / 2];
}

// Enough input sets that their total is at least twice the L2.
inline int SetsFor(size_t bytes_per_set, size_t l2_bytes) {
  return static_cast<int>(std::max<size_t>(2, (2 * l2_bytes + bytes_per_set - 1) / bytes_per_set));
}

}  // namespace layerserve::kernels::attention_bench
