// GPU tests of the elementwise and normalization kernels (RMSNorm with the
// fused residual add, RoPE, SiLU-gate-multiply, Cast) against host references.
//
// The references follow Hugging Face's 16-bit arithmetic: every op that
// returns a bf16/fp16 tensor in PyTorch is rounded here too, from the same
// rounded inputs the kernel reads. Where the kernel computes a transcendental
// (rsqrt, exp, cos/sin) in fp32 and the reference in double, a rounded result
// may land one ulp apart, so tolerances allow a couple of ulps; everything
// that is pure rounding (the residual sum, the untouched v part, casts) must
// match exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "layerserve/kernels/attention.h"
#include "layerserve/kernels/layer_ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using testing::AllClose;
using testing::Decode;
using testing::DeviceBuffer;
using testing::DTypeEpsilon;
using testing::DTypeName;
using testing::Encode;
using testing::RandomValues;
using testing::RoundToDType;

std::string RowCol(size_t i, int64_t cols) {
  return "row " + std::to_string(i / cols) + " col " + std::to_string(i % cols);
}

// ---------------------------------------------------------------- RMSNorm

struct RmsNormCase {
  DType dtype;
  int64_t rows;
  int64_t cols;
  bool residual;
};

class RmsNormTest : public testing::GpuTestWithParam<RmsNormCase> {};

TEST_P(RmsNormTest, MatchesReference) {
  const RmsNormCase c = GetParam();
  const size_t n = c.rows * c.cols;
  const double eps = 1e-5;
  const auto x = RandomValues(c.dtype, n, -2.0, 2.0, 11 + c.cols);
  const auto res = RandomValues(c.dtype, n, -2.0, 2.0, 12 + c.cols);
  const auto w = RandomValues(c.dtype, c.cols, 0.5, 1.5, 13 + c.cols);

  std::vector<double> want_h(n), want_y(n);
  for (int64_t r = 0; r < c.rows; ++r) {
    double sum_sq = 0;
    for (int64_t j = 0; j < c.cols; ++j) {
      const size_t i = r * c.cols + j;
      want_h[i] = c.residual ? RoundToDType(c.dtype, x[i] + res[i]) : x[i];
      sum_sq += want_h[i] * want_h[i];
    }
    const double inv_rms = 1.0 / std::sqrt(sum_sq / c.cols + eps);
    for (int64_t j = 0; j < c.cols; ++j) {
      const size_t i = r * c.cols + j;
      want_y[i] = RoundToDType(c.dtype, w[j] * RoundToDType(c.dtype, want_h[i] * inv_rms));
    }
  }

  const size_t bytes = n * DTypeBytes(c.dtype);
  DeviceBuffer d_x(bytes), d_res(bytes), d_h(bytes), d_w(c.cols * DTypeBytes(c.dtype)), d_y(bytes);
  d_x.Upload(Encode(c.dtype, x).data(), bytes);
  d_res.Upload(Encode(c.dtype, res).data(), bytes);
  d_w.Upload(Encode(c.dtype, w).data(), d_w.bytes());
  d_h.Poison();
  d_y.Poison();

  RmsNormParams p;
  p.x = d_x.get();
  p.residual = c.residual ? d_res.get() : nullptr;
  p.h_out = c.residual ? d_h.get() : nullptr;
  p.weight = d_w.get();
  p.y = d_y.get();
  p.rows = c.rows;
  p.cols = c.cols;
  p.eps = static_cast<float>(eps);
  p.dtype = c.dtype;
  ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<uint8_t> got(bytes);
  d_y.Download(got.data(), bytes);
  auto describe = [&](size_t i) { return RowCol(i, c.cols); };
  EXPECT_TRUE(AllClose(Decode(c.dtype, got), want_y, 1e-6, 4 * DTypeEpsilon(c.dtype), describe)) << "y";
  if (c.residual) {
    d_h.Download(got.data(), bytes);
    EXPECT_TRUE(AllClose(Decode(c.dtype, got), want_h, 0, 0, describe)) << "h = x + residual";
  }
}

std::vector<RmsNormCase> RmsNormCases() {
  std::vector<RmsNormCase> cases;
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (int64_t cols : {8, 264, 1024, 1032, 4096, 8192})
      for (bool residual : {true, false}) cases.push_back({dtype, 37, cols, residual});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Kernels, RmsNormTest, ::testing::ValuesIn(RmsNormCases()),
                         [](const ::testing::TestParamInfo<RmsNormCase>& info) {
                           return std::string(DTypeName(info.param.dtype)) + "_cols" + std::to_string(info.param.cols) +
                                  (info.param.residual ? "_residual" : "");
                         });

// h_out may alias x: the fused add writes the residual stream in place.
TEST(RmsNormInPlaceTest, HOutAliasesX) {
  if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  const DType dtype = DType::kBF16;
  const int64_t rows = 5, cols = 4096;
  const size_t n = rows * cols, bytes = n * 2;
  const auto x = RandomValues(dtype, n, -2.0, 2.0, 21);
  const auto res = RandomValues(dtype, n, -2.0, 2.0, 22);
  const auto w = RandomValues(dtype, cols, 0.5, 1.5, 23);
  std::vector<double> want_h(n);
  for (size_t i = 0; i < n; ++i) want_h[i] = RoundToDType(dtype, x[i] + res[i]);

  DeviceBuffer d_x(bytes), d_res(bytes), d_w(cols * 2), d_y(bytes);
  d_x.Upload(Encode(dtype, x).data(), bytes);
  d_res.Upload(Encode(dtype, res).data(), bytes);
  d_w.Upload(Encode(dtype, w).data(), cols * 2);
  d_y.Poison();
  RmsNormParams p;
  p.x = d_x.get();
  p.residual = d_res.get();
  p.h_out = d_x.get();
  p.weight = d_w.get();
  p.y = d_y.get();
  p.rows = rows;
  p.cols = cols;
  p.dtype = dtype;
  ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(bytes);
  d_x.Download(got.data(), bytes);
  EXPECT_TRUE(AllClose(Decode(dtype, got), want_h, 0, 0, [&](size_t i) { return RowCol(i, cols); }));
}

// RMSNorm with an FP8 output (the input of an FP8 linear, quantized in the
// same kernel): its y, codes and scales equal the plain RMSNorm followed by
// LaunchQuantizeFp8 of that y, bit for bit, per 128-column group, per row
// and at a static scale, a warp per row (256) and a CTA per row (4096), with
// one all-zero row.
TEST(RmsNormFp8Test, EqualsTheNormThenTheQuantizationBitForBit) {
  if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  const DType dtype = DType::kBF16;
  struct Case {
    int64_t cols, group;
    float static_scale;
  };
  for (const Case c :
       {Case{256, 128, 0.f}, Case{4096, 128, 0.f}, Case{256, 0, 0.f}, Case{4096, 0, 0.f}, Case{4096, 0, 0.011f}}) {
    SCOPED_TRACE(::testing::Message() << "cols " << c.cols << " group " << c.group << " static " << c.static_scale);
    const int64_t rows = 37, cols = c.cols;
    const size_t n = static_cast<size_t>(rows * cols);
    auto x = RandomValues(dtype, n, -3.0, 3.0, 31 + cols);
    std::fill(x.begin() + 4 * cols, x.begin() + 5 * cols, 0.0);
    const auto w = RandomValues(dtype, cols, 0.5, 1.5, 32);
    const size_t groups = c.group > 0 ? static_cast<size_t>(cols / c.group) : 1;
    DeviceBuffer d_x(n * 2), d_w(cols * 2), y_fused(n * 2), y_plain(n * 2), codes_fused(n), codes_plain(n),
        scales_fused(rows * groups * 4), scales_plain(rows * groups * 4);
    d_x.Upload(Encode(dtype, x).data(), n * 2);
    d_w.Upload(Encode(dtype, w).data(), cols * 2);
    for (DeviceBuffer* b : {&y_fused, &y_plain, &codes_fused, &codes_plain, &scales_fused, &scales_plain}) b->Poison();
    RmsNormParams p;
    p.x = d_x.get();
    p.weight = d_w.get();
    p.rows = rows;
    p.cols = cols;
    p.dtype = dtype;
    p.y = y_plain.get();
    ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
    QuantizeFp8Params q;
    q.x = y_plain.get();
    q.codes = codes_plain.get();
    q.scales = static_cast<float*>(scales_plain.get());
    q.rows = rows;
    q.cols = cols;
    q.group = c.group;
    q.static_scale = c.static_scale;
    ASSERT_TRUE(LaunchQuantizeFp8(q, nullptr).ok());
    p.y = y_fused.get();
    p.fp8_codes = codes_fused.get();
    p.fp8_scales = static_cast<float*>(scales_fused.get());
    p.fp8_group = c.group;
    p.fp8_static_scale = c.static_scale;
    ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
    LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const auto bytes_of = [](const DeviceBuffer& b, size_t count) {
      std::vector<uint8_t> v(count);
      b.Download(v.data(), count);
      return v;
    };
    EXPECT_EQ(bytes_of(y_fused, n * 2), bytes_of(y_plain, n * 2));
    const std::vector<uint8_t> got = bytes_of(codes_fused, n), want = bytes_of(codes_plain, n);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; ++i) {
      if (got[i] != want[i] && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << "first differing code at " << RowCol(first, cols);
    EXPECT_EQ(bytes_of(scales_fused, rows * groups * 4), bytes_of(scales_plain, rows * groups * 4));
  }
}

// ---------------------------------------------------------------- RoPE

struct RopeCase {
  DType dtype;
  int head_dim;
  int heads;
  int kv_heads;
  bool head_norm = false;  // Qwen3's q_norm / k_norm first
};

class RopeTest : public testing::GpuTestWithParam<RopeCase> {};

TEST_P(RopeTest, MatchesHuggingFaceRounding) {
  const RopeCase c = GetParam();
  const int64_t tokens = 33;
  const int64_t width = int64_t{c.heads + 2 * c.kv_heads} * c.head_dim;
  const int half = c.head_dim / 2;
  const auto qkv = RandomValues(c.dtype, tokens * width, -1.0, 1.0, 31 + c.head_dim);
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / c.head_dim));
  std::vector<int32_t> positions(tokens);
  for (int64_t t = 0; t < tokens; ++t) positions[t] = static_cast<int32_t>((t * 2654435761u) % 8192);
  positions[0] = 0;
  positions[1] = 131071;  // long-context angles exercise sincosf's slow path

  // The head norms' weights, and each q/k head normalised as an RMSNorm of
  // the dtype rounds it (rms_norm.cuh): x * rsqrt(mean(x^2) + eps) rounded,
  // then weight * that rounded.
  const float norm_eps = 1e-6f;
  const auto q_norm = RandomValues(c.dtype, c.head_dim, 0.5, 1.5, 41);
  const auto k_norm = RandomValues(c.dtype, c.head_dim, 0.5, 1.5, 42);
  std::vector<double> normed = qkv;
  for (int64_t t = 0; t < tokens && c.head_norm; ++t) {
    for (int h = 0; h < c.heads + c.kv_heads; ++h) {
      double* x = &normed[t * width + int64_t{h} * c.head_dim];
      const std::vector<double>& w = h < c.heads ? q_norm : k_norm;
      double sum_sq = 0;
      for (int i = 0; i < c.head_dim; ++i) sum_sq += x[i] * x[i];
      const double r = 1 / std::sqrt(sum_sq / c.head_dim + norm_eps);
      for (int i = 0; i < c.head_dim; ++i) x[i] = RoundToDType(c.dtype, w[i] * RoundToDType(c.dtype, x[i] * r));
    }
  }
  // cos/sin of the fp32 angle, rounded to fp32 and then to the dtype.
  std::vector<double> want = normed;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < c.heads + c.kv_heads; ++h) {
      double* x = &want[t * width + int64_t{h} * c.head_dim];
      const double* in = &normed[t * width + int64_t{h} * c.head_dim];
      for (int i = 0; i < half; ++i) {
        const float angle = inv_freq[i] * static_cast<float>(positions[t]);
        const double cs = RoundToDType(c.dtype, std::cos(static_cast<double>(angle)));
        const double sn = RoundToDType(c.dtype, std::sin(static_cast<double>(angle)));
        const double a = in[i], b = in[i + half];
        x[i] = RoundToDType(c.dtype, RoundToDType(c.dtype, a * cs) - RoundToDType(c.dtype, b * sn));
        x[i + half] = RoundToDType(c.dtype, RoundToDType(c.dtype, b * cs) + RoundToDType(c.dtype, a * sn));
      }
    }
  }

  const size_t bytes = qkv.size() * DTypeBytes(c.dtype);
  const size_t norm_bytes = c.head_dim * DTypeBytes(c.dtype);
  DeviceBuffer d_qkv(bytes), d_pos(tokens * 4), d_freq(half * 4), d_q_norm(norm_bytes), d_k_norm(norm_bytes);
  d_qkv.Upload(Encode(c.dtype, qkv).data(), bytes);
  d_q_norm.Upload(Encode(c.dtype, q_norm).data(), norm_bytes);
  d_k_norm.Upload(Encode(c.dtype, k_norm).data(), norm_bytes);
  d_pos.Upload(positions.data(), tokens * 4);
  d_freq.Upload(inv_freq.data(), half * 4);
  RopeParams p;
  p.qkv = d_qkv.get();
  p.positions = static_cast<const int32_t*>(d_pos.get());
  p.inv_freq = static_cast<const float*>(d_freq.get());
  p.tokens = tokens;
  p.num_heads = c.heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  if (c.head_norm) {
    p.q_norm = d_q_norm.get();
    p.k_norm = d_k_norm.get();
    p.norm_eps = norm_eps;
  }
  p.dtype = c.dtype;
  ASSERT_TRUE(LaunchRope(p, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<uint8_t> got_bytes(bytes);
  d_qkv.Download(got_bytes.data(), bytes);
  const std::vector<double> got = Decode(c.dtype, got_bytes);
  auto describe = [&](size_t i) {
    const int64_t col = i % width;
    return "token " + std::to_string(i / width) + " head " + std::to_string(col / c.head_dim) + " dim " +
           std::to_string(col % c.head_dim);
  };
  const double eps = DTypeEpsilon(c.dtype);
  EXPECT_TRUE(AllClose(got, want, 4 * eps, 2 * eps, describe));
  // The v heads are not rotated: bit-exact.
  std::vector<double> got_v, want_v;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = int64_t{c.heads + c.kv_heads} * c.head_dim; j < width; ++j) {
      got_v.push_back(got[t * width + j]);
      want_v.push_back(qkv[t * width + j]);
    }
  EXPECT_TRUE(AllClose(got_v, want_v, 0, 0)) << "v heads changed";
}

INSTANTIATE_TEST_SUITE_P(Kernels, RopeTest,
                         ::testing::Values(RopeCase{DType::kBF16, 128, 8, 2}, RopeCase{DType::kF16, 128, 8, 2},
                                           RopeCase{DType::kBF16, 64, 4, 4}, RopeCase{DType::kF16, 64, 6, 1},
                                           RopeCase{DType::kBF16, 128, 8, 2, true},
                                           RopeCase{DType::kF16, 64, 6, 1, true},
                                           RopeCase{DType::kBF16, 512, 2, 1, true}),
                         [](const ::testing::TestParamInfo<RopeCase>& info) {
                           return std::string(DTypeName(info.param.dtype)) + "_d" +
                                  std::to_string(info.param.head_dim) + "_h" + std::to_string(info.param.heads) +
                                  "_kv" + std::to_string(info.param.kv_heads) +
                                  (info.param.head_norm ? "_head_norm" : "");
                         });

// ---------------------------------------------------------------- SiluMul

struct SiluMulCase {
  DType dtype;
  int64_t rows;
  int64_t width;
  int64_t block = kGateUpBlock;  // the interleave (an FP8 gate/up's: 64)
};

class SiluMulTest : public testing::GpuTestWithParam<SiluMulCase> {};

TEST_P(SiluMulTest, MatchesReference) {
  const SiluMulCase c = GetParam();
  const auto gate_up = RandomValues(c.dtype, c.rows * 2 * c.width, -6.0, 6.0, 41 + c.width);
  std::vector<double> want(c.rows * c.width);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.width; ++j) {
      // Gate and up columns interleaved in blocks of c.block.
      const int64_t gate = (j / c.block) * 2 * c.block + j % c.block;
      const double g = gate_up[r * 2 * c.width + gate];
      const double u = gate_up[r * 2 * c.width + gate + c.block];
      want[r * c.width + j] = RoundToDType(c.dtype, RoundToDType(c.dtype, g / (1.0 + std::exp(-g))) * u);
    }
  const size_t in_bytes = gate_up.size() * DTypeBytes(c.dtype), out_bytes = want.size() * DTypeBytes(c.dtype);
  DeviceBuffer d_in(in_bytes), d_out(out_bytes);
  d_in.Upload(Encode(c.dtype, gate_up).data(), in_bytes);
  d_out.Poison();
  SiluMulParams p;
  p.gate_up = d_in.get();
  p.out = d_out.get();
  p.rows = c.rows;
  p.width = c.width;
  p.block = c.block;
  p.dtype = c.dtype;
  ASSERT_TRUE(LaunchSiluMul(p, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(out_bytes);
  d_out.Download(got.data(), out_bytes);
  EXPECT_TRUE(AllClose(Decode(c.dtype, got), want, 1e-7, 4 * DTypeEpsilon(c.dtype),
                       [&](size_t i) { return RowCol(i, c.width); }));
}

INSTANTIATE_TEST_SUITE_P(Kernels, SiluMulTest,
                         ::testing::Values(SiluMulCase{DType::kBF16, 19, 8}, SiluMulCase{DType::kBF16, 19, 1000},
                                           SiluMulCase{DType::kBF16, 7, 14336}, SiluMulCase{DType::kF16, 19, 8},
                                           SiluMulCase{DType::kF16, 19, 1000}, SiluMulCase{DType::kF16, 7, 14336},
                                           SiluMulCase{DType::kBF16, 19, 384, 64},
                                           SiluMulCase{DType::kBF16, 7, 14336, 64}),
                         [](const ::testing::TestParamInfo<SiluMulCase>& info) {
                           return std::string(DTypeName(info.param.dtype)) + "_w" + std::to_string(info.param.width) +
                                  (info.param.block != kGateUpBlock ? "_b" + std::to_string(info.param.block) : "");
                         });

// ---------------------------------------------------------------- Cast

struct CastCase {
  DType src;
  DType dst;
  int64_t n;
  int64_t offset;  // elements; non-zero misaligns both pointers (scalar path)
};

class CastTest : public testing::GpuTestWithParam<CastCase> {};

TEST_P(CastTest, RoundsToNearestEven) {
  const CastCase c = GetParam();
  const size_t src_elem = DTypeBytes(c.src), dst_elem = DTypeBytes(c.dst);
  // Source values up to 300 in magnitude (finite in every dtype), plus a band
  // of tiny ones (fp16 subnormals) every 16th element.
  std::vector<double> src = RandomValues(c.src, c.n, -300.0, 300.0, 51 + c.n);
  for (int64_t i = 0; i < c.n; i += 16) src[i] = RoundToDType(c.src, src[i] * 1e-7);
  std::vector<double> want(c.n);
  for (int64_t i = 0; i < c.n; ++i) want[i] = RoundToDType(c.dst, src[i]);

  constexpr int64_t kGuard = 8;  // elements after the end that must stay poisoned
  DeviceBuffer d_src((c.n + c.offset) * src_elem), d_dst((c.n + c.offset + kGuard) * dst_elem);
  d_src.Upload(Encode(c.src, src).data(), c.n * src_elem, c.offset * src_elem);
  d_dst.Poison();
  CastParams p;
  p.src = static_cast<const char*>(d_src.get()) + c.offset * src_elem;
  p.src_dtype = c.src;
  p.dst = static_cast<char*>(d_dst.get()) + c.offset * dst_elem;
  p.dst_dtype = c.dst;
  p.n = c.n;
  ASSERT_TRUE(LaunchCast(p, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got((c.n + kGuard) * dst_elem);
  d_dst.Download(got.data(), got.size(), c.offset * dst_elem);
  std::vector<uint8_t> body(got.begin(), got.begin() + c.n * dst_elem);
  EXPECT_TRUE(AllClose(Decode(c.dst, body), want, 0, 0, [](size_t i) { return "element " + std::to_string(i); }));
  for (size_t b = c.n * dst_elem; b < got.size(); ++b) {
    ASSERT_EQ(got[b], 0xFF) << "wrote past the end, byte " << b;
  }
}

std::vector<CastCase> CastCases() {
  std::vector<CastCase> cases;
  for (DType src : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType dst : {DType::kF32, DType::kBF16, DType::kF16}) {
      cases.push_back({src, dst, 100003, 0});
      cases.push_back({src, dst, 4099, 1});
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Kernels, CastTest, ::testing::ValuesIn(CastCases()),
                         [](const ::testing::TestParamInfo<CastCase>& info) {
                           return std::string(DTypeName(info.param.src)) + "_to_" + DTypeName(info.param.dst) +
                                  (info.param.offset != 0 ? "_unaligned" : "");
                         });

// ------------------------------------------------- argument validation
// These reject before touching the device, so they run (and must pass) on
// machines without a GPU too.

TEST(KernelArgsTest, RejectsShapesNoKernelHandles) {
  RmsNormParams norm;
  int dummy[4];
  norm.x = norm.weight = dummy;
  norm.y = dummy;
  norm.rows = 1;
  norm.cols = 12;  // not a multiple of 8
  EXPECT_EQ(LaunchRmsNorm(norm, nullptr).code(), absl::StatusCode::kInvalidArgument);

  RopeParams rope;
  rope.qkv = dummy;
  rope.tokens = 1;
  rope.num_heads = 1;
  rope.head_dim = 40;
  EXPECT_EQ(LaunchRope(rope, nullptr).code(), absl::StatusCode::kInvalidArgument);

  SiluMulParams silu;
  silu.gate_up = silu.out = dummy;
  silu.rows = 1;
  silu.width = 10;
  EXPECT_EQ(LaunchSiluMul(silu, nullptr).code(), absl::StatusCode::kInvalidArgument);

  FlashAttentionParams attn;
  attn.q = attn.k = attn.v = dummy;
  attn.out = dummy;
  attn.cu_seqlens = reinterpret_cast<const int32_t*>(dummy);
  attn.num_seqs = 1;
  attn.max_seqlen = 1;
  attn.num_heads = 8;
  attn.num_kv_heads = 2;
  attn.softmax_scale = 0.1f;
  attn.head_dim = 96;
  attn.q_row_stride = attn.out_row_stride = 8 * 96;
  attn.k_row_stride = attn.v_row_stride = 2 * 96;
  EXPECT_EQ(LaunchFlashAttention(attn, DeviceInfo{}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  attn.head_dim = 128;
  attn.num_kv_heads = 3;  // 8 heads do not group into 3
  EXPECT_EQ(LaunchFlashAttention(attn, DeviceInfo{}, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layerserve::kernels
