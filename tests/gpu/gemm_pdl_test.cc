// GPU test of chained GEMM launches, the pattern that programmatic dependent
// launch (version 4 starts streaming W before the preceding kernel has
// finished) could break. Each launch of a chain reads the previous launch's
// output as A and overwrites a buffer the previous launch read, both plainly
// and accumulating in place (D += A·Wᵀ, the residual form serving uses). The chain starts right
// after the kernels that fill its buffers, which do not trigger early (the
// server's RMSNorm, attention and SiLU-mul kernels do; cuda_backend_test
// covers that order against the CPU backend). It runs back to back on a
// stream and captured in a CUDA graph, and must match the same chain run one
// launch at a time (stream synchronized after each, so nothing overlaps) bit
// for bit: version 4 sums its K splits in a fixed order. A third chain
// alternates cuBLASLt and version 4, so the primary grid is also a library
// kernel; it is held to a tolerance in case cuBLASLt's own summation order
// varies. Skips without a GPU, or without Hopper / an sm_90a build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "layerserve/kernels/gemm.h"
#include "tests/gpu/gemm_reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using gemm_testing::Bf16ToFloat;
using gemm_testing::FillUniformBf16;
using testing::DeviceBuffer;
using testing::HaveCudaDevice;

constexpr int kChainLength = 8;
constexpr int kStreamRepeats = 3;
constexpr int kGraphReplays = 2;

// What a launch does with its output buffer x[next]: kNone overwrites it
// (x[next] = x[cur]·Wᵀ), kInPlace accumulates into it (x[next] += x[cur]·Wᵀ).
enum class Residual { kNone, kInPlace };

struct ChainCase {
  int64_t m;
  int64_t d;   // n == k, so one launch's output is the next one's A
  int splits;  // version 4's split_k (0: the launcher's choice)
  Residual residual;
  bool with_cublaslt;  // even steps run cuBLASLt
};

std::string CaseName(const ::testing::TestParamInfo<ChainCase>& info) {
  const ChainCase& c = info.param;
  return absl::StrCat("m", c.m, "_d", c.d, "_s", c.splits, c.residual == Residual::kInPlace ? "_inplace" : "_plain",
                      c.with_cublaslt ? "_cublaslt" : "");
}

std::vector<ChainCase> Cases() {
  std::vector<ChainCase> cases;
  for (int64_t d : {4096, 1024, 136}) {
    for (int64_t m : {1, 8, 17, 64}) {
      for (int splits : {0, 1, 8}) {
        for (Residual r : {Residual::kNone, Residual::kInPlace}) cases.push_back({m, d, splits, r, false});
      }
      cases.push_back({m, d, 0, Residual::kInPlace, true});
    }
  }
  return cases;
}

class GemmChainTest : public ::testing::TestWithParam<ChainCase> {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(*router);
    workspace_ = std::make_unique<DeviceBuffer>(GemmRouter::kDefaultWorkspaceBytes);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  GemmParams Step(int i) const {
    const ChainCase& c = GetParam();
    GemmParams p;
    p.a = x_[i % 2];
    p.w = w_;
    p.d = x_[(i + 1) % 2];
    p.accumulate = c.residual == Residual::kInPlace;
    p.m = c.m;
    p.n = p.ldd = c.d;
    p.k = p.lda = p.ldw = c.d;
    return p;
  }

  // Fills both buffers (the launch just before the chain writes its first
  // launch's residual or output) and enqueues the chain; with `sync_each`,
  // waits for the fills and for every launch before the next.
  absl::Status EnqueueChain(bool sync_each) {
    const ChainCase& c = GetParam();
    const int64_t count = c.m * c.d;
    if (FillUniformBf16(x_[0], count, 21, 1.f, stream_) != cudaSuccess ||
        FillUniformBf16(x_[1], count, 22, 1.f, stream_) != cudaSuccess) {
      return absl::InternalError("fill failed");
    }
    if (sync_each && cudaStreamSynchronize(stream_) != cudaSuccess) return absl::InternalError("fill failed");
    const GemmConfig v4{GemmVersion::kSmallMSplitK, c.splits, 0};
    for (int i = 0; i < kChainLength; ++i) {
      const GemmParams p = Step(i);
      const GemmConfig config = c.with_cublaslt && i % 2 == 0 ? GemmConfig{GemmVersion::kCublasLt} : v4;
      const absl::Status st =
          router_->RunConfig(p, config, GemmWorkspace{workspace_->get(), workspace_->bytes()}, stream_);
      if (!st.ok()) return st;
      if (sync_each && cudaStreamSynchronize(stream_) != cudaSuccess) {
        return absl::InternalError(cudaGetErrorString(cudaGetLastError()));
      }
    }
    return absl::OkStatus();
  }

  // Both buffers, x[0] then x[1], as bf16 bits.
  std::vector<uint16_t> ReadBack() const {
    const size_t count = static_cast<size_t>(GetParam().m * GetParam().d);
    std::vector<uint16_t> out(2 * count);
    for (int b = 0; b < 2; ++b) {
      EXPECT_EQ(cudaMemcpy(out.data() + b * count, x_[b], count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }

  // Every element within tol * rms(expected) (tol 0: equal values), else a
  // failure naming the worst element.
  void ExpectMatches(const std::vector<uint16_t>& got, const std::vector<uint16_t>& expected, double tol,
                     const std::string& what) const {
    double sum_sq = 0.0;
    for (uint16_t e : expected) sum_sq += static_cast<double>(Bf16ToFloat(e)) * Bf16ToFloat(e);
    const double allowed = tol * std::sqrt(sum_sq / static_cast<double>(expected.size()));
    int64_t bad = 0, worst = -1;
    double worst_err = -1.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double g = Bf16ToFloat(got[i]);
      const double e = Bf16ToFloat(expected[i]);
      const double err = std::isfinite(g) ? std::fabs(g - e) : INFINITY;
      if (!(err <= allowed)) ++bad;
      if (!(err <= worst_err)) {
        worst_err = err;
        worst = static_cast<int64_t>(i);
      }
    }
    const int64_t per_buffer = GetParam().m * GetParam().d;
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off; worst x[" << worst / per_buffer
                      << "][" << (worst % per_buffer) / GetParam().d << ", " << worst % GetParam().d
                      << "] = " << Bf16ToFloat(got[worst]) << ", expected " << Bf16ToFloat(expected[worst])
                      << " (allowed error " << allowed << ")";
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmRouter> router_;
  std::unique_ptr<DeviceBuffer> workspace_;
  void* x_[2] = {nullptr, nullptr};
  const void* w_ = nullptr;
};

TEST_P(GemmChainTest, OverlappedChainMatchesSerialChain) {
  const ChainCase& c = GetParam();
  DeviceBuffer w(c.d * c.d * 2), x0(c.m * c.d * 2), x1(c.m * c.d * 2);
  ASSERT_FALSE(HasFailure());  // DeviceBuffer reports a failed cudaMalloc
  w_ = w.get();
  x_[0] = x0.get();
  x_[1] = x1.get();
  const absl::Status supported =
      GemmSupported(Step(0), GemmConfig{GemmVersion::kSmallMSplitK, c.splits, 0}, router_->device());
  if (!supported.ok()) GTEST_SKIP() << supported;
  // |W| <= 1/sqrt(d) keeps the chain's values within a few times their start.
  ASSERT_EQ(FillUniformBf16(w.get(), c.d * c.d, 20, 1.f / std::sqrt(static_cast<float>(c.d)), stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const double tol = c.with_cublaslt ? 2e-2 : 0.0;

  absl::Status st = EnqueueChain(/*sync_each=*/true);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<uint16_t> serial = ReadBack();

  for (int rep = 0; rep < kStreamRepeats; ++rep) {
    st = EnqueueChain(/*sync_each=*/false);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
    ExpectMatches(ReadBack(), serial, tol, absl::StrCat("stream, repeat ", rep));
  }

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  st = EnqueueChain(/*sync_each=*/false);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st;
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  ASSERT_EQ(instantiated, cudaSuccess) << cudaGetErrorString(instantiated);
  for (int rep = 0; rep < kGraphReplays; ++rep) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
    ExpectMatches(ReadBack(), serial, tol, absl::StrCat("graph, replay ", rep));
  }
  cudaGraphExecDestroy(exec);
}

INSTANTIATE_TEST_SUITE_P(Chains, GemmChainTest, ::testing::ValuesIn(Cases()), CaseName);

}  // namespace
}  // namespace layerserve::kernels
