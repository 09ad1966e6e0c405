// GPU tests of the fused flash-attention forward, every built version (each at
// several section sizes of its longest-first schedule), against a float64
// reference (STYLE rule 2). A version that does not take a case (v8: only
// head_dim 128, bf16, Hopper) must refuse it at launch and is reported as
// skipped for that case.
//
// Attention is a reduction over up to thousands of keys, so a fixed tolerance
// would either hide bugs on short sequences or flake on long ones. Instead the
// kernel's error against the float64 reference must stay within 2x the error
// of a plain same-precision implementation of the same math: scores and
// probabilities materialized in the activation dtype (as an unfused PyTorch
// bf16/fp16 implementation does), fp32 accumulation inside each product. Both
// read the same rounded q, k, v; both errors are printed.
//
// Inputs are one fused qkv buffer [tokens, (heads + 2 kv_heads) * head_dim],
// as the server lays it out, so the row strides are exercised everywhere.
//
// Sliding-window cases (FlashAttentionParams::window) put the window edge at
// every position relative to the key tiles of each version (64 keys for v6
// and v7, 128 for v8); the reference applies the window's definition key by
// key, not the kernels' tile arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/attention/flash_attention_versions.h"
#include "layerserve/kernels/attention.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using testing::Decode;
using testing::DeviceBuffer;
using testing::DTypeName;
using testing::Encode;
using testing::Errors;
using testing::ErrorStats;
using testing::ParallelFor;
using testing::RandomValues;
using testing::RoundToDType;

struct AttnCase {
  std::vector<int> seqlens;
  int head_dim;
  int heads;
  int kv_heads;
  DType dtype;
  // Added to the true longest length: callers may size the grid from an
  // upper bound, and the extra query tiles must exit without writing.
  int max_seqlen_slack = 0;
  int window = 0;  // sliding window (FlashAttentionParams::window); 0: none
};

std::string CaseName(const AttnCase& c) {
  std::string name = std::string(DTypeName(c.dtype)) + "_d" + std::to_string(c.head_dim) + "_h" +
                     std::to_string(c.heads) + "kv" + std::to_string(c.kv_heads) + "_len";
  for (size_t i = 0; i < c.seqlens.size() && i < 4; ++i) name += "_" + std::to_string(c.seqlens[i]);
  if (c.seqlens.size() > 4) name += "_and" + std::to_string(c.seqlens.size() - 4) + "more";
  if (c.window > 0) name += "_w" + std::to_string(c.window);
  return name;
}

// gtest prints parameters in test listings and failures.
void PrintTo(const AttnCase& c, std::ostream* os) { *os << CaseName(c); }

// Host copies of one case's inputs and both references, [tokens, heads*d].
struct AttnProblem {
  std::vector<int32_t> cu_seqlens;
  int64_t tokens = 0;
  int64_t qkv_width = 0;
  std::vector<double> qkv;    // rounded to the dtype
  std::vector<double> exact;  // float64 reference
  std::vector<double> plain;  // same-precision unfused implementation
};

AttnProblem BuildProblem(const AttnCase& c) {
  AttnProblem pr;
  pr.cu_seqlens.push_back(0);
  for (int len : c.seqlens) pr.cu_seqlens.push_back(pr.cu_seqlens.back() + len);
  pr.tokens = pr.cu_seqlens.back();
  pr.qkv_width = int64_t{c.heads + 2 * c.kv_heads} * c.head_dim;
  // Spread wide enough that softmax rows are far from uniform.
  pr.qkv = RandomValues(c.dtype, pr.tokens * pr.qkv_width, -2.0, 2.0, 1000 + pr.tokens * 7 + c.head_dim + c.heads);
  const int64_t out_width = int64_t{c.heads} * c.head_dim;
  pr.exact.assign(pr.tokens * out_width, 0.0);
  pr.plain.assign(pr.tokens * out_width, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const int group = c.heads / c.kv_heads;
  const int d = c.head_dim;
  // Hugging Face's definition: query i sees key j iff 0 <= i - j < window
  // (no upper bound without a window).
  auto visible = [&](int i, int j) { return i - j >= 0 && (c.window == 0 || i - j < c.window); };

  ParallelFor(c.seqlens.size() * c.heads, [&](size_t job) {
    const int s = static_cast<int>(job / c.heads);
    const int h = static_cast<int>(job % c.heads);
    const int kvh = h / group;
    const int64_t start = pr.cu_seqlens[s];
    const int len = c.seqlens[s];
    auto q_at = [&](int i) { return &pr.qkv[(start + i) * pr.qkv_width + int64_t{h} * d]; };
    auto k_at = [&](int j) { return &pr.qkv[(start + j) * pr.qkv_width + int64_t{c.heads + kvh} * d]; };
    auto v_at = [&](int j) { return &pr.qkv[(start + j) * pr.qkv_width + int64_t{c.heads + c.kv_heads + kvh} * d]; };
    std::vector<double> s_exact(len), p_plain(len);
    std::vector<float> s_plain(len);
    std::vector<int> keys;  // the keys query i sees
    for (int i = 0; i < len; ++i) {
      keys.clear();
      for (int j = 0; j < len; ++j)
        if (visible(i, j)) keys.push_back(j);
      const double* q = q_at(i);
      double max_exact = -INFINITY;
      float max_plain = -INFINITY;
      for (int j : keys) {
        const double* k = k_at(j);
        double dot = 0;
        float dot_f = 0;
        for (int e = 0; e < d; ++e) {
          dot += q[e] * k[e];
          dot_f += static_cast<float>(q[e]) * static_cast<float>(k[e]);
        }
        s_exact[j] = dot * scale;
        s_plain[j] = static_cast<float>(RoundToDType(c.dtype, dot_f * static_cast<float>(scale)));
        max_exact = std::max(max_exact, s_exact[j]);
        max_plain = std::max(max_plain, s_plain[j]);
      }
      double sum_exact = 0;
      float sum_plain = 0;
      for (int j : keys) {
        s_exact[j] = std::exp(s_exact[j] - max_exact);
        sum_exact += s_exact[j];
        s_plain[j] = std::exp(s_plain[j] - max_plain);
        sum_plain += s_plain[j];
      }
      for (int j : keys) p_plain[j] = RoundToDType(c.dtype, s_plain[j] / sum_plain);
      double* out_exact = &pr.exact[(start + i) * out_width + int64_t{h} * d];
      double* out_plain = &pr.plain[(start + i) * out_width + int64_t{h} * d];
      std::vector<float> acc_plain(d, 0.f);
      for (int j : keys) {
        const double* v = v_at(j);
        const double w = s_exact[j] / sum_exact;
        const float wp = static_cast<float>(p_plain[j]);
        for (int e = 0; e < d; ++e) {
          out_exact[e] += w * v[e];
          acc_plain[e] += wp * static_cast<float>(v[e]);
        }
      }
      for (int e = 0; e < d; ++e) out_plain[e] = RoundToDType(c.dtype, acc_plain[e]);
    }
  });
  return pr;
}

class FlashAttentionTest : public testing::GpuTestWithParam<AttnCase> {};

TEST_P(FlashAttentionTest, WithinTwiceThePlainImplementationsError) {
  const AttnCase c = GetParam();
  const AttnProblem pr = BuildProblem(c);
  const ErrorStats plain = Errors(pr.plain, pr.exact);
  const int64_t out_width = int64_t{c.heads} * c.head_dim;
  const size_t elem = DTypeBytes(c.dtype);

  DeviceBuffer d_qkv(pr.qkv.size() * elem), d_out(pr.tokens * out_width * elem),
      d_cu(pr.cu_seqlens.size() * sizeof(int32_t));
  d_qkv.Upload(Encode(c.dtype, pr.qkv).data(), d_qkv.bytes());
  d_cu.Upload(pr.cu_seqlens.data(), d_cu.bytes());

  FlashAttentionParams p;
  const char* base = static_cast<const char*>(d_qkv.get());
  p.q = base;
  p.k = base + int64_t{c.heads} * c.head_dim * elem;
  p.v = base + int64_t{c.heads + c.kv_heads} * c.head_dim * elem;
  p.out = d_out.get();
  p.q_row_stride = p.k_row_stride = p.v_row_stride = pr.qkv_width;
  p.out_row_stride = out_width;
  p.cu_seqlens = static_cast<const int32_t*>(d_cu.get());
  p.num_seqs = static_cast<int>(c.seqlens.size());
  p.max_seqlen = *std::max_element(c.seqlens.begin(), c.seqlens.end()) + c.max_seqlen_slack;
  p.num_heads = c.heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.window = c.window;
  const absl::StatusOr<DeviceInfo> dev = CurrentDeviceInfo();
  ASSERT_TRUE(dev.ok()) << dev.status();
  p.dtype = c.dtype;

  auto describe = [&](size_t i) {
    const int64_t token = static_cast<int64_t>(i) / out_width;
    const int64_t col = static_cast<int64_t>(i) % out_width;
    const int seq =
        static_cast<int>(std::upper_bound(pr.cu_seqlens.begin(), pr.cu_seqlens.end(), token) - pr.cu_seqlens.begin()) -
        1;
    return "seq " + std::to_string(seq) + " row " + std::to_string(token - pr.cu_seqlens[seq]) + " head " +
           std::to_string(col / c.head_dim) + " dim " + std::to_string(col % c.head_dim);
  };

  // Version 0 here means the production entry point (LaunchFlashAttention).
  // Every version also runs with every smaller section size than the
  // device's default (one section for these small problems), so that several
  // sections, each of one or more heads, are exercised.
  struct Run {
    int version;
    int heads_per_section;  // 0: the launcher's choice
  };
  std::vector<Run> runs;
  runs.push_back({0, 0});
  for (int version : kFlashAttentionVersions) runs.push_back({version, 0});
  for (int version : kFlashAttentionVersions)
    for (int heads = 1; heads < c.heads; ++heads)
      if (c.heads % heads == 0) runs.push_back({version, heads});
  for (const Run& run : runs) {
    const int version = run.version;
    SCOPED_TRACE((version == 0 ? std::string("LaunchFlashAttention") : FlashAttentionVersionName(version)) +
                 (run.heads_per_section > 0 ? ", heads per section " + std::to_string(run.heads_per_section) : ""));
    if (version > 0) {
      // A version that does not take this case (v8: head_dim 64, fp16, or no
      // Hopper) must say so at launch; it is skipped, visibly.
      const absl::Status available = FlashAttentionVersionAvailable(p, version, *dev);
      if (!available.ok()) {
        EXPECT_EQ(LaunchFlashAttentionVersion(p, version, *dev, nullptr, run.heads_per_section).code(),
                  available.code());
        if (run.heads_per_section == 0) {
          std::cout << "[ SKIPPED  ] v" << version << " on " << CaseName(c) << ": " << available.message() << "\n";
          RecordProperty("v" + std::to_string(version), "skipped: " + std::string(available.message()));
        }
        continue;
      }
    }
    d_out.Poison();
    const absl::Status st = version == 0
                                ? LaunchFlashAttention(p, *dev, nullptr)
                                : LaunchFlashAttentionVersion(p, version, *dev, nullptr, run.heads_per_section);
    ASSERT_TRUE(st.ok()) << st;
    LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> bytes(d_out.bytes());
    d_out.Download(bytes.data(), bytes.size());
    const std::vector<double> got = Decode(c.dtype, bytes);
    const ErrorStats kernel = Errors(got, pr.exact);
    const std::string report =
        "kernel max|err| " + std::to_string(kernel.max_abs) + " mean " + std::to_string(kernel.mean_abs) +
        "; plain max|err| " + std::to_string(plain.max_abs) + " mean " + std::to_string(plain.mean_abs) +
        "; worst at " + describe(kernel.worst) + ": got " + std::to_string(got[kernel.worst]) + ", expected " +
        std::to_string(pr.exact[kernel.worst]) + ", plain " + std::to_string(pr.plain[kernel.worst]);
    EXPECT_EQ(kernel.non_finite, 0u) << kernel.non_finite << " non-finite outputs (unwritten or NaN); first at "
                                     << describe(kernel.worst);
    // A floor of a quarter ulp at 1.0 keeps exact-looking tiny cases (one
    // key: output = v) from demanding better than exact.
    const double floor = 0.25 * testing::DTypeEpsilon(c.dtype);
    EXPECT_LE(kernel.max_abs, 2 * plain.max_abs + floor) << report;
    EXPECT_LE(kernel.mean_abs, 2 * plain.mean_abs + floor) << report;
    if (run.heads_per_section > 0) continue;
    // Kept in the XML report (--gtest_output=xml) for docs/log/attention.md.
    RecordProperty(version == 0 ? "default" : "v" + std::to_string(version),
                   std::to_string(kernel.max_abs) + " " + std::to_string(kernel.mean_abs) + " " +
                       std::to_string(plain.max_abs) + " " + std::to_string(plain.mean_abs));
  }
}

std::vector<AttnCase> Cases() {
  std::vector<AttnCase> cases;
  // Single sequences around the tile sizes (64, 128) and beyond, every GQA
  // ratio, both head sizes and dtypes.
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (int d : {64, 128})
      for (int kv : {8, 2, 1})
        for (int len : {1, 7, 63, 64, 65, 127, 500, 1000}) cases.push_back({{len}, d, 8, kv, dtype});
  // Long sequences.
  cases.push_back({{4096}, 128, 8, 1, DType::kBF16});
  cases.push_back({{4096}, 128, 8, 2, DType::kF16});
  cases.push_back({{4096}, 64, 4, 1, DType::kBF16});
  cases.push_back({{8192}, 128, 4, 1, DType::kBF16});
  // The served model's head layout (32 heads, 8 KV heads): sections of 1..16
  // heads in the longest-first versions.
  cases.push_back({{1500, 700}, 128, 32, 8, DType::kBF16});
  // Packed batches of different lengths: no attention may cross a boundary.
  cases.push_back({{1000, 1, 65, 7, 4096, 63, 127, 500, 64}, 128, 8, 2, DType::kBF16});
  cases.push_back({{3, 700, 64, 129, 1}, 64, 8, 8, DType::kF16});
  cases.push_back({{255, 256, 257}, 128, 8, 1, DType::kF16});
  cases.push_back({{130, 1, 1, 190}, 64, 4, 1, DType::kBF16, /*max_seqlen_slack=*/300});
  cases.push_back({{130, 1, 1, 190}, 128, 4, 1, DType::kBF16, /*max_seqlen_slack=*/300});
  // Sliding windows shorter than the sequence, both dtypes and head sizes:
  // from one key (each row sees only itself) through the key tiles' edges
  // (63..65 for v6 and v7, 127..129 for v8) to windows spanning many tiles;
  // the GQA ratio changes from window to window.
  for (DType dtype : {DType::kBF16, DType::kF16})
    for (int d : {64, 128}) {
      const int kv_heads[] = {8, 2, 1};
      int i = 0;
      for (int window : {1, 7, 63, 64, 65, 100, 127, 128, 129, 1000})
        cases.push_back({{2048}, d, 8, kv_heads[i++ % 3], dtype, /*max_seqlen_slack=*/0, window});
    }
  // Mistral's window on a longer sequence: 4096 keys, 32 tiles of v8.
  cases.push_back({{8192}, 128, 4, 1, DType::kBF16, 0, 4096});
  // Packed batches whose sequences are shorter, as long as, and longer than
  // the window: each sequence's window stays inside it.
  cases.push_back({{1, 100, 2048, 64, 129, 7, 1000, 300, 99, 101}, 128, 8, 2, DType::kBF16, 0, 100});
  cases.push_back({{127, 1, 1500, 128, 700, 65, 129}, 64, 8, 1, DType::kF16, 0, 128});
  cases.push_back({{2000, 3, 513, 64}, 64, 8, 4, DType::kBF16, 0, 200});
  cases.push_back({{300, 1100, 2, 1024}, 128, 8, 8, DType::kF16, 0, 257});
  // The served model's head layout, sections of 1..16 heads.
  cases.push_back({{2048, 5, 513}, 128, 32, 8, DType::kBF16, 0, 256});
  // A grid sized from an upper bound: the extra query tiles, far past every
  // sequence, see no key at all and must still exit without writing.
  cases.push_back({{130, 1, 1, 190}, 64, 4, 1, DType::kF16, /*max_seqlen_slack=*/300, /*window=*/50});
  cases.push_back({{130, 1, 1, 190}, 128, 4, 1, DType::kBF16, /*max_seqlen_slack=*/300, /*window=*/50});
  // Short sequences, v9's (at most kFlashV9MaxSeqlen tokens): a batch of
  // one-token requests in the served layout, where each output row is its V
  // row; mixed short lengths up to the limit, with and without a window; a
  // grid sized from an upper bound within the limit.
  cases.push_back({std::vector<int>(40, 1), 128, 32, 8, DType::kBF16});
  cases.push_back({std::vector<int>(5, 1), 64, 8, 2, DType::kF16});
  cases.push_back({{1, 2, 5, 32, 17, 1, 31}, 128, 8, 2, DType::kBF16});
  cases.push_back({{1, 2, 5, 32, 17, 1, 31}, 64, 8, 1, DType::kF16, 0, 3});
  cases.push_back({{9, 1, 3}, 128, 32, 8, DType::kBF16, 0, 1});
  cases.push_back({{1, 1, 3}, 128, 4, 1, DType::kBF16, /*max_seqlen_slack=*/4});
  // Windows about as long as the sequences: 999 and 1000 tokens see every
  // key of their causal range, 1001's last row loses key 0; a window longer
  // than everything is the same as none.
  cases.push_back({{1000, 999, 1001}, 128, 8, 2, DType::kBF16, 0, 1000});
  cases.push_back({{500, 64}, 64, 8, 8, DType::kF16, 0, 4096});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Kernels, FlashAttentionTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<AttnCase>& info) {
                           return CaseName(info.param) + "_" + std::to_string(info.index);
                         });

// Sections hold whole GQA groups, divide the KV heads evenly and keep their
// K/V within three quarters of L2 (host-only arithmetic: no device needed).
TEST(FlashAttentionScheduleTest, HeadsPerSectionFitsThreeQuartersOfL2) {
  FlashAttentionParams p;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  const int64_t h100_l2 = 50 << 20;  // budget 37.5 MiB; K+V take 512 B per token and KV head
  p.max_seqlen = 8192;               // 4 MiB per KV head: all 8 fit
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 32);
  p.max_seqlen = 16384;  // 8 MiB: 4 fit
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 16);
  p.max_seqlen = 32768;  // 16 MiB: 2 fit
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 8);
  p.max_seqlen = 1 << 20;  // nothing fits: still one whole group
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 4);
  p.num_heads = 24;
  p.num_kv_heads = 6;
  p.max_seqlen = 16384;  // 8 MiB each: 4 would fit, but 4 does not divide 6
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 12);
  p.max_seqlen = 8192;  // 4 MiB each: all 6 fit
  EXPECT_EQ(FlashHeadsPerSection(p, h100_l2), 24);
}

// The default-version rule is a pure function of the problem and the device:
// checked here on hand-made devices, so it runs in CI without a GPU.
TEST(FlashAttentionDispatchTest, DefaultVersionFollowsTheMeasuredRule) {
  DeviceInfo h100;
  h100.cc_major = 9;
  h100.cc_minor = 0;
  h100.num_sms = 132;
  h100.max_smem_optin = 227 * 1024;
  h100.l2_bytes = 50 << 20;
  DeviceInfo a100 = h100;
  a100.cc_major = 8;
  a100.num_sms = 108;
  a100.max_smem_optin = 163 * 1024;
  FlashAttentionParams p;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.dtype = DType::kBF16;
  p.num_seqs = 1;
  p.max_seqlen = 2048;
  // v8 wherever it runs: head_dim 128, bf16, Hopper, an sm_90a build.
#if defined(LAYERSERVE_TEST_HAVE_SM90A)
  EXPECT_EQ(DefaultFlashAttentionVersion(p, h100), 8);
#endif
  // Elsewhere v6, except short grids of short sequences (v7): 1 x 2048 is
  // 512 v1 tiles, over 3 waves of 2 CTAs on 108 SMs; 4 x 512 is 512 tiles too
  // but its sequences are short.
  EXPECT_EQ(DefaultFlashAttentionVersion(p, a100), 6);
  p.num_seqs = 4;
  p.max_seqlen = 512;
  EXPECT_EQ(DefaultFlashAttentionVersion(p, a100), 7);
  p.dtype = DType::kF16;  // v8 takes bf16 only
  EXPECT_EQ(DefaultFlashAttentionVersion(p, h100), 7);
  p.num_seqs = 64;  // 64 x 4 tiles x 32 heads: many waves
  EXPECT_EQ(DefaultFlashAttentionVersion(p, h100), 6);
  p.dtype = DType::kBF16;
  p.head_dim = 64;  // v8 takes head_dim 128 only
  EXPECT_EQ(DefaultFlashAttentionVersion(p, h100), 6);
  // v9 for sequences of at most kFlashV9DefaultMaxSeqlen tokens, on any
  // device; past that a tiled version, though v9 would still run them.
  p.head_dim = 128;
  for (int len : {1, 7, kFlashV9DefaultMaxSeqlen}) {
    p.max_seqlen = len;
    EXPECT_EQ(DefaultFlashAttentionVersion(p, h100), 9) << len;
    EXPECT_EQ(DefaultFlashAttentionVersion(p, a100), 9) << len;
  }
  for (int len : {kFlashV9DefaultMaxSeqlen + 1, kFlashV9MaxSeqlen}) {
    p.max_seqlen = len;
    EXPECT_NE(DefaultFlashAttentionVersion(p, h100), 9) << len;
    EXPECT_NE(DefaultFlashAttentionVersion(p, a100), 9) << len;
  }
}

// A negative window is refused before any launch (host-only: the pointers are
// checked for alignment, never read).
TEST(FlashAttentionParamsTest, WindowMustNotBeNegative) {
  alignas(16) static char buffer[16];
  FlashAttentionParams p;
  p.q = p.k = p.v = buffer;
  p.out = buffer;
  p.cu_seqlens = reinterpret_cast<const int32_t*>(buffer);
  p.q_row_stride = p.out_row_stride = p.k_row_stride = p.v_row_stride = 128;
  p.num_seqs = 1;
  p.max_seqlen = 16;
  p.num_heads = p.num_kv_heads = 1;
  p.head_dim = 128;
  p.softmax_scale = 0.088f;
  EXPECT_TRUE(ValidateFlashAttentionParams(p).ok());
  p.window = 7;
  EXPECT_TRUE(ValidateFlashAttentionParams(p).ok());
  p.window = -1;
  const absl::Status refused = ValidateFlashAttentionParams(p);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("window"), absl::string_view::npos) << refused;
}

// An empty batch launches nothing and succeeds.
TEST(FlashAttentionGridTest, ZeroSequencesIsANoOp) {
  if (!testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  DeviceBuffer d(64);
  FlashAttentionParams p;
  p.q = p.k = p.v = d.get();
  p.out = d.get();
  p.cu_seqlens = static_cast<const int32_t*>(d.get());
  p.q_row_stride = p.out_row_stride = 128;
  p.k_row_stride = p.v_row_stride = 128;
  p.num_seqs = 0;
  p.max_seqlen = 0;
  p.num_heads = p.num_kv_heads = 1;
  p.head_dim = 128;
  p.softmax_scale = 0.088f;
  const absl::StatusOr<DeviceInfo> dev = CurrentDeviceInfo();
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_TRUE(LaunchFlashAttention(p, *dev, nullptr).ok());
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace layerserve::kernels
