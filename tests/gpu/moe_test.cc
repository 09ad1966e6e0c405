// GPU tests of the mixture-of-experts pieces: the grouped GEMM (v4 for small
// groups, v3 at both tile widths and both tile heights for large ones, and
// the router's own route)
// against a plain fp32 GEMM per group on the same bf16 inputs, with ragged
// groups, empty groups and every row in one group; and the routing,
// gather and combine kernels against float64 references on the host.
// Outputs are poisoned before each run; inputs are random. Skips where there
// is no GPU, and the GEMM cases where there is no Hopper GPU or sm_90a build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/moe.h"
#include "tests/gpu/gemm_reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using gemm_testing::CompareBf16;
using gemm_testing::CompareResult;
using gemm_testing::FillUniformBf16;
using gemm_testing::ReferenceGemmF32;
using testing::DeviceBuffer;

// ---- grouped GEMM ---------------------------------------------------------

struct GroupedCase {
  std::string name;
  std::vector<int32_t> rows;  // per group
  int64_t n, k;
};

std::vector<GroupedCase> GroupedCases() {
  return {
      // Decode: two tokens' choices, Mixtral's projections (v4).
      {"decode_gate_up", {0, 1, 0, 0, 1, 0, 0, 0}, 28672, 4096},
      {"decode_down", {0, 1, 0, 0, 1, 0, 0, 0}, 4096, 14336},
      // Ragged small groups with empty ones, a partial N tile and K block.
      {"ragged_small", {3, 0, 5, 1, 0, 0, 7, 2}, 392, 136},
      {"all_in_one_small", {0, 0, 0, 0, 0, 40, 0, 0}, 512, 1024},
      // Prefill-sized groups (v3): partial row tiles, empty groups, and
      // every row in one group.
      {"ragged_large", {130, 0, 257, 1, 64, 0, 0, 300}, 392, 136},
      {"all_in_one_large", {0, 0, 0, 700, 0, 0, 0, 0}, 1024, 512},
      {"mixtral_gate_up", {70, 31, 90, 12, 55, 64, 20, 170}, 28672, 4096},
      {"mixtral_down", {70, 31, 90, 12, 55, 64, 20, 170}, 4096, 14336},
  };
}

struct GroupedVariant {
  std::string name;
  bool route;  // the router's choice (Run) rather than `config`
  GemmConfig config;
};

class GroupedGemmTest : public testing::GpuTestWithParam<GroupedVariant> {
 protected:
  void SetUp() override {
    testing::GpuTestWithParam<GroupedVariant>::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    GemmParams probe;
    probe.a = probe.w = probe.d = reinterpret_cast<void*>(256);
    probe.m = 1;
    probe.n = probe.k = probe.lda = probe.ldw = probe.ldd = 64;
    probe.group_offsets = reinterpret_cast<const int32_t*>(256);
    probe.groups = 1;
    probe.max_group_rows = 1;
    GemmConfig config = GetParam().config;
    if (GetParam().route) config = router_->Route(probe);
    const absl::Status supported = GemmSupported(probe, config, router_->device());
    if (absl::IsUnimplemented(supported)) GTEST_SKIP() << GetParam().name << ": " << supported.message();
    ASSERT_TRUE(supported.ok()) << supported;
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  void Check(const GroupedCase& c, bool accumulate);

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmRouter> router_;
};

void GroupedGemmTest::Check(const GroupedCase& c, bool accumulate) {
  const GroupedVariant& v = GetParam();
  const int groups = static_cast<int>(c.rows.size());
  std::vector<int32_t> offsets(groups + 1, 0);
  std::partial_sum(c.rows.begin(), c.rows.end(), offsets.begin() + 1);
  const int64_t m = offsets.back();
  const int64_t max_rows = *std::max_element(c.rows.begin(), c.rows.end());
  if (!v.route && v.config.version == GemmVersion::kSmallMSplitK && max_rows > 64) return;
  if (!v.route && v.config.version == GemmVersion::kWarpSpecialized && max_rows <= 64 && c.n > 4096) {
    return;  // decode shapes on the prefill kernel: slow and covered by the small cases
  }
  SCOPED_TRACE(v.name + " " + c.name + (accumulate ? " accumulate" : ""));
  const int64_t n = c.n, k = c.k;
  DeviceBuffer a(m * k * 2), w(groups * n * k * 2), r(m * n * 2), d(m * n * 2), ref(m * n * 4),
      offsets_dev(offsets.size() * 4);
  ASSERT_FALSE(HasFailure());
  const uint64_t seed = static_cast<uint64_t>(m * 7919 + n * 31 + k);
  LS_ASSERT_CUDA_OK(FillUniformBf16(a.get(), m * k, seed, 1.f, stream_));
  LS_ASSERT_CUDA_OK(FillUniformBf16(w.get(), groups * n * k, seed + 1, 1.f, stream_));
  LS_ASSERT_CUDA_OK(FillUniformBf16(r.get(), m * n, seed + 2, 0.5f * std::sqrt(static_cast<float>(k)), stream_));
  offsets_dev.Upload(offsets.data(), offsets.size() * 4);
  // The reference: each group's rows times its own W_g.
  for (int g = 0; g < groups; ++g) {
    if (c.rows[g] == 0) continue;
    LS_ASSERT_CUDA_OK(ReferenceGemmF32(
        static_cast<const uint16_t*>(a.get()) + offsets[g] * k, static_cast<const uint16_t*>(w.get()) + g * n * k,
        static_cast<float*>(ref.get()) + offsets[g] * n, c.rows[g], static_cast<int>(n), static_cast<int>(k), stream_));
  }
  if (accumulate) {
    LS_ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), r.get(), m * n * 2, cudaMemcpyDeviceToDevice, stream_));
  } else {
    LS_ASSERT_CUDA_OK(cudaMemsetAsync(d.get(), 0xFF, m * n * 2, stream_));  // bf16 NaN
  }
  GemmParams p;
  p.a = a.get();
  p.lda = k;
  p.w = w.get();
  p.ldw = k;
  p.d = d.get();
  p.ldd = n;
  p.accumulate = accumulate;
  p.m = m;
  p.n = n;
  p.k = k;
  p.group_offsets = static_cast<const int32_t*>(offsets_dev.get());
  p.groups = groups;
  // A bound, as serving passes it (the tokens), not the exact largest group.
  p.max_group_rows = std::min<int64_t>(m, std::max<int64_t>(max_rows, max_rows <= 64 ? 64 : max_rows));
  GemmWorkspace no_workspace;
  const absl::Status st =
      v.route ? router_->Run(p, no_workspace, stream_) : router_->RunConfig(p, v.config, no_workspace, stream_);
  ASSERT_TRUE(st.ok()) << st;
  LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  const float scale = std::sqrt(static_cast<float>(k)) / 3.f;  // uniform [-1, 1) inputs
  CompareResult res;
  LS_ASSERT_CUDA_OK(CompareBf16(d.get(), static_cast<float*>(ref.get()), accumulate ? r.get() : nullptr, m * n,
                                1.01f / 256.f, 1e-3f * scale, stream_, &res));
  const int64_t row = res.worst_index / n;
  const int64_t group = std::upper_bound(offsets.begin(), offsets.end(), row) - offsets.begin() - 1;
  std::printf("[%s] %s m=%lld n=%lld k=%lld acc=%d: worst err/allowed %.3g at row %lld (group %lld) bad=%lld\n",
              v.name.c_str(), c.name.c_str(), static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k), accumulate, res.worst_ratio, static_cast<long long>(row),
              static_cast<long long>(group), static_cast<long long>(res.bad_count));
  EXPECT_EQ(res.bad_count, 0) << "worst at row " << row << " (group " << group << "): out " << res.worst_out
                              << " vs ref " << res.worst_ref;
}

TEST_P(GroupedGemmTest, MatchesPerGroupReference) {
  for (const GroupedCase& c : GroupedCases()) {
    Check(c, /*accumulate=*/false);
    if (HasFatalFailure()) return;
  }
  Check(GroupedCases()[2], /*accumulate=*/true);
  Check(GroupedCases()[4], /*accumulate=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Versions, GroupedGemmTest,
    ::testing::Values(GroupedVariant{"route", true, {}},
                      GroupedVariant{"v4_split_auto", false, {GemmVersion::kSmallMSplitK, 0}},
                      GroupedVariant{"v4_split_3", false, {GemmVersion::kSmallMSplitK, 3}},
                      GroupedVariant{"v3_bn256_bm128", false, {GemmVersion::kWarpSpecialized, 0, 256, 128}},
                      GroupedVariant{"v3_bn128_bm128", false, {GemmVersion::kWarpSpecialized, 0, 128, 128}},
                      GroupedVariant{"v3_bn256_bm64", false, {GemmVersion::kWarpSpecialized, 0, 256, 64}},
                      GroupedVariant{"v3_bn128_bm64", false, {GemmVersion::kWarpSpecialized, 0, 128, 64}}),
    [](const ::testing::TestParamInfo<GroupedVariant>& info) { return info.param.name; });

TEST(GroupedGemmSupportTest, RefusesWhatTheKernelsCannotRun) {
  DeviceInfo hopper;
  hopper.cc_major = 9;
  hopper.cc_minor = 0;
  hopper.num_sms = 132;
  GemmParams p;
  p.a = p.w = p.d = reinterpret_cast<void*>(256);
  p.m = 100;
  p.n = p.k = p.lda = p.ldw = p.ldd = 64;
  p.group_offsets = reinterpret_cast<const int32_t*>(256);
  p.groups = 8;
  p.max_group_rows = 100;
  // Grouped products never route to cuBLASLt, whatever the mode.
  EXPECT_EQ(ChooseGemm(p, GemmMode::kCublasLt, {}, hopper).version, GemmVersion::kWarpSpecialized);
  p.max_group_rows = 64;
  EXPECT_EQ(ChooseGemm(p, GemmMode::kAuto, {}, hopper).version, GemmVersion::kSmallMSplitK);
  if (!GemmBuiltWithSm90a()) return;
  EXPECT_TRUE(GemmSupported(p, {GemmVersion::kSmallMSplitK}, hopper).ok());
  EXPECT_FALSE(GemmSupported(p, {GemmVersion::kClusterMulticast}, hopper).ok());
  p.max_group_rows = 65;
  EXPECT_FALSE(GemmSupported(p, {GemmVersion::kSmallMSplitK}, hopper).ok());
  p.groups = kMaxGemmGroups + 1;
  EXPECT_FALSE(GemmSupported(p, {GemmVersion::kWarpSpecialized}, hopper).ok());
  p.groups = 8;
  p.max_group_rows = 101;
  EXPECT_FALSE(GemmSupported(p, {GemmVersion::kWarpSpecialized}, hopper).ok());
  // 64-row tiles are for grouped products only.
  p.max_group_rows = 100;
  EXPECT_TRUE(GemmSupported(p, {GemmVersion::kWarpSpecialized, 0, 256, 64}, hopper).ok());
  p.group_offsets = nullptr;
  EXPECT_FALSE(GemmSupported(p, {GemmVersion::kWarpSpecialized, 0, 256, 64}, hopper).ok());
  EXPECT_TRUE(GemmSupported(p, {GemmVersion::kWarpSpecialized, 0, 256, 128}, hopper).ok());
}

// ---- routing, gather, combine ---------------------------------------------

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<int32_t> ranks;
  std::vector<int32_t> offsets;
};

// x [tokens, hidden] times router [experts, hidden]ᵀ in float64, each logit
// rounded to bf16 as the router's bf16 GEMM rounds it.
std::vector<double> RoundedLogits(const std::vector<double>& x, const std::vector<double>& router, int64_t tokens,
                                  int64_t hidden, int experts) {
  std::vector<double> logits(tokens * experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) {
      double acc = 0;
      for (int64_t i = 0; i < hidden; ++i) acc += x[t * hidden + i] * router[e * hidden + i];
      logits[t * experts + e] = testing::RoundToDType(DType::kBF16, acc);
    }
  }
  return logits;
}

// Runs MoeRoute on bf16 logits [tokens, experts], stored in rows of a
// multiple of 8 (as the server's GEMM writes them) whose padding columns
// hold a logit larger than any real one: routing must never look at them.
Routed Route(const std::vector<double>& logits, int64_t tokens, int experts, int top_k, cudaStream_t stream,
             bool normalize = true) {
  const int64_t stride = (experts + 7) / 8 * 8;
  std::vector<double> padded(tokens * stride, 1e4);
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(logits.begin() + t * experts, experts, padded.begin() + t * stride);
  }
  DeviceBuffer ld(std::max<size_t>(16, padded.size() * 2)), ids(std::max<int64_t>(4, tokens * top_k * 4)),
      weights(std::max<int64_t>(4, tokens * top_k * 4)), ranks(std::max<int64_t>(4, tokens * top_k * 4)),
      offsets((experts + 1) * 4), scratch((experts + 1) * 4);
  if (!padded.empty()) ld.Upload(testing::Encode(DType::kBF16, padded).data(), padded.size() * 2);
  for (DeviceBuffer* b : {&ids, &weights, &ranks, &offsets, &scratch}) b->Poison();
  MoeRouteParams p;
  p.logits = ld.get();
  p.logits_stride = stride;
  p.tokens = tokens;
  p.experts = experts;
  p.top_k = top_k;
  p.normalize = normalize;
  p.expert_ids = static_cast<int32_t*>(ids.get());
  p.weights = static_cast<float*>(weights.get());
  p.ranks = static_cast<int32_t*>(ranks.get());
  p.offsets = static_cast<int32_t*>(offsets.get());
  p.scratch = static_cast<int32_t*>(scratch.get());
  const absl::Status st = LaunchMoeRoute(p, stream);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  Routed out{std::vector<int32_t>(tokens * top_k), std::vector<float>(tokens * top_k),
             std::vector<int32_t>(tokens * top_k), std::vector<int32_t>(experts + 1)};
  ids.Download(out.ids.data(), out.ids.size() * 4);
  weights.Download(out.weights.data(), out.weights.size() * 4);
  ranks.Download(out.ranks.data(), out.ranks.size() * 4);
  offsets.Download(out.offsets.data(), out.offsets.size() * 4);
  return out;
}

// The routing's bookkeeping: offsets are the exclusive scan of the choices
// per expert, and each expert's ranks are exactly 0..count-1.
void ExpectConsistent(const Routed& r, int experts) {
  std::vector<std::vector<int32_t>> ranks(experts);
  for (size_t c = 0; c < r.ids.size(); ++c) {
    ASSERT_TRUE(r.ids[c] >= 0 && r.ids[c] < experts) << "choice " << c << ": expert " << r.ids[c];
    ranks[r.ids[c]].push_back(r.ranks[c]);
  }
  int32_t running = 0;
  for (int e = 0; e < experts; ++e) {
    EXPECT_EQ(r.offsets[e], running) << "expert " << e;
    std::sort(ranks[e].begin(), ranks[e].end());
    for (size_t i = 0; i < ranks[e].size(); ++i) ASSERT_EQ(ranks[e][i], static_cast<int32_t>(i)) << "expert " << e;
    running += static_cast<int32_t>(ranks[e].size());
  }
  EXPECT_EQ(r.offsets[experts], running);
}

class MoeKernelsTest : public testing::GpuTest {
 protected:
  void SetUp() override {
    testing::GpuTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// Weights renormalised over the chosen experts (Mixtral, norm_topk_prob) or
// the raw probabilities (Qwen2-MoE's default).
TEST_F(MoeKernelsTest, RouteMatchesFloat64Softmax) {
  for (const auto& [tokens, hidden, experts, top_k, normalize] :
       {std::tuple<int64_t, int64_t, int, int, bool>{1, 4096, 8, 2, true},
        {37, 256, 8, 2, true},
        {300, 512, 16, 4, true},
        {9, 64, 60, 1, true},
        {1, 2048, 60, 4, false},
        {300, 512, 16, 4, false},
        {1, 2048, 128, 8, true},
        {333, 2048, 128, 8, true},
        {40, 256, 256, 16, false}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, hidden " << hidden << ", " << experts << " experts, top "
                                      << top_k << (normalize ? ", renormalised" : ", raw weights"));
    const std::vector<double> x = testing::RandomValues(DType::kBF16, tokens * hidden, -1, 1, 1 + tokens);
    const double s = 4.0 / std::sqrt(static_cast<double>(hidden));
    const std::vector<double> router = testing::RandomValues(DType::kBF16, experts * hidden, -s, s, 2 + tokens);
    const std::vector<double> logits = RoundedLogits(x, router, tokens, hidden, experts);
    const Routed got = Route(logits, tokens, experts, top_k, stream_, normalize);
    ExpectConsistent(got, experts);
    int64_t checked = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> p(logits.begin() + t * experts, logits.begin() + (t + 1) * experts);
      const double max_logit = *std::max_element(p.begin(), p.end());
      double sum = 0;
      for (double& v : p) sum += v = std::exp(v - max_logit);
      for (double& v : p) v /= sum;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      double chosen = 0;
      for (int j = 0; j < top_k; ++j) chosen += p[order[j]];
      if (!normalize) chosen = 1;
      // Where fp32 arithmetic could reorder nearly equal experts (or bf16
      // logits tie), only the set's validity is checked below.
      const bool clear = top_k == experts || p[order[top_k - 1]] - p[order[top_k]] > 1e-4;
      for (int j = 0; j < top_k; ++j) {
        const int32_t id = got.ids[t * top_k + j];
        ASSERT_TRUE(id >= 0 && id < experts) << "token " << t << " choice " << j << ": expert " << id;
        if (!clear) continue;
        EXPECT_EQ(id, order[j]) << "token " << t << " choice " << j;
        EXPECT_NEAR(got.weights[t * top_k + j], p[order[j]] / chosen, 1e-5) << "token " << t << " choice " << j;
      }
      checked += clear;
    }
    EXPECT_GE(checked, tokens * 3 / 4) << "too few clearly routed tokens to mean anything";
  }
}

// The shared expert's gate: each activation row times sigmoid(x · gate),
// against float64 with the kernel's three bf16 roundings (logit, sigmoid,
// product) allowed for.
TEST_F(MoeKernelsTest, SharedGateScalesEachRowBySigmoid) {
  for (const auto& [tokens, hidden, width] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 2048, 5632}, {37, 256, 520}, {300, 512, 64}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, hidden " << hidden << ", width " << width);
    const std::vector<double> x = testing::RandomValues(DType::kBF16, tokens * hidden, -1, 1, 21 + tokens);
    const double s = 3.0 / std::sqrt(static_cast<double>(hidden));
    const std::vector<double> gate = testing::RandomValues(DType::kBF16, hidden, -s, s, 22);
    const std::vector<double> act = testing::RandomValues(DType::kBF16, tokens * width, -4, 4, 23 + tokens);
    DeviceBuffer x_d(x.size() * 2), gate_d(gate.size() * 2), act_d(act.size() * 2);
    x_d.Upload(testing::Encode(DType::kBF16, x).data(), x.size() * 2);
    gate_d.Upload(testing::Encode(DType::kBF16, gate).data(), gate.size() * 2);
    act_d.Upload(testing::Encode(DType::kBF16, act).data(), act.size() * 2);
    MoeSharedGateParams p;
    p.x = x_d.get();
    p.gate = gate_d.get();
    p.activation = act_d.get();
    p.tokens = tokens;
    p.hidden = hidden;
    p.width = width;
    ASSERT_TRUE(LaunchMoeSharedGate(p, stream_).ok());
    LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> out_bytes(act.size() * 2);
    act_d.Download(out_bytes.data(), out_bytes.size());
    const std::vector<double> got = testing::Decode(DType::kBF16, out_bytes);
    std::vector<double> want(act.size());
    for (int64_t t = 0; t < tokens; ++t) {
      double logit = 0;
      for (int64_t i = 0; i < hidden; ++i) logit += x[t * hidden + i] * gate[i];
      const double scale = 1 / (1 + std::exp(-logit));
      for (int64_t i = 0; i < width; ++i) want[t * width + i] = act[t * width + i] * scale;
    }
    // The product's and the sigmoid's roundings (2^-9 relative each), and the
    // logit's (2^-9 |z| relative, |z| < 5 here, scaled by 1 - sigmoid(z)).
    EXPECT_TRUE(testing::AllClose(got, want, 1e-6, 4.0 / 256));
  }
  MoeSharedGateParams bad;
  bad.tokens = 1;
  bad.hidden = 12;
  bad.width = 8;
  EXPECT_FALSE(LaunchMoeSharedGate(bad, stream_).ok());
}

// An FP8 shared expert gate (W8A8): x read as e4m3 codes times their scales,
// per token or per token and 128 columns (scales 4x apart, so a misread one
// fails), against float64 over the same codes, scales and float32 gate. The
// gate is small enough that |logit| stays under ~5, where the bf16 roundings
// the bound allows for hold (as in the test above).
TEST_F(MoeKernelsTest, Fp8SharedGateReadsCodesAndScales) {
  for (const int64_t group : {int64_t{0}, int64_t{128}}) {
    const int64_t tokens = 37, hidden = 512, width = 64;
    SCOPED_TRACE(::testing::Message() << "group " << group);
    const int64_t groups = group > 0 ? hidden / group : 1;
    std::vector<uint8_t> codes(static_cast<size_t>(tokens * hidden));
    std::vector<float> scales(static_cast<size_t>(tokens * groups)), gate(static_cast<size_t>(hidden));
    const std::vector<double> u = testing::RandomValues(DType::kF32, codes.size(), -1, 1, 31);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = FloatToFp8E4M3(static_cast<float>(u[i] * 448));
    const std::vector<double> su = testing::RandomValues(DType::kF32, scales.size(), -2, 2, 32);
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = std::exp2(static_cast<float>(su[i] / 2)) / 448.f;
    const std::vector<double> gu = testing::RandomValues(DType::kF32, gate.size(), -1, 1, 33);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = static_cast<float>(gu[i] / std::sqrt(hidden));
    const std::vector<double> act = testing::RandomValues(DType::kBF16, tokens * width, -4, 4, 34);
    DeviceBuffer codes_d(codes.size()), scales_d(scales.size() * 4), gate_d(gate.size() * 4), act_d(act.size() * 2),
        x_d(codes.size() * 2);
    codes_d.Upload(codes.data(), codes.size());
    scales_d.Upload(scales.data(), scales.size() * 4);
    gate_d.Upload(gate.data(), gate.size() * 4);
    act_d.Upload(testing::Encode(DType::kBF16, act).data(), act.size() * 2);
    x_d.Poison();  // the bf16 input is never read
    MoeSharedGateParams p;
    p.x = x_d.get();
    p.gate = gate_d.get();
    p.activation = act_d.get();
    p.tokens = tokens;
    p.hidden = hidden;
    p.width = width;
    p.x_codes = codes_d.get();
    p.x_scales = static_cast<const float*>(scales_d.get());
    p.x_group = group;
    ASSERT_TRUE(LaunchMoeSharedGate(p, stream_).ok());
    LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> out_bytes(act.size() * 2);
    act_d.Download(out_bytes.data(), out_bytes.size());
    const std::vector<double> got = testing::Decode(DType::kBF16, out_bytes);
    std::vector<double> want(act.size());
    for (int64_t t = 0; t < tokens; ++t) {
      double logit = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        const double s = group > 0 ? scales[static_cast<size_t>((i / group) * tokens + t)] : scales[t];
        logit += Fp8E4M3ToFloat(codes[static_cast<size_t>(t * hidden + i)]) * s * gate[static_cast<size_t>(i)];
      }
      const double scale = 1 / (1 + std::exp(-logit));
      for (int64_t i = 0; i < width; ++i) want[t * width + i] = act[t * width + i] * scale;
    }
    EXPECT_TRUE(testing::AllClose(got, want, 1e-6, 4.0 / 256));
  }
  MoeSharedGateParams bad;
  bad.tokens = 1;
  bad.hidden = 128;
  bad.width = 8;
  void* const placeholder = reinterpret_cast<void*>(uintptr_t{256});
  bad.x = bad.gate = bad.x_codes = placeholder;
  bad.activation = placeholder;
  bad.x_group = 64;  // no scales and another group
  EXPECT_EQ(LaunchMoeSharedGate(bad, stream_).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(MoeKernelsTest, RoutePoisonedTokenStaysInBounds) {
  const int64_t tokens = 3, hidden = 64;
  const int experts = 8, top_k = 2;
  std::vector<double> x = testing::RandomValues(DType::kBF16, tokens * hidden, -1, 1, 5);
  x[hidden + 7] = std::nan("");
  const std::vector<double> router = testing::RandomValues(DType::kBF16, experts * hidden, -0.5, 0.5, 6);
  const Routed got = Route(RoundedLogits(x, router, tokens, hidden, experts), tokens, experts, top_k, stream_);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      const int32_t id = got.ids[t * top_k + j];
      EXPECT_TRUE(id >= 0 && id < experts) << "token " << t << ": expert " << id;
    }
    EXPECT_NE(got.ids[t * top_k], got.ids[t * top_k + 1]) << "token " << t;
  }
  EXPECT_TRUE(std::isfinite(got.weights[0]) && std::isfinite(got.weights[4])) << "a clean token got NaN weights";
  ExpectConsistent(got, experts);
}

// More blocks than one (the last block's offsets), and no token at all.
TEST_F(MoeKernelsTest, RouteOffsetsOverManyBlocksAndNone) {
  for (const int64_t tokens : {int64_t{0}, int64_t{5000}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens");
    const int64_t hidden = 64;
    const int experts = 16, top_k = 3;
    const std::vector<double> x = testing::RandomValues(DType::kBF16, tokens * hidden, -1, 1, 11);
    const std::vector<double> router = testing::RandomValues(DType::kBF16, experts * hidden, -0.5, 0.5, 12);
    const Routed got = Route(RoundedLogits(x, router, tokens, hidden, experts), tokens, experts, top_k, stream_);
    ExpectConsistent(got, experts);
    EXPECT_EQ(got.offsets[experts], tokens * top_k);
  }
}

TEST_F(MoeKernelsTest, GatherPutsRowsInExpertOrderAndCombineSumsThemBack) {
  for (const auto& [tokens, experts, top_k] : {std::tuple<int64_t, int, int>{1, 8, 2}, {200, 8, 2}, {77, 32, 3}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, " << experts << " experts, top " << top_k);
    const int64_t hidden = 256;
    const int64_t choices = tokens * top_k;
    // Distinct experts per token, skewed towards the low ones; ranks in
    // reverse arrival order (any order within an expert is valid).
    std::vector<int32_t> ids(choices), ranks(choices);
    std::vector<int32_t> counts(experts, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int j = 0; j < top_k; ++j) ids[t * top_k + j] = static_cast<int32_t>((t * t + 5 * j) % (experts / 2) + j);
    }
    for (int64_t c = choices - 1; c >= 0; --c) ranks[c] = counts[ids[c]]++;
    std::vector<int32_t> offsets(experts + 1, 0);
    std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
    const std::vector<double> x = testing::RandomValues(DType::kBF16, tokens * hidden, -2, 2, 7 + tokens);
    DeviceBuffer ids_d(choices * 4), ranks_d(choices * 4), offsets_d((experts + 1) * 4), x_d(x.size() * 2),
        permuted_d(choices * hidden * 2);
    ids_d.Upload(ids.data(), choices * 4);
    ranks_d.Upload(ranks.data(), choices * 4);
    offsets_d.Upload(offsets.data(), offsets.size() * 4);
    x_d.Upload(testing::Encode(DType::kBF16, x).data(), x.size() * 2);
    permuted_d.Poison();
    MoeChoices choice_set;
    choice_set.expert_ids = static_cast<const int32_t*>(ids_d.get());
    choice_set.ranks = static_cast<const int32_t*>(ranks_d.get());
    choice_set.offsets = static_cast<const int32_t*>(offsets_d.get());
    choice_set.tokens = tokens;
    choice_set.top_k = top_k;
    MoeGatherParams gp;
    gp.choices = choice_set;
    gp.x = x_d.get();
    gp.hidden = hidden;
    gp.permuted = permuted_d.get();
    ASSERT_TRUE(LaunchMoeGather(gp, stream_).ok());
    LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> permuted_bytes(choices * hidden * 2);
    permuted_d.Download(permuted_bytes.data(), permuted_bytes.size());
    const std::vector<double> permuted = testing::Decode(DType::kBF16, permuted_bytes);
    std::vector<int64_t> row_of(choices);
    for (int64_t c = 0; c < choices; ++c) {
      row_of[c] = offsets[ids[c]] + ranks[c];
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(permuted[row_of[c] * hidden + i], x[(c / top_k) * hidden + i]) << "choice " << c << " element " << i;
      }
    }

    // Combine: the experts' outputs y (random, in expert order) weighted
    // back onto a residual.
    const std::vector<double> y = testing::RandomValues(DType::kBF16, choices * hidden, -3, 3, 8 + tokens);
    const std::vector<double> residual = testing::RandomValues(DType::kBF16, tokens * hidden, -3, 3, 9 + tokens);
    std::vector<float> weights(choices);
    for (int64_t c = 0; c < choices; ++c) weights[c] = 0.1f + 0.8f * static_cast<float>((c * 37) % 11) / 11.f;
    DeviceBuffer y_d(y.size() * 2), w_d(choices * 4), out_d(residual.size() * 2);
    y_d.Upload(testing::Encode(DType::kBF16, y).data(), y.size() * 2);
    w_d.Upload(weights.data(), choices * 4);
    out_d.Upload(testing::Encode(DType::kBF16, residual).data(), residual.size() * 2);
    MoeCombineParams cp;
    cp.choices = choice_set;
    cp.y = y_d.get();
    cp.weights = static_cast<const float*>(w_d.get());
    cp.x = out_d.get();
    cp.hidden = hidden;
    ASSERT_TRUE(LaunchMoeCombine(cp, stream_).ok());
    LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> out_bytes(residual.size() * 2);
    out_d.Download(out_bytes.data(), out_bytes.size());
    std::vector<double> want(residual);
    for (int64_t c = 0; c < choices; ++c) {
      const int64_t t = c / top_k;
      for (int64_t i = 0; i < hidden; ++i) want[t * hidden + i] += weights[c] * y[row_of[c] * hidden + i];
    }
    // One bf16 rounding of an fp32 sum.
    EXPECT_TRUE(testing::AllClose(testing::Decode(DType::kBF16, out_bytes), want, 1e-6, 1.01 / 256));
  }
}

TEST_F(MoeKernelsTest, Fp8GatherMovesCodesAndScalesWithTheirRows) {
  for (const auto& [tokens, group] : {std::pair<int64_t, int64_t>{1, 0}, {77, 0}, {1, 128}, {77, 128}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, group " << group);
    const int64_t hidden = 384;  // three groups of 128
    const int experts = 32, top_k = 3;
    const int64_t choices = tokens * top_k;
    const int64_t groups = group == 0 ? 1 : hidden / group;
    std::vector<int32_t> ids(choices), ranks(choices), counts(experts, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int j = 0; j < top_k; ++j) ids[t * top_k + j] = static_cast<int32_t>((3 * t + 7 * j) % (experts / 2) + j);
    }
    for (int64_t c = choices - 1; c >= 0; --c) ranks[c] = counts[ids[c]]++;
    std::vector<int32_t> offsets(experts + 1, 0);
    std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
    std::mt19937 rng(static_cast<unsigned>(tokens + group));
    std::vector<uint8_t> codes(tokens * hidden);
    for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
    std::vector<float> scales(groups * tokens);
    for (float& s : scales) s = std::uniform_real_distribution<float>(0.001f, 2.f)(rng);
    DeviceBuffer ids_d(choices * 4), ranks_d(choices * 4), offsets_d((experts + 1) * 4), codes_d(codes.size()),
        scales_d(scales.size() * 4), permuted_codes_d(choices * hidden), permuted_scales_d(groups * choices * 4);
    ids_d.Upload(ids.data(), choices * 4);
    ranks_d.Upload(ranks.data(), choices * 4);
    offsets_d.Upload(offsets.data(), offsets.size() * 4);
    codes_d.Upload(codes.data(), codes.size());
    scales_d.Upload(scales.data(), scales.size() * 4);
    permuted_codes_d.Poison();
    permuted_scales_d.Poison();
    MoeGatherParams gp;
    gp.choices = MoeChoices{.expert_ids = static_cast<const int32_t*>(ids_d.get()),
                            .ranks = static_cast<const int32_t*>(ranks_d.get()),
                            .offsets = static_cast<const int32_t*>(offsets_d.get()),
                            .tokens = tokens,
                            .top_k = top_k};
    gp.hidden = hidden;
    gp.fp8_codes = codes_d.get();
    gp.fp8_scales = static_cast<const float*>(scales_d.get());
    gp.fp8_group = group;
    gp.permuted_codes = permuted_codes_d.get();
    gp.permuted_scales = static_cast<float*>(permuted_scales_d.get());
    ASSERT_TRUE(LaunchMoeGather(gp, stream_).ok());
    LS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> got_codes(choices * hidden);
    std::vector<float> got_scales(groups * choices);
    permuted_codes_d.Download(got_codes.data(), got_codes.size());
    permuted_scales_d.Download(got_scales.data(), got_scales.size() * 4);
    for (int64_t c = 0; c < choices; ++c) {
      const int64_t row = offsets[ids[c]] + ranks[c], t = c / top_k;
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(got_codes[row * hidden + i], codes[t * hidden + i]) << "choice " << c << " code " << i;
      }
      for (int64_t g = 0; g < groups; ++g) {
        ASSERT_EQ(got_scales[g * choices + row], scales[g * tokens + t]) << "choice " << c << " group " << g;
      }
    }
  }
  MoeGatherParams bad;
  bad.choices.expert_ids = bad.choices.ranks = bad.choices.offsets = reinterpret_cast<const int32_t*>(16);
  bad.choices.tokens = 1;
  bad.choices.top_k = 1;
  bad.hidden = 200;  // not a multiple of 128
  bad.fp8_codes = bad.permuted_codes = reinterpret_cast<void*>(16);
  bad.fp8_scales = bad.permuted_scales = reinterpret_cast<float*>(16);
  bad.fp8_group = 128;
  EXPECT_EQ(LaunchMoeGather(bad, stream_).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layerserve::kernels
