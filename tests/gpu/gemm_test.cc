// GPU tests of every GEMM version (cuBLASLt v0 and our v3-v5, each through
// GemmRouter::RunConfig, the launch code serving uses) and of the router's own
// choice (Run, untuned and autotuned) against a higher-precision reference: a plain fp32 GEMM on the device over
// the same bf16 inputs, itself checked against fp64 on the host at sampled
// elements. Inputs are random, outputs poisoned with NaN before each run, and
// every case prints its worst element. Skips where there is no GPU (or, for
// the Hopper versions, no Hopper GPU / sm_90a build).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "layerserve/kernels/gemm.h"
#include "tests/gpu/gemm_reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using gemm_testing::Bf16ToFloat;
using gemm_testing::CompareBf16;
using gemm_testing::CompareResult;
using gemm_testing::FillUniformBf16;
using gemm_testing::ReferenceGemmF32;
using testing::DeviceBuffer;

struct Shape {
  int64_t m, n, k;
};

// Llama-3-8B projections (qkv, o, gate_up, down) plus an awkward small shape
// (partial tiles in N and a partial 64-wide k-block). The largest M values
// are subsampled to keep the suite short.
std::vector<Shape> TestShapes() {
  std::vector<Shape> shapes;
  const int64_t nk[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}, {392, 136}};
  for (const auto& [n, k] : nk) {
    for (int64_t m : {1, 3, 17, 64, 127, 128, 1000}) shapes.push_back({m, n, k});
  }
  shapes.push_back({4096, 4096, 14336});
  shapes.push_back({8191, 4096, 4096});
  shapes.push_back({8191, 392, 136});
  return shapes;
}

// kConfig: the variant's configuration through RunConfig; kRoute: the
// router's own choice through Run (untuned defaults).
enum class Runner { kConfig, kRoute };

struct Variant {
  std::string name;
  Runner runner;
  GemmConfig config;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

std::vector<Variant> Variants() {
  return {
      {"v0_cublaslt", Runner::kConfig, {GemmVersion::kCublasLt, 0}},
      // cuBLASLt's fourth heuristic answer for the M bucket's timed size,
      // where it runs the call (else its first): what a tuned table may pick.
      {"v0_cublaslt_answer3", Runner::kConfig, {GemmVersion::kCublasLt, 0, 0, 0, 3}},
      {"v3_bn256", Runner::kConfig, {GemmVersion::kWarpSpecialized, 0, 256}},
      {"v3_bn128", Runner::kConfig, {GemmVersion::kWarpSpecialized, 0, 128}},
      {"v4_split_auto", Runner::kConfig, {GemmVersion::kSmallMSplitK, 0}},
      {"v4_split_1", Runner::kConfig, {GemmVersion::kSmallMSplitK, 1}},
      {"v4_split_3", Runner::kConfig, {GemmVersion::kSmallMSplitK, 3}},
      {"v4_split_8", Runner::kConfig, {GemmVersion::kSmallMSplitK, 8}},
      {"v5_cluster_multicast", Runner::kConfig, {GemmVersion::kClusterMulticast, 0}},
      {"router_auto", Runner::kRoute, {}},
  };
}

class GemmVersionTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    ASSERT_EQ(cudaMalloc(&workspace_.data, GemmRouter::kDefaultWorkspaceBytes), cudaSuccess);
    workspace_.bytes = GemmRouter::kDefaultWorkspaceBytes;
    const Variant& v = GetParam();
    if (v.runner == Runner::kConfig && v.config.version != GemmVersion::kCublasLt) {
      GemmParams probe;
      probe.a = probe.w = probe.d = reinterpret_cast<void*>(256);
      probe.m = 1;
      probe.n = probe.k = probe.lda = probe.ldw = probe.ldd = 64;
      const absl::Status supported = GemmSupported(probe, v.config, router_->device());
      if (absl::IsUnimplemented(supported)) GTEST_SKIP() << v.name << ": " << supported.message();
      ASSERT_TRUE(supported.ok()) << supported;
    }
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (workspace_.data != nullptr) cudaFree(workspace_.data);
  }

  bool Applies(const Shape& s) const { return GetParam().config.version != GemmVersion::kSmallMSplitK || s.m <= 64; }

  absl::Status Run(const GemmParams& p) {
    const Variant& v = GetParam();
    if (v.runner == Runner::kRoute) return router_->Run(p, workspace_, stream_);
    return router_->RunConfig(p, v.config, workspace_, stream_);
  }
  // True when `p` may run on cuBLASLt, whose in-place path may round the
  // product before adding D (layerserve/kernels/gemm.h).
  bool MayUseCublasLt(const GemmParams& p) const {
    const Variant& v = GetParam();
    if (v.runner == Runner::kRoute) return router_->Route(p).version == GemmVersion::kCublasLt;
    return v.config.version == GemmVersion::kCublasLt;
  }

  void CheckShape(const Shape& s);

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmRouter> router_;
  GemmWorkspace workspace_;
};

// fp64 dot product of row i of A and row j of W, read back from the device.
double HostDot(const void* a, const void* w, int64_t i, int64_t j, int64_t k) {
  std::vector<uint16_t> arow(k), wrow(k);
  cudaMemcpy(arow.data(), static_cast<const uint16_t*>(a) + i * k, k * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(wrow.data(), static_cast<const uint16_t*>(w) + j * k, k * 2, cudaMemcpyDeviceToHost);
  double sum = 0.0;
  for (int64_t t = 0; t < k; ++t) sum += static_cast<double>(Bf16ToFloat(arow[t])) * Bf16ToFloat(wrow[t]);
  return sum;
}

void GemmVersionTest::CheckShape(const Shape& s) {
  const std::string& name = GetParam().name;
  SCOPED_TRACE(name + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k));
  DeviceBuffer a(s.m * s.k * 2), w(s.n * s.k * 2), r(s.m * s.n * 2), c(s.m * s.n * 2), ref(s.m * s.n * 4);
  ASSERT_FALSE(HasFailure());  // a failed allocation is a test failure
  const uint64_t seed = static_cast<uint64_t>(s.m * 1000003 + s.n * 1009 + s.k);
  ASSERT_EQ(FillUniformBf16(a.get(), s.m * s.k, seed, 1.f, stream_), cudaSuccess);
  ASSERT_EQ(FillUniformBf16(w.get(), s.n * s.k, seed + 1, 1.f, stream_), cudaSuccess);
  // Residual on the scale of the product, so that dropping or doubling it shows.
  ASSERT_EQ(FillUniformBf16(r.get(), s.m * s.n, seed + 2, 0.5f * std::sqrt(static_cast<float>(s.k)), stream_),
            cudaSuccess);
  ASSERT_EQ(ReferenceGemmF32(a.get(), w.get(), static_cast<float*>(ref.get()), s.m, s.n, s.k, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

  // The fp32 reference against fp64 at sampled elements (corners included).
  double sum_sq = 0.0, worst_ref_err = 0.0;
  constexpr int kSamples = 24;
  std::vector<double> errs;
  for (int i = 0; i < kSamples; ++i) {
    const int64_t row = i == 0 ? 0 : i == 1 ? s.m - 1 : (i * 7919) % s.m;
    const int64_t col = i == 0 ? 0 : i == 1 ? s.n - 1 : (i * 104729) % s.n;
    const double exact = HostDot(a.get(), w.get(), row, col, s.k);
    float got = 0.f;
    ASSERT_EQ(cudaMemcpy(&got, static_cast<float*>(ref.get()) + row * s.n + col, 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    sum_sq += exact * exact;
    errs.push_back(std::fabs(got - exact));
  }
  const double scale = std::sqrt(sum_sq / kSamples);
  for (double e : errs) worst_ref_err = std::max(worst_ref_err, e);
  ASSERT_LE(worst_ref_err, 1e-4 * scale) << "fp32 reference disagrees with fp64";

  // bf16 output: one rounding (<= 2^-8 relative) plus accumulation-order
  // noise, far below what any indexing or pipeline bug produces.
  const float rel_tol = 1.01f / 256.f;
  const float abs_tol = static_cast<float>(1e-3 * scale);
  for (int mode = 0; mode < 2; ++mode) {  // 0: plain, 1: accumulate in place (D += A·Wᵀ)
    GemmParams p;
    p.a = a.get();
    p.lda = s.k;
    p.w = w.get();
    p.ldw = s.k;
    p.d = c.get();
    p.ldd = s.n;
    p.m = s.m;
    p.n = s.n;
    p.k = s.k;
    if (mode == 1) {
      if (s.m > 128) continue;  // once per small shape is enough
      ASSERT_EQ(cudaMemcpy(c.get(), r.get(), s.m * s.n * 2, cudaMemcpyDeviceToDevice), cudaSuccess);
      p.accumulate = true;
    } else {
      ASSERT_EQ(cudaMemset(c.get(), 0xFF, s.m * s.n * 2), cudaSuccess);  // bf16 NaN
    }
    const absl::Status st = Run(p);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess)
        << "kernel failed: " << cudaGetErrorString(cudaGetLastError());
    CompareResult res;
    // cuBLASLt may round the product once more before adding D in place.
    const float product_rel_tol = mode == 1 && MayUseCublasLt(p) ? rel_tol : 0.f;
    ASSERT_EQ(CompareBf16(c.get(), static_cast<float*>(ref.get()), mode == 0 ? nullptr : r.get(), s.m * s.n, rel_tol,
                          abs_tol, stream_, &res, product_rel_tol),
              cudaSuccess);
    const int64_t row = res.worst_index / s.n, col = res.worst_index % s.n;
    std::printf(
        "[%s] m=%lld n=%lld k=%lld residual=%d: worst err/allowed=%.3g at (%lld, %lld) out=%.6g ref=%.6g "
        "bad=%lld (ref-vs-fp64 %.2g of scale %.3g)\n",
        name.c_str(), static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k), mode,
        res.worst_ratio, static_cast<long long>(row), static_cast<long long>(col), res.worst_out, res.worst_ref,
        static_cast<long long>(res.bad_count), worst_ref_err / scale, scale);
    EXPECT_EQ(res.bad_count, 0) << "worst element (" << row << ", " << col << "): out " << res.worst_out << " vs ref "
                                << res.worst_ref << ", err/allowed " << res.worst_ratio;
  }
}

TEST_P(GemmVersionTest, MatchesReference) {
  for (const Shape& s : TestShapes()) {
    if (!Applies(s)) continue;
    CheckShape(s);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(AllVersions, GemmVersionTest, ::testing::ValuesIn(Variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

// Autotune picks per bucket among versions that each passed the suite above;
// the tuned router must still compute the right thing and keep pins.
TEST(GemmRouterAutotuneTest, AutotunedChoicesAreCorrect) {
  if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
  ASSERT_TRUE(router.ok()) << router.status();
  DeviceBuffer workspace_memory(GemmRouter::kDefaultWorkspaceBytes);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const GemmWorkspace workspace{workspace_memory.get(), GemmRouter::kDefaultWorkspaceBytes};
  const int64_t n = 4096, k = 4096;
  ASSERT_TRUE((*router)->Autotune(n, k, int64_t{1} << 40, workspace, stream).ok());
  for (int64_t m : {1, 64, 300, 4096}) {
    DeviceBuffer a(m * k * 2), w(n * k * 2), c(m * n * 2), ref(m * n * 4);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_EQ(FillUniformBf16(a.get(), m * k, 11, 1.f, stream), cudaSuccess);
    ASSERT_EQ(FillUniformBf16(w.get(), n * k, 12, 1.f, stream), cudaSuccess);
    ASSERT_EQ(ReferenceGemmF32(a.get(), w.get(), static_cast<float*>(ref.get()), m, n, k, stream), cudaSuccess);
    ASSERT_EQ(cudaMemset(c.get(), 0xFF, m * n * 2), cudaSuccess);
    GemmParams p;
    p.a = a.get();
    p.lda = k;
    p.w = w.get();
    p.ldw = k;
    p.d = c.get();
    p.ldd = n;
    p.m = m;
    p.n = n;
    p.k = k;
    std::printf("[autotune] n=%lld k=%lld m=%lld -> %s\n", static_cast<long long>(n), static_cast<long long>(k),
                static_cast<long long>(m), GemmConfigName((*router)->Route(p)).c_str());
    ASSERT_TRUE((*router)->Run(p, workspace, stream).ok());
    CompareResult res;
    const float scale = std::sqrt(static_cast<float>(k)) / 3.f;  // uniform [-1, 1) inputs
    ASSERT_EQ(CompareBf16(c.get(), static_cast<float*>(ref.get()), nullptr, m * n, 1.01f / 256.f, 1e-3f * scale, stream,
                          &res),
              cudaSuccess);
    EXPECT_EQ(res.bad_count, 0) << "worst " << res.worst_out << " vs " << res.worst_ref;
  }
  (*router)->SetChoice(5, n, k, GemmConfig{GemmVersion::kCublasLt, 0});
  EXPECT_EQ((*router)->table().at({GemmMBucket(7), n, k, Fp8Scaling::kNone}).version, GemmVersion::kCublasLt);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace layerserve::kernels
