// Shared plumbing of the kernel tests: the visible skip on machines without a
// GPU, an RAII device buffer that poisons itself before each run, host-side
// rounding to the 16-bit dtypes, deterministic inputs, and a comparison that
// names the worst element.
//
// References live in each test file, computed on the host in double (or in
// float where the test models exactly what PyTorch rounds) from the same
// rounded inputs the kernel sees.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/cuda/cuda_resources.h"
#include "gtest/gtest.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels::testing {

// True when at least one CUDA device is visible (cudaGetDeviceCount succeeds
// and returns > 0). Cached after the first call.
bool HaveCudaDevice();

// Fixtures whose SetUp skips, visibly, where there is no GPU.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override;
};
template <typename Param>
class GpuTestWithParam : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  }
};

// base's cuda::DeviceBuffer with the conveniences tests want: allocation in
// the constructor, and copies, where failures are gtest failures.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);

  void* get() const { return buffer_.data(); }
  size_t bytes() const { return bytes_; }
  // Fills every byte with 0xFF: NaN in bf16, fp16 and fp32, so an element the
  // kernel forgets to write cannot pass for a right answer.
  void Poison();
  void Upload(const void* src, size_t bytes, size_t offset = 0);
  void Download(void* dst, size_t bytes, size_t offset = 0) const;

 private:
  cuda::DeviceBuffer buffer_;
  size_t bytes_ = 0;
};

// Element storage of a dtype on the host: raw bits (bf16/fp16) or float.
// Values round-trip through double for the references.
double RoundToDType(DType dtype, double x);
// Encodes doubles (already representable, or rounded on the way) into the
// dtype's bytes, and decodes them back.
std::vector<uint8_t> Encode(DType dtype, const std::vector<double>& values);
std::vector<double> Decode(DType dtype, const std::vector<uint8_t>& bytes);

// `n` values uniform in [lo, hi], rounded to `dtype`, never exactly zero.
std::vector<double> RandomValues(DType dtype, size_t n, double lo, double hi, uint64_t seed);

// Relative precision of a dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32).
double DTypeEpsilon(DType dtype);
const char* DTypeName(DType dtype);

// Passes when every |got - want| <= atol + rtol * |want| and every got is
// finite; otherwise names the count and the worst element (index, got,
// expected), with `describe(index)` adding context such as "token 3 head 2".
::testing::AssertionResult AllClose(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                    double rtol, const std::function<std::string(size_t)>& describe = nullptr);

// How far `got` is from `want`, element by element: the largest and the mean
// absolute error over the finite elements of `got`, the count of non-finite
// ones, and where the worst is (the first non-finite element, if any, else the
// largest error). For tests whose threshold is relative to another
// implementation's error rather than fixed (AllClose's atol/rtol).
struct ErrorStats {
  double max_abs = 0;
  double mean_abs = 0;
  size_t worst = 0;
  size_t non_finite = 0;
};
ErrorStats Errors(const std::vector<double>& got, const std::vector<double>& want);

// Runs fn(i) for i in [0, n) on all hardware threads.
void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

}  // namespace layerserve::kernels::testing

// Fails the current test (and returns) when a CUDA runtime call fails.
#define LS_ASSERT_CUDA_OK(expr)                                                      \
  do {                                                                               \
    const cudaError_t ls_err_ = (expr);                                              \
    ASSERT_EQ(ls_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(ls_err_); \
  } while (0)
