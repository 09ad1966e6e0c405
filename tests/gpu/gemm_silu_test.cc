// GPU tests of the gated GEMM epilogue (GemmParams::silu_mul): the MLP's
// gate/up projection writing silu(gate) * up straight from the accumulators.
//
// Each case runs one configuration twice on the same random bf16 operands:
// plain (the [m, n] product), followed by the separate SiLU kernel, and
// fused. The two must agree bit for bit, since the epilogue rounds as the
// kernel does and the accumulation order is the configuration's own; and
// both must match the float32 reference product gated on the host, so that
// a layout both got wrong the same way cannot pass. Configurations: v4 (1
// and 3 K splits, and its own choice), v3 at both tile widths, the cuBLASLt
// route (plain product into the scratch buffer, then the kernel), and
// grouped products on v4 and v3 (64- and 128-row tiles) with ragged and
// empty groups. Outputs are poisoned first. Plus the calls that must be
// refused. Skips where there is no GPU, and our kernels' cases where there
// is no Hopper GPU or sm_90a build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/layer_ops.h"
#include "tests/gpu/gemm_reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using gemm_testing::Bf16ToFloat;
using gemm_testing::FillUniformBf16;
using gemm_testing::ReferenceGemmF32;
using testing::DeviceBuffer;

struct GatedCase {
  std::string name;
  GemmMode mode;      // the router's mode; kCublasLt for the cuBLASLt route
  GemmConfig config;  // run through RunConfig (ignored for kCublasLt: Run)
  int64_t m, n, k;
  std::vector<int32_t> groups;  // rows per group; empty for a dense product
};

std::vector<GatedCase> Cases() {
  const GemmConfig v4{GemmVersion::kSmallMSplitK, 0};
  const GemmConfig v4s1{GemmVersion::kSmallMSplitK, 1};
  const GemmConfig v4s3{GemmVersion::kSmallMSplitK, 3};
  const GemmConfig v3b128{GemmVersion::kWarpSpecialized, 0, 128};
  const GemmConfig v3b256{GemmVersion::kWarpSpecialized, 0, 256};
  const GemmConfig v3bm64{GemmVersion::kWarpSpecialized, 0, 256, 64};
  const GemmConfig v3bm128{GemmVersion::kWarpSpecialized, 0, 128, 128};
  std::vector<GatedCase> cases;
  // n = 400: a partial 128-row W tile (v4) and partial column tiles (v3);
  // k = 136: a partial 64-wide k-block.
  for (const int64_t m : {1, 5, 16, 33, 64}) {
    cases.push_back({"v4_m" + std::to_string(m), GemmMode::kCustom, v4, m, 400, 136, {}});
  }
  cases.push_back({"v4s1_m8", GemmMode::kCustom, v4s1, 8, 1024, 512, {}});
  cases.push_back({"v4s3_m24", GemmMode::kCustom, v4s3, 24, 1024, 512, {}});
  // v3 at 1 and 64 rows: one 128-row tile whose second half is past M.
  for (const int64_t m : {1, 64, 65, 300}) {
    cases.push_back({"v3b128_m" + std::to_string(m), GemmMode::kCustom, v3b128, m, 400, 136, {}});
    cases.push_back({"v3b256_m" + std::to_string(m), GemmMode::kCustom, v3b256, m, 1024, 512, {}});
  }
  // Llama-3-8B's gate/up at decode and at a short prefill.
  cases.push_back({"v4_llama_m4", GemmMode::kCustom, v4, 4, 28672, 4096, {}});
  cases.push_back({"v3_llama_m200", GemmMode::kCustom, v3b256, 200, 28672, 4096, {}});
  for (const int64_t m : {1, 200}) {
    cases.push_back({"cublaslt_m" + std::to_string(m), GemmMode::kCublasLt, {}, m, 400, 136, {}});
  }
  const std::vector<int32_t> small = {3, 0, 5, 1, 0, 0, 7, 2};
  const std::vector<int32_t> large = {130, 0, 257, 1, 64, 0, 0, 300};
  cases.push_back({"grouped_v4", GemmMode::kAuto, v4, 0, 400, 136, small});
  cases.push_back({"grouped_v3_bm64", GemmMode::kAuto, v3bm64, 0, 400, 136, large});
  cases.push_back({"grouped_v3_bm128", GemmMode::kAuto, v3bm128, 0, 1024, 512, large});
  return cases;
}

class GatedEpilogueTest : public testing::GpuTestWithParam<GatedCase> {
 protected:
  void SetUp() override {
    testing::GpuTestWithParam<GatedCase>::SetUp();
    if (IsSkipped()) return;
    absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GetParam().mode);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    if (GetParam().mode != GemmMode::kCublasLt && !router_->custom_kernels_enabled()) {
      GTEST_SKIP() << "our GEMM kernels cannot run on this device/build";
    }
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Run(const GemmParams& p, const GemmWorkspace& workspace) {
    if (GetParam().mode == GemmMode::kCublasLt) return router_->Run(p, workspace, stream_);
    return router_->RunConfig(p, GetParam().config, workspace, stream_);
  }

  std::unique_ptr<GemmRouter> router_;
  cudaStream_t stream_ = nullptr;
};

std::vector<uint16_t> DownloadBf16(const DeviceBuffer& buffer, int64_t count) {
  std::vector<uint16_t> host(static_cast<size_t>(count));
  buffer.Download(host.data(), host.size() * 2);
  return host;
}

// The host's gate: silu(gate) * up of the float32 reference product, with the
// roundings the kernels apply (gate, up and silu's result to bf16).
double GatedReference(float gate, float up) {
  const double g = testing::RoundToDType(DType::kBF16, gate);
  const double silu = testing::RoundToDType(DType::kBF16, g / (1.0 + std::exp(-g)));
  return silu * testing::RoundToDType(DType::kBF16, up);
}

TEST_P(GatedEpilogueTest, MatchesUnfusedBitForBitAndTheReference) {
  const GatedCase& c = GetParam();
  const bool grouped = !c.groups.empty();
  const int groups = static_cast<int>(c.groups.size());
  std::vector<int32_t> offsets(c.groups.size() + 1, 0);
  std::partial_sum(c.groups.begin(), c.groups.end(), offsets.begin() + 1);
  const int64_t m = grouped ? offsets.back() : c.m, n = c.n, k = c.k, width = n / 2;
  const int64_t w_rows = grouped ? groups * n : n;
  DeviceBuffer a(m * k * 2), w(w_rows * k * 2), plain(m * n * 2), unfused(m * width * 2), fused(m * width * 2),
      scratch(m * n * 2), ref(m * n * 4), offsets_dev(offsets.size() * 4),
      workspace(GemmRouter::kDefaultWorkspaceBytes);
  ASSERT_FALSE(HasFailure());
  const uint64_t seed = static_cast<uint64_t>(m * 7919 + n * 31 + k);
  // Inputs of about unit scale at the output: gates reach silu's curved part.
  LS_ASSERT_CUDA_OK(FillUniformBf16(a.get(), m * k, seed, 1.f, stream_));
  LS_ASSERT_CUDA_OK(FillUniformBf16(w.get(), w_rows * k, seed + 1, 3.f / std::sqrt(static_cast<float>(k)), stream_));
  offsets_dev.Upload(offsets.data(), offsets.size() * 4);
  plain.Poison();
  unfused.Poison();
  fused.Poison();
  scratch.Poison();

  GemmParams p;
  p.a = a.get();
  p.lda = k;
  p.w = w.get();
  p.ldw = k;
  p.d = plain.get();
  p.ldd = n;
  p.m = m;
  p.n = n;
  p.k = k;
  if (grouped) {
    p.group_offsets = static_cast<const int32_t*>(offsets_dev.get());
    p.groups = groups;
    // A bound, as serving passes it (the tokens), not the largest group.
    p.max_group_rows = GetParam().config.version == GemmVersion::kSmallMSplitK ? std::min<int64_t>(m, 64) : m;
  }
  const GemmWorkspace ws{workspace.get(), workspace.bytes()};
  ASSERT_TRUE(Run(p, ws).ok());
  SiluMulParams act;
  act.gate_up = plain.get();
  act.out = unfused.get();
  act.rows = m;
  act.width = width;
  ASSERT_TRUE(LaunchSiluMul(act, stream_).ok());

  p.silu_mul = true;
  p.d = fused.get();
  p.ldd = width;
  p.scratch = scratch.get();
  const absl::Status st = Run(p, ws);
  ASSERT_TRUE(st.ok()) << st;

  // The float32 reference product, each group's rows by its own W_g.
  for (int g = 0; g < (grouped ? groups : 1); ++g) {
    const int64_t row0 = grouped ? offsets[g] : 0, rows = grouped ? c.groups[g] : m;
    if (rows == 0) continue;
    LS_ASSERT_CUDA_OK(ReferenceGemmF32(static_cast<const uint16_t*>(a.get()) + row0 * k,
                                       static_cast<const uint16_t*>(w.get()) + int64_t{g} * n * k,
                                       static_cast<float*>(ref.get()) + row0 * n, static_cast<int>(rows),
                                       static_cast<int>(n), static_cast<int>(k), stream_));
  }
  LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<uint16_t> got = DownloadBf16(fused, m * width), want_bits = DownloadBf16(unfused, m * width);
  std::vector<float> product(static_cast<size_t>(m * n));
  ref.Download(product.data(), product.size() * 4);

  int64_t differ = 0, bad = 0, first_differ = -1;
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t f = 0; f < width; ++f) {
      const int64_t at = i * width + f;
      if (got[at] != want_bits[at]) {
        if (first_differ < 0) first_differ = at;
        ++differ;
      }
      const double want = GatedReference(product[i * n + GateUpRow(f, false)], product[i * n + GateUpRow(f, true)]);
      const double out = Bf16ToFloat(got[at]);
      // Two bf16 roundings of the operands and two of the result, on
      // products accumulated in another order: a few ulps of bf16 at most.
      const double err = std::abs(out - want), allowed = 4.0 / 256.0 * std::abs(want) + 1e-2;
      if (!(err <= allowed)) ++bad;
      if (!(err / allowed <= worst)) {
        worst = std::isfinite(err) ? err / allowed : 1e30;
        worst_at = at;
      }
    }
  }
  std::printf("[%s] m=%lld n=%lld k=%lld route %s: %lld of %lld differ from unfused; worst err/allowed %.3g\n",
              c.name.c_str(), static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
              GemmConfigName(c.mode == GemmMode::kCublasLt ? router_->Route(p) : c.config).c_str(),
              static_cast<long long>(differ), static_cast<long long>(m * width), worst);
  EXPECT_EQ(differ, 0) << "first at row " << first_differ / width << " col " << first_differ % width << ": fused "
                       << Bf16ToFloat(got[first_differ]) << " unfused " << Bf16ToFloat(want_bits[first_differ]);
  EXPECT_EQ(bad, 0) << "worst at row " << worst_at / width << " col " << worst_at % width << ": "
                    << Bf16ToFloat(got[worst_at]);
}

INSTANTIATE_TEST_SUITE_P(Configs, GatedEpilogueTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<GatedCase>& info) { return info.param.name; });

// What the gated epilogue refuses, and where it routes: pure decisions, no
// device needed.
TEST(GatedEpilogueRouteTest, RefusesAndReroutes) {
  DeviceInfo hopper;
  hopper.cc_major = 9;
  hopper.cc_minor = 0;
  hopper.num_sms = 132;
  GemmParams p;
  p.a = p.w = p.d = p.scratch = reinterpret_cast<void*>(256);
  p.m = 300;
  p.n = 1024;
  p.k = p.lda = p.ldw = 512;
  p.ldd = 512;
  p.silu_mul = true;
  if (GemmBuiltWithSm90a()) {
    EXPECT_TRUE(GemmSupported(p, {GemmVersion::kWarpSpecialized}, hopper).ok());
    EXPECT_TRUE(GemmSupported(p, {GemmVersion::kSmallMSplitK}, hopper).code() == absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(GemmSupported(p, {GemmVersion::kClusterMulticast}, hopper).code(), absl::StatusCode::kInvalidArgument);
    // A table that chose v5 for the shape runs v3 for the gated call.
    GemmTable table;
    table[{GemmMBucket(p.m), p.n, p.k, Fp8Scaling::kNone}] = {GemmVersion::kClusterMulticast};
    EXPECT_EQ(ChooseGemm(p, GemmMode::kAuto, table, hopper).version, GemmVersion::kWarpSpecialized);
    // ldd counts the gated output's columns.
    p.ldd = 1024;
    EXPECT_EQ(GemmSupported(p, {GemmVersion::kWarpSpecialized}, hopper).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(GatedEpilogueRouteTest, RouterRejectsBadCalls) {
  if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kCublasLt);
  ASSERT_TRUE(router.ok()) << router.status();
  DeviceBuffer buffer(1 << 20);
  GemmParams p;
  p.a = p.w = p.d = buffer.get();
  p.m = 4;
  p.n = 64;
  p.k = p.lda = p.ldw = 64;
  p.ldd = 32;
  p.silu_mul = true;
  const GemmWorkspace none;
  // cuBLASLt needs somewhere for the plain product.
  EXPECT_EQ((*router)->Run(p, none, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.scratch = buffer.get();
  p.n = 72;  // not a multiple of 16
  p.ldd = 36;
  EXPECT_EQ((*router)->Run(p, none, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.n = 64;
  p.ldd = 32;
  p.accumulate = true;
  EXPECT_EQ((*router)->Run(p, none, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.accumulate = false;
  p.ldd = 64;  // the output is dense
  EXPECT_EQ((*router)->Run(p, none, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layerserve::kernels
