// The CUDA backend's GEMM wrapper (server/cuda/gemm.h) against a float64 host
// product: D = A · Wᵀ (+ bias) (+ D) in row-major bf16 and fp16, at decode
// (m = 1), odd and prefill shapes, with strided operands. The backend test
// checks whole layers; this one isolates the row-major <-> column-major
// mapping, the bias epilogue and the in-place residual (beta = 1).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/core/dtype.h"
#include "server/cuda/cuda_backend.h"
#include "server/cuda/cuda_resources.h"
#include "server/cuda/gemm.h"

namespace layerserve::cuda {
namespace {

struct Case {
  int64_t m, n, k;
  bool bias;
  bool accumulate;
  kernels::DType dtype;
  int64_t row_pad;  // extra elements per row of A and D (strided operands)
};

std::vector<uint16_t> Encode(const std::vector<float>& v, kernels::DType t) {
  std::vector<uint16_t> out(v.size());
  ConvertFromFloat(v.data(), v.size(), t == kernels::DType::kF16 ? DType::kF16 : DType::kBF16,
                   out.data());
  return out;
}

std::vector<float> Decode(const std::vector<uint16_t>& v, kernels::DType t) {
  std::vector<float> out(v.size());
  ConvertToFloat(t == kernels::DType::kF16 ? DType::kF16 : DType::kBF16, v.data(), v.size(),
                 out.data());
  return out;
}

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(host.size() * sizeof(T));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(
      cudaMemcpy(buffer->data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
      cudaSuccess);
  return std::move(*buffer);
}

class GemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(GemmTest, MatchesFloat64Reference) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  const Case c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.m * 131 + c.n * 7 + c.k));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t lda = c.k + c.row_pad, ldd = c.n + c.row_pad;
  std::vector<float> a(static_cast<size_t>(c.m * lda)), w(static_cast<size_t>(c.n * c.k)),
      bias(static_cast<size_t>(c.n)), d(static_cast<size_t>(c.m * ldd));
  for (float& v : a) v = dist(rng);
  for (float& v : w) v = dist(rng) / std::sqrt(float(c.k));
  for (float& v : bias) v = dist(rng);
  for (float& v : d) v = dist(rng);
  // Round the inputs to the device dtype so the reference sees the same values.
  const std::vector<uint16_t> a16 = Encode(a, c.dtype), w16 = Encode(w, c.dtype),
                              b16 = Encode(bias, c.dtype), d16 = Encode(d, c.dtype);
  a = Decode(a16, c.dtype);
  w = Decode(w16, c.dtype);
  bias = Decode(b16, c.dtype);
  d = Decode(d16, c.dtype);

  DeviceBuffer a_dev = Upload(a16), w_dev = Upload(w16), b_dev = Upload(b16), d_dev = Upload(d16);
  auto engine = GemmEngine::Create(GemmEngine::kDefaultWorkspaceBytes);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto workspace = DeviceBuffer::Allocate(GemmEngine::kDefaultWorkspaceBytes);
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  GemmParams p;
  p.a = a_dev.data();
  p.lda = lda;
  p.w = w_dev.data();
  p.ldw = c.k;
  p.d = d_dev.data();
  p.ldd = ldd;
  p.bias = c.bias ? b_dev.data() : nullptr;
  p.accumulate = c.accumulate;
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  p.dtype = c.dtype;
  const absl::Status status =
      (*engine)->Gemm(p, GemmWorkspace{workspace->data(), workspace->bytes()}, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  std::vector<uint16_t> out16(d16.size());
  ASSERT_EQ(cudaMemcpy(out16.data(), d_dev.data(), out16.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  const std::vector<float> out = Decode(out16, c.dtype);

  // bf16 output rounding is 2^-9 relative; fp32 accumulation adds little.
  const double tol = c.dtype == kernels::DType::kF16 ? 2e-3 : 8e-3;
  double worst = 0;
  std::string where;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < ldd; ++j) {
      const double got = out[static_cast<size_t>(i * ldd + j)];
      double want = d[static_cast<size_t>(i * ldd + j)];  // padding must stay untouched
      if (j < c.n) {
        double acc = c.accumulate ? want : 0.0;
        for (int64_t t = 0; t < c.k; ++t) {
          acc += double(a[static_cast<size_t>(i * lda + t)]) * w[static_cast<size_t>(j * c.k + t)];
        }
        if (c.bias) acc += bias[static_cast<size_t>(j)];
        want = acc;
      }
      const double err = std::abs(got - want) / (1.0 + std::abs(want));
      if (!(err <= worst)) {
        worst = std::isfinite(err) ? err : 1e30;
        where = "row " + std::to_string(i) + " col " + std::to_string(j) + ": got " +
                std::to_string(got) + " want " + std::to_string(want);
      }
    }
  }
  EXPECT_LE(worst, tol) << "worst element " << where;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTest,
    ::testing::Values(Case{1, 768, 512, false, false, kernels::DType::kBF16, 0},
                      Case{1, 512, 1024, false, true, kernels::DType::kBF16, 0},
                      Case{7, 384, 256, true, false, kernels::DType::kBF16, 0},
                      Case{33, 256, 688, false, true, kernels::DType::kF16, 0},
                      Case{300, 1376, 256, false, false, kernels::DType::kBF16, 0},
                      Case{129, 384, 256, true, false, kernels::DType::kF16, 8},
                      Case{64, 256, 256, false, true, kernels::DType::kBF16, 8}));

}  // namespace
}  // namespace layerserve::cuda
