// Implementation of the kernel tests' shared plumbing (see gpu_test_util.h).
#include "tests/gpu/gpu_test_util.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

namespace layerserve::kernels::testing {

bool HaveCudaDevice() {
  static const bool have = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return have;
}

void GpuTest::SetUp() {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  absl::StatusOr<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 16));
  EXPECT_TRUE(buffer.ok()) << "allocating " << bytes << " bytes: " << buffer.status();
  if (buffer.ok()) buffer_ = *std::move(buffer);
}

void DeviceBuffer::Poison() {
  const cudaError_t err = cudaMemset(get(), 0xFF, bytes_);
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
}

void DeviceBuffer::Upload(const void* src, size_t bytes, size_t offset) {
  const cudaError_t err = cudaMemcpy(static_cast<char*>(get()) + offset, src, bytes, cudaMemcpyHostToDevice);
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
}

void DeviceBuffer::Download(void* dst, size_t bytes, size_t offset) const {
  const cudaError_t err = cudaMemcpy(dst, static_cast<const char*>(get()) + offset, bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
}

double RoundToDType(DType dtype, double x) {
  // float first, as torch rounds a float32 result; the one-step double -> bf16
  // rounding would differ only on exact float ties, which these tests' float
  // intermediates produce, so they go through float too.
  const float f = static_cast<float>(x);
  switch (dtype) {
    case DType::kBF16:
      return static_cast<double>(__bfloat162float(__float2bfloat16_rn(f)));
    case DType::kF16:
      return static_cast<double>(__half2float(__float2half_rn(f)));
    case DType::kF32:
      return static_cast<double>(f);
  }
  return x;
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * DTypeBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const float f = static_cast<float>(values[i]);
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &f, 4);
    } else if (dtype == DType::kBF16) {
      const __nv_bfloat16 b = __float2bfloat16_rn(f);
      std::memcpy(&bytes[i * 2], &b, 2);
    } else {
      const __half h = __float2half_rn(f);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

std::vector<double> Decode(DType dtype, const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / DTypeBytes(dtype);
  std::vector<double> values(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      values[i] = f;
    } else if (dtype == DType::kBF16) {
      __nv_bfloat16 b;
      std::memcpy(&b, &bytes[i * 2], 2);
      values[i] = __bfloat162float(b);
    } else {
      __half h;
      std::memcpy(&h, &bytes[i * 2], 2);
      values[i] = __half2float(h);
    }
  }
  return values;
}

std::vector<double> RandomValues(DType dtype, size_t n, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> values(n);
  for (double& v : values) {
    do {
      v = RoundToDType(dtype, dist(rng));
    } while (v == 0.0);
  }
  return values;
}

double DTypeEpsilon(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -11);
    case DType::kF32:
      return std::ldexp(1.0, -24);
  }
  return 0.0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
  }
  return "?";
}

::testing::AssertionResult AllClose(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                    double rtol, const std::function<std::string(size_t)>& describe) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != expected " << want.size();
  }
  size_t bad = 0;
  size_t worst = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double tol = atol + rtol * std::fabs(want[i]);
    // NaN compares false: count it as infinitely wrong.
    const double excess = std::isfinite(got[i]) ? err - tol : INFINITY;
    if (excess > 0) ++bad;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(8);
  os << bad << " of " << got.size() << " elements out of tolerance (atol " << atol << ", rtol " << rtol
     << "); worst at index " << worst;
  if (describe) os << " (" << describe(worst) << ")";
  os << ": got " << got[worst] << ", expected " << want[worst];
  return ::testing::AssertionFailure() << os.str();
}

ErrorStats Errors(const std::vector<double>& got, const std::vector<double>& want) {
  ErrorStats st;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (st.non_finite++ == 0) st.worst = i;
      continue;
    }
    const double err = std::fabs(got[i] - want[i]);
    st.mean_abs += err;
    if (err > st.max_abs && st.non_finite == 0) {
      st.max_abs = err;
      st.worst = i;
    }
  }
  st.mean_abs /= static_cast<double>(std::max<size_t>(1, got.size()));
  return st;
}

void ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  const size_t workers = std::max<size_t>(1, std::min<size_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (size_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      for (size_t i = w; i < n; i += workers) fn(i);
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace layerserve::kernels::testing
