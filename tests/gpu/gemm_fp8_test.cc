// GPU tests of the FP8 path: activation quantization (LaunchQuantizeFp8)
// and version 6, the FP8 GEMM, through the router as serving calls them.
//
// Quantization: codes bit for bit and scales exactly equal to the host's
// (base/dtype.h's FloatToFp8E4M3, itself checked bit for bit against
// ml_dtypes), per row, per 128-column group (with a partial last group), with
// a static scale, and with an all-zero row.
//
// GEMM: random bf16 activations with a different magnitude per token (so a
// scale applied to the wrong token is visible), quantized on the GPU, against
// a float64 reference over the same codes and scales, with the format's
// scaling: per row (both scales after the sum) or block-128 (each 128-wide K
// block's partial sum scaled by its own scales). Weights are quantized on the
// host with block scales that differ from block to block, so a transposed or
// misplaced block scale fails. Shapes cover 1..200 tokens (every token tile),
// partial W tiles and a partial last K block, explicit K splits, the residual
// add and the gated epilogue, and grouped products (a mixture of experts:
// each group's rows by its own W and scales, empty groups among them) on
// both kernels, and the bias epilogue. Outputs are poisoned first. The tolerance is
// bf16 output rounding plus the tensor cores' FP8 accumulation inside one K
// block; the worst element is printed. Skips without a Hopper GPU and sm_90a
// build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/layer_ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using testing::DeviceBuffer;

// Host quantization of rows x cols values, as LaunchQuantizeFp8 promises.
struct HostQuantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
HostQuantized QuantizeOnHost(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t group,
                             float static_scale) {
  const int64_t width = group > 0 ? group : cols;
  const int64_t groups = (cols + width - 1) / width;
  HostQuantized q;
  q.codes.resize(static_cast<size_t>(rows * cols));
  q.scales.resize(static_cast<size_t>(rows * groups));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t end = std::min(cols, (g + 1) * width);
      float s = static_scale;
      if (!(s > 0)) {
        float amax = 0;
        for (int64_t c = g * width; c < end; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
        s = amax / kFp8E4M3Max;
      }
      q.scales[group > 0 ? g * rows + r : r] = s;
      for (int64_t c = g * width; c < end; ++c) {
        q.codes[r * cols + c] = s == 0 ? 0 : FloatToFp8E4M3(x[r * cols + c] / s);
      }
    }
  }
  return q;
}

// Activations: bf16 values whose magnitude differs per token (0.05 to 20).
std::vector<uint16_t> RandomActivations(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> bits(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = std::exp2(std::uniform_real_distribution<float>(-4.3f, 4.3f)(rng));
    for (int64_t c = 0; c < cols; ++c) {
      // An outlier now and then, as real activations have.
      const float v = u(rng) * magnitude * (c % 97 == 13 ? 8.f : 1.f);
      bits[r * cols + c] = FloatToBf16(v);
    }
  }
  return bits;
}

std::vector<float> ToFloat(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = Bf16ToFloat(bits[i]);
  return out;
}

class QuantizeFp8Test : public testing::GpuTest {};

TEST_F(QuantizeFp8Test, CodesAndScalesEqualTheHostsBitForBit) {
  struct Case {
    int64_t rows;
    int64_t cols;
    int64_t group;
    float static_scale;
  };
  // 1 040 columns: 8 full groups of 128 and one of 16. Per row, the widths
  // of each form of the row kernel: one CTA a row (4 096), a cluster of 4
  // (14 336) or 7 (28 672) with two vectors a thread, 8 with four (65 536),
  // and past what a cluster holds (65 552: one CTA, two passes); a decode
  // step's one row, and many.
  std::vector<Case> cases = {
      {37, 1040, 0, 0.f}, {37, 1040, 128, 0.f}, {37, 1040, 0, 0.037f}, {1, 14336, 128, 0.f}, {37, 14336, 0, 0.037f}};
  for (const int64_t rows : {1, 37}) {
    for (const int64_t cols : {4096, 14336, 28672, 65536, 65552}) cases.push_back({rows, cols, 0, 0.f});
  }
  for (const Case c : cases) {
    const int64_t rows = c.rows, cols = c.cols;
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " group " << c.group << " static " << c.static_scale);
    std::vector<uint16_t> x_bits = RandomActivations(rows, cols, 7 + c.group + cols);
    if (rows > 5) std::fill(x_bits.begin() + 5 * cols, x_bits.begin() + 6 * cols, 0);  // an all-zero row
    const std::vector<float> x = ToFloat(x_bits);
    const HostQuantized want = QuantizeOnHost(x, rows, cols, c.group, c.static_scale);
    DeviceBuffer x_dev(x_bits.size() * 2), codes(want.codes.size()), scales(want.scales.size() * 4);
    ASSERT_FALSE(HasFailure());
    x_dev.Upload(x_bits.data(), x_bits.size() * 2);
    codes.Poison();
    scales.Poison();
    QuantizeFp8Params p;
    p.x = x_dev.get();
    p.codes = codes.get();
    p.scales = static_cast<float*>(scales.get());
    p.rows = rows;
    p.cols = cols;
    p.group = c.group;
    p.static_scale = c.static_scale;
    ASSERT_TRUE(LaunchQuantizeFp8(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got_codes(want.codes.size());
    std::vector<float> got_scales(want.scales.size());
    codes.Download(got_codes.data(), got_codes.size());
    scales.Download(got_scales.data(), got_scales.size() * 4);
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < got_codes.size(); ++i) {
      if (got_codes[i] != want.codes[i] && bad++ == 0) first = static_cast<int64_t>(i);
    }
    EXPECT_EQ(bad, 0) << "first differing code at row " << first / cols << " col " << first % cols << ": got 0x"
                      << std::hex << int{got_codes[std::max<int64_t>(first, 0)]} << " want 0x"
                      << int{want.codes[std::max<int64_t>(first, 0)]};
    for (size_t i = 0; i < got_scales.size(); ++i) {
      ASSERT_EQ(got_scales[i], want.scales[i]) << "scale " << i;
    }
  }
}

TEST_F(QuantizeFp8Test, RefusesWhatItCannotTake) {
  QuantizeFp8Params p;
  DeviceBuffer buf(4096);
  p.x = p.codes = buf.get();
  p.scales = static_cast<float*>(buf.get());
  p.rows = 1;
  p.cols = 24;
  EXPECT_EQ(LaunchQuantizeFp8(p, nullptr).code(), absl::StatusCode::kInvalidArgument);  // cols % 16
  p.cols = 32;
  p.group = 64;
  EXPECT_EQ(LaunchQuantizeFp8(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.group = 128;
  p.static_scale = 1.f;
  EXPECT_EQ(LaunchQuantizeFp8(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// Ties and the quotient's short form (kernels/common/e4m3.cuh): groups whose
// scale amax / 448 is exactly 2^e (1, 1.25, 1.5 or 1.75), e from -100 to
// 110 (past both ends of the short form's range), holding values whose
// quotient is exactly the midpoint between two e4m3 codes (round to even
// decides), and values anywhere in [-amax, amax]. Per 128 columns and per
// row (one group a row): codes equal the host's division bit for bit.
TEST_F(QuantizeFp8Test, TiesAndEveryScaleRangeEqualTheHostsDivision) {
  std::vector<float> midpoints;  // between consecutive positive codes, 0 .. 448
  for (int code = 0; code < 0x7e; ++code) {
    midpoints.push_back((Fp8E4M3ToFloat(static_cast<uint8_t>(code)) + Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1))) /
                        2);
  }
  constexpr int64_t kCols = 128;
  const int64_t rows = 2048;
  std::mt19937_64 rng(2026);
  std::vector<uint16_t> x_bits(static_cast<size_t>(rows * kCols));
  for (int64_t r = 0; r < rows; ++r) {
    const int e = -100 + static_cast<int>(r % 211);
    const float mantissa = 1.f + 0.25f * static_cast<float>(rng() % 4);
    const float s = std::ldexp(mantissa, e);
    const float amax = s * 448.f;  // exact: 448 s has at most 6 significant bits
    for (int64_t c = 0; c < kCols; ++c) {
      float v;
      if (c == 0) {
        v = amax;
      } else if (c % 2 == 1) {
        v = midpoints[rng() % midpoints.size()] * s;
      } else {
        v = std::uniform_real_distribution<float>(-1.f, 1.f)(rng) * amax;
      }
      if (rng() % 2 == 0) v = -v;
      x_bits[static_cast<size_t>(r * kCols + c)] = FloatToBf16(v);
    }
  }
  const std::vector<float> x = ToFloat(x_bits);
  for (const int64_t group : {int64_t{128}, int64_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "group " << group);
    const HostQuantized want = QuantizeOnHost(x, rows, kCols, group, 0.f);
    DeviceBuffer x_dev(x_bits.size() * 2), codes(want.codes.size()), scales(want.scales.size() * 4);
    ASSERT_FALSE(HasFailure());
    x_dev.Upload(x_bits.data(), x_bits.size() * 2);
    codes.Poison();
    QuantizeFp8Params p;
    p.x = x_dev.get();
    p.codes = codes.get();
    p.scales = static_cast<float*>(scales.get());
    p.rows = rows;
    p.cols = kCols;
    p.group = group;
    ASSERT_TRUE(LaunchQuantizeFp8(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got(want.codes.size());
    codes.Download(got.data(), got.size());
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want.codes[i] && bad++ == 0) first = static_cast<int64_t>(i);
    }
    EXPECT_EQ(bad, 0) << bad << " codes differ; first at row " << first / kCols << " (scale 2^"
                      << -100 + first / kCols % 211 << ") col " << first % kCols << ": x "
                      << x[static_cast<size_t>(std::max<int64_t>(first, 0))] << " got 0x" << std::hex
                      << int{got[std::max<int64_t>(first, 0)]} << " want 0x"
                      << int{want.codes[std::max<int64_t>(first, 0)]};
  }
}

struct Fp8Case {
  std::string name;
  Fp8Scaling scaling;
  int64_t m, n, k;
  int split_k = 0;  // 0: the heuristic
  bool residual = false;
  bool silu_mul = false;
  // A grouped product: each group's rows (m is their sum), and the bound on
  // any group's rows the call passes (0: the largest group's).
  std::vector<int64_t> group_rows = {};
  int64_t max_group_rows = 0;
  // Through cuBLASLt's FP8 (version 0) instead of version 6; a block-scaled
  // weight then has 128-row scale blocks (w_scale_128).
  bool cublaslt = false;
  // A bias (q/k/v's in Qwen2), added by version 6's epilogue.
  bool bias = false;
};

std::string CaseName(const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; }

std::vector<Fp8Case> Cases() {
  std::vector<Fp8Case> cases;
  for (const Fp8Scaling s : {Fp8Scaling::kPerRow, Fp8Scaling::kBlock}) {
    const std::string tag = s == Fp8Scaling::kBlock ? "block" : "row";
    // n = 400: a partial 128-row tile (and a partial 64-row scale group);
    // k = 1040: a partial last K block. Every token tile: 8, 16, 32, 64, 128.
    for (const int64_t m : {1, 7, 16, 33, 64, 65, 200}) {
      cases.push_back({tag + "_m" + std::to_string(m), s, m, 400, 1040});
    }
    cases.push_back({tag + "_s1_m8", s, 8, 1024, 512, 1});
    cases.push_back({tag + "_s3_m24", s, 24, 1024, 1024, 3});
    cases.push_back({tag + "_s8_m40", s, 40, 256, 2048, 8});
    cases.push_back({tag + "_s4_m2", s, 2, 256, 4096, 4});
    cases.push_back({tag + "_residual_m5", s, 5, 384, 1024, 0, true});
    cases.push_back({tag + "_residual_m150", s, 150, 384, 1024, 0, true});
    cases.push_back({tag + "_silu_m3", s, 3, 512, 1024, 0, false, true});
    cases.push_back({tag + "_silu_m100", s, 100, 768, 640, 0, false, true});
    // The prefill kernel over more tiles than CTAs (9 x 17 tiles of 128),
    // with the residual over 3 x 5 tiles, and gated over 3 x 9 (a last tile
    // of 44 rows).
    cases.push_back({tag + "_prefill_m1100", s, 1100, 2176, 256});
    cases.push_back({tag + "_prefill_residual_m333", s, 333, 640, 1040, 0, true});
    cases.push_back({tag + "_prefill_silu_m300", s, 300, 1152, 512, 0, false, true});
    // The bias epilogue: the decode kernel (with K splits) and the prefill
    // kernel, partial W tiles, and with the residual.
    for (const int64_t m : {3, 100}) {
      Fp8Case c{tag + "_bias_m" + std::to_string(m), s, m, 400, 1040};
      c.bias = true;
      cases.push_back(c);
    }
    {
      Fp8Case c{tag + "_bias_residual_s2_m9", s, 9, 256, 2048, 2, true};
      c.bias = true;
      cases.push_back(c);
    }
    // Llama-3-8B's o projection at decode (4 splits) and its gate/up.
    cases.push_back({tag + "_llama_o_m4", s, 4, 4096, 4096});
    cases.push_back({tag + "_llama_gate_up_m4", s, 4, 28672, 4096, 0, false, true});
    // Grouped: the decode kernel with one token tile a group, with two (a
    // group past 64 rows), and the prefill kernel's schedule (a bound past
    // 128); the gated epilogue as the experts' gate/up runs it.
    cases.push_back({tag + "_grouped_decode", s, 0, 400, 1040, 0, false, false, {3, 0, 1, 17, 0, 64, 2, 9}, 64});
    cases.push_back({tag + "_grouped_decode_2tiles", s, 0, 256, 1024, 0, false, false, {70, 0, 5, 128, 33}, 128});
    cases.push_back({tag + "_grouped_prefill", s, 0, 400, 1040, 0, false, false, {200, 0, 1, 130, 7}, 200});
    cases.push_back({tag + "_grouped_silu_decode", s, 0, 768, 640, 0, false, true, {5, 0, 12, 1}, 16});
    cases.push_back({tag + "_grouped_silu_prefill", s, 0, 768, 640, 0, false, true, {150, 3, 0, 140}, 150});
    cases.push_back({tag + "_grouped_residual", s, 0, 384, 1024, 0, true, false, {4, 0, 9}, 9});
    // cuBLASLt's FP8, the route the router can take instead: small and large
    // M, a partial 128-row block, the residual and the gate (its plain
    // product through the scratch buffer, then the SiLU kernel over the FP8
    // interleave).
    // (Block-scaled: m a multiple of 4, CublasLtTakesFp8's condition.)
    const bool row = s == Fp8Scaling::kPerRow;
    for (const int64_t m : {row ? 1 : 4, row ? 7 : 8, row ? 33 : 36, 200}) {
      cases.push_back({tag + "_cublaslt_m" + std::to_string(m), s, m, 384, 1024, 0, false, false, {}, 0, true});
    }
    cases.push_back({tag + "_cublaslt_n400_m20", s, 20, 400, 1024, 0, false, false, {}, 0, true});
    cases.push_back({tag + "_cublaslt_residual_m" + std::to_string(row ? 5 : 4),
                     s,
                     row ? 5 : 4,
                     384,
                     1024,
                     0,
                     true,
                     false,
                     {},
                     0,
                     true});
    cases.push_back({tag + "_cublaslt_residual_m" + std::to_string(row ? 150 : 152),
                     s,
                     row ? 150 : 152,
                     384,
                     1024,
                     0,
                     true,
                     false,
                     {},
                     0,
                     true});
    cases.push_back({tag + "_cublaslt_silu_m" + std::to_string(row ? 3 : 12),
                     s,
                     row ? 3 : 12,
                     768,
                     640,
                     0,
                     false,
                     true,
                     {},
                     0,
                     true});
    cases.push_back({tag + "_cublaslt_silu_m100", s, 100, 768, 640, 0, false, true, {}, 0, true});
  }
  return cases;
}

class Fp8GemmTest : public testing::GpuTestWithParam<Fp8Case> {
 protected:
  void SetUp() override {
    testing::GpuTestWithParam<Fp8Case>::SetUp();
    if (IsSkipped()) return;
    absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    if (!router_->custom_kernels_enabled()) GTEST_SKIP() << "our GEMM kernels cannot run on this device/build";
  }
  std::unique_ptr<GemmRouter> router_;
};

TEST_P(Fp8GemmTest, MatchesTheFloat64ReferenceOfItsCodesAndScales) {
  const Fp8Case& c = GetParam();
  const bool block = c.scaling == Fp8Scaling::kBlock;
  const bool grouped = !c.group_rows.empty();
  const int64_t groups = grouped ? static_cast<int64_t>(c.group_rows.size()) : 1;
  // Each row's group, and the offsets the routing would write.
  std::vector<int32_t> offsets = {0};
  std::vector<int64_t> group_of(grouped ? 0 : static_cast<size_t>(c.m), 0);
  for (int64_t g = 0; g < static_cast<int64_t>(c.group_rows.size()); ++g) {
    offsets.push_back(offsets.back() + static_cast<int32_t>(c.group_rows[g]));
    group_of.insert(group_of.end(), static_cast<size_t>(c.group_rows[g]), g);
  }
  const int64_t m = grouped ? offsets.back() : c.m, n = c.n, k = c.k;
  const int64_t kblocks = (k + kFp8BlockK - 1) / kFp8BlockK;
  const int64_t out_cols = c.silu_mul ? n / 2 : n;
  std::mt19937_64 rng(static_cast<uint64_t>(m * 1009 + n * 13 + k) + (block ? 1 : 0));
  std::uniform_real_distribution<float> u(-1.f, 1.f);

  // Weights (every group's, stacked): e4m3 codes of uniform values, and
  // scales that differ per block (or per row) by up to 16x.
  std::vector<uint8_t> w_codes(static_cast<size_t>(groups * n * k));
  for (auto& code : w_codes) code = FloatToFp8E4M3(u(rng) * 448.f);
  const int64_t scale_rows = block ? (n + kFp8WeightScaleRows - 1) / kFp8WeightScaleRows : n;
  const int64_t scale_cols = block ? kblocks : 1;
  std::vector<float> w_scale(static_cast<size_t>(groups * scale_rows * scale_cols));
  for (auto& s : w_scale) s = std::exp2(std::uniform_real_distribution<float>(-4.f, 0.f)(rng)) / 448.f / std::sqrt(k);
  // cuBLASLt reads 128x128 weight blocks: both 64-row halves of a block
  // carry its scale, laid out as GemmParams::w_scale_128 says.
  std::vector<float> w_scale_128;
  if (c.cublaslt && block) {
    const int64_t padded = kFp8CublasLtScaleCols(k);
    w_scale_128.assign(static_cast<size_t>((n + kFp8BlockK - 1) / kFp8BlockK * padded), 0.f);
    for (int64_t g = 0; g < scale_rows; ++g) {
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        float& scale = w_scale[static_cast<size_t>(g * kblocks + kb)];
        if (g % 2 == 1) scale = w_scale[static_cast<size_t>((g - 1) * kblocks + kb)];
        w_scale_128[static_cast<size_t>(g / 2 * padded + kb)] = scale;
      }
    }
  }
  const auto w_scale_of = [&](int64_t g, int64_t row, int64_t kb) {
    const float* group_scales = w_scale.data() + g * scale_rows * scale_cols;
    return block ? group_scales[(row / kFp8WeightScaleRows) * kblocks + kb] : group_scales[row];
  };

  const std::vector<uint16_t> x_bits = RandomActivations(m, k, rng());
  const HostQuantized a = QuantizeOnHost(ToFloat(x_bits), m, k, block ? kFp8BlockK : 0, 0.f);
  std::vector<uint16_t> residual_bits;
  if (c.residual) residual_bits = RandomActivations(m, n, rng());
  std::vector<uint16_t> bias_bits;
  if (c.bias) bias_bits = RandomActivations(1, n, rng());

  DeviceBuffer x_dev(x_bits.size() * 2), a_codes(static_cast<size_t>(m * k)), a_scale(a.scales.size() * 4),
      w_dev(w_codes.size()), w_scale_dev(w_scale.size() * 4), out(static_cast<size_t>(m * out_cols * 2)),
      workspace(GemmRouter::kDefaultWorkspaceBytes), offsets_dev(offsets.size() * 4),
      w_scale_128_dev(std::max<size_t>(16, w_scale_128.size() * 4)), scratch(static_cast<size_t>(m * n * 2)),
      bias_dev(static_cast<size_t>(n * 2));
  ASSERT_FALSE(HasFailure());
  offsets_dev.Upload(offsets.data(), offsets.size() * 4);
  x_dev.Upload(x_bits.data(), x_bits.size() * 2);
  w_dev.Upload(w_codes.data(), w_codes.size());
  w_scale_dev.Upload(w_scale.data(), w_scale.size() * 4);
  if (!w_scale_128.empty()) w_scale_128_dev.Upload(w_scale_128.data(), w_scale_128.size() * 4);
  out.Poison();
  scratch.Poison();
  if (c.residual) out.Upload(residual_bits.data(), residual_bits.size() * 2);
  if (c.bias) bias_dev.Upload(bias_bits.data(), bias_bits.size() * 2);

  QuantizeFp8Params q;
  q.x = x_dev.get();
  q.codes = a_codes.get();
  q.scales = static_cast<float*>(a_scale.get());
  q.rows = m;
  q.cols = k;
  q.group = block ? kFp8BlockK : 0;
  ASSERT_TRUE(LaunchQuantizeFp8(q, nullptr).ok());

  GemmParams p;
  p.a = a_codes.get();
  p.lda = k;
  p.w = w_dev.get();
  p.ldw = k;
  p.d = out.get();
  p.ldd = out_cols;
  p.m = m;
  p.n = n;
  p.k = k;
  p.accumulate = c.residual;
  p.silu_mul = c.silu_mul;
  p.fp8 = c.scaling;
  p.a_scale = static_cast<const float*>(a_scale.get());
  p.w_scale = static_cast<const float*>(w_scale_dev.get());
  if (c.bias) p.bias = bias_dev.get();
  if (grouped) {
    p.group_offsets = static_cast<const int32_t*>(offsets_dev.get());
    p.groups = static_cast<int>(groups);
    p.max_group_rows =
        c.max_group_rows > 0 ? c.max_group_rows : *std::max_element(c.group_rows.begin(), c.group_rows.end());
  }
  EXPECT_EQ(router_->Route(p).version, GemmVersion::kFp8);
  const GemmWorkspace ws{workspace.get(), workspace.bytes()};
  if (c.cublaslt) {
    if (block) p.w_scale_128 = static_cast<const float*>(w_scale_128_dev.get());
    if (c.silu_mul) p.scratch = scratch.get();
    ASSERT_TRUE(CublasLtTakesFp8(p));
  }
  const absl::Status status = c.cublaslt ? router_->RunConfig(p, GemmConfig{GemmVersion::kCublasLt}, ws, nullptr)
                              : c.split_k > 0
                                  ? router_->RunConfig(p, GemmConfig{GemmVersion::kFp8, c.split_k}, ws, nullptr)
                                  : router_->Run(p, ws, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> got_bits(static_cast<size_t>(m * out_cols));
  out.Download(got_bits.data(), got_bits.size() * 2);

  // The reference product over the codes, in the format's scaling, and the
  // same sum over |a w| (the scale of the accumulation error).
  std::vector<double> product(static_cast<size_t>(m * n)), magnitude(static_cast<size_t>(m * n));
  std::vector<double> a_value(a.codes.size()), w_value(w_codes.size());
  for (size_t i = 0; i < a.codes.size(); ++i) a_value[i] = Fp8E4M3ToFloat(a.codes[i]);
  for (size_t i = 0; i < w_codes.size(); ++i) w_value[i] = Fp8E4M3ToFloat(w_codes[i]);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = group_of[static_cast<size_t>(r)];
    const double* w_group = w_value.data() + g * n * k;
    for (int64_t col = 0; col < n; ++col) {
      double total = 0, total_abs = 0;
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        double partial = 0, partial_abs = 0;
        for (int64_t i = kb * kFp8BlockK; i < std::min(k, (kb + 1) * kFp8BlockK); ++i) {
          partial += a_value[r * k + i] * w_group[col * k + i];
          partial_abs += std::fabs(a_value[r * k + i] * w_group[col * k + i]);
        }
        const double scale = block ? a.scales[kb * m + r] * w_scale_of(g, col, kb) : 1.0;
        total += partial * scale;
        total_abs += partial_abs * scale;
      }
      const double scale = block ? 1.0 : a.scales[r] * w_scale_of(g, col, 0);
      product[r * n + col] = total * scale;
      magnitude[r * n + col] = total_abs * scale;
    }
  }
  std::vector<double> want(static_cast<size_t>(m * out_cols));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < out_cols; ++col) {
      if (c.silu_mul) {
        const double g = product[r * n + Fp8GateUpRow(col, false)];
        const double up = product[r * n + Fp8GateUpRow(col, true)];
        // With the epilogue's roundings (gate, up and silu's result to
        // bf16), as the bf16 kernels' gated test models them.
        const double gr = testing::RoundToDType(DType::kBF16, g);
        const double silu = testing::RoundToDType(DType::kBF16, gr / (1 + std::exp(-gr)));
        want[r * out_cols + col] = silu * testing::RoundToDType(DType::kBF16, up);
      } else {
        want[r * out_cols + col] = product[r * n + col] + (c.bias ? Bf16ToFloat(bias_bits[col]) : 0.0) +
                                   (c.residual ? Bf16ToFloat(residual_bits[r * n + col]) : 0.0);
      }
    }
  }
  // The bound: bf16 rounding of the output (and the gate's roundings, with
  // an ulp more of gate and up where the accumulation error flips one), plus
  // the tensor cores' FP8 accumulation error. That keeps about 14 bits within
  // a K block (FP8.md; DeepSeek-V3's report), so it is bounded by 2^-12 of
  // the sum of |a w| (4x margin), carried through silu(g) * up for the gate.
  std::vector<double> got(want.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = Bf16ToFloat(got_bits[i]);
  constexpr double kAccumulation = 0x1p-12;
  double worst = 0;
  int64_t worst_index = -1, bad = 0;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < out_cols; ++col) {
      const size_t i = static_cast<size_t>(r * out_cols + col);
      double allowed;
      if (c.silu_mul) {
        const int64_t gi = r * n + Fp8GateUpRow(col, false), ui = r * n + Fp8GateUpRow(col, true);
        const double g = product[gi], up = product[ui];
        allowed =
            3.5 * 0x1p-8 * std::fabs(want[i]) +
            kAccumulation * (1.1 * std::fabs(up) * magnitude[gi] + std::fabs(g / (1 + std::exp(-g))) * magnitude[ui]);
      } else {
        allowed = 1.5 * 0x1p-8 * std::fabs(want[i]) + kAccumulation * magnitude[r * n + col];
        // cuBLASLt may round the product to bf16 before adding the residual
        // (gemm.h): half an ulp of the product more.
        if (c.cublaslt && c.residual) allowed += 0x1p-8 * std::fabs(product[r * n + col]);
      }
      allowed += 1e-30;
      const double ratio = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) / allowed : INFINITY;
      if (ratio > 1) ++bad;
      if (ratio > worst || worst_index < 0) {
        worst = ratio;
        worst_index = static_cast<int64_t>(i);
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << got.size() << " outside the bound; worst: token " << worst_index / out_cols
                    << " column " << worst_index % out_cols << " got " << got[worst_index] << " want "
                    << want[worst_index] << " (" << worst << "x the bound)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8GemmTest, ::testing::ValuesIn(Cases()), CaseName);

class Fp8GemmRefusalTest : public testing::GpuTest {};

TEST_F(Fp8GemmRefusalTest, RefusesWhatVersion6CannotTake) {
  DeviceInfo dev;
  dev.cc_major = 9;
  dev.cc_minor = 0;
  dev.num_sms = 132;
  dev.max_smem_optin = 232448;
  alignas(16) static float scales[64];
  alignas(16) static uint8_t data[1 << 16];
  GemmParams p;
  p.a = p.w = p.d = data;
  p.m = 4;
  p.n = 256;
  p.k = 256;
  p.lda = p.ldw = 256;
  p.ldd = 256;
  p.fp8 = Fp8Scaling::kBlock;
  p.a_scale = p.w_scale = scales;
  const GemmConfig v6{GemmVersion::kFp8};
  if (!GemmBuiltWithSm90a()) GTEST_SKIP() << "no sm_90a build";
  EXPECT_TRUE(GemmSupported(p, v6, dev).ok());
  EXPECT_FALSE(GemmSupported(p, GemmConfig{GemmVersion::kSmallMSplitK}, dev).ok());
  GemmParams bf16 = p;
  bf16.fp8 = Fp8Scaling::kNone;
  EXPECT_FALSE(GemmSupported(bf16, v6, dev).ok());
  GemmParams no_scale = p;
  no_scale.w_scale = nullptr;
  EXPECT_FALSE(GemmSupported(no_scale, v6, dev).ok());
  GemmParams odd = p;
  odd.k = 264;
  odd.lda = odd.ldw = 264;
  EXPECT_FALSE(GemmSupported(odd, v6, dev).ok());
  GemmParams gated = p;
  gated.silu_mul = true;
  gated.n = 192;
  gated.ldd = 96;
  EXPECT_FALSE(GemmSupported(gated, v6, dev).ok());
  EXPECT_EQ(ChooseGemm(p, GemmMode::kCublasLt, {}, dev).version, GemmVersion::kFp8);
  // A bias: version 6 adds it (dense, not gated); cuBLASLt's FP8 does not
  // take it, so even its mode routes to version 6.
  alignas(16) static uint16_t bias[256];
  GemmParams with_bias = p;
  with_bias.bias = bias;
  EXPECT_TRUE(GemmSupported(with_bias, v6, dev).ok());
  EXPECT_FALSE(CublasLtTakesFp8(with_bias));
  EXPECT_EQ(ChooseGemm(with_bias, GemmMode::kCublasLt, {}, dev).version, GemmVersion::kFp8);
  GemmParams bf16_bias = bf16;
  bf16_bias.bias = bias;
  EXPECT_FALSE(GemmSupported(bf16_bias, GemmConfig{GemmVersion::kSmallMSplitK}, dev).ok());
  GemmParams grouped_bias = with_bias;
  static int32_t offsets[3] = {0, 2, 4};
  grouped_bias.group_offsets = offsets;
  grouped_bias.groups = 2;
  grouped_bias.max_group_rows = 2;
  EXPECT_FALSE(GemmSupported(grouped_bias, v6, dev).ok());
}

}  // namespace
}  // namespace layerserve::kernels
