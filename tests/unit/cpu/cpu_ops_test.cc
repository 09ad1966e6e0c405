// Each CPU operator against the float64 reference (tests/reference) on random
// inputs with fixed seeds: sequence lengths 1, odd and longer than the
// attention query block, several packed sequences, GQA ratios 1/2/4, head_dim
// 64 and 128, with and without the thread pool.
#include "server/cpu/cpu_ops.h"

#include <atomic>
#include <cmath>

#include "gtest/gtest.h"
#include "tests/reference/llama_reference.h"
#include "tests/unit/cpu/test_util.h"

namespace layerserve::cpu {
namespace {

using cpu_test::AllClose;
using cpu_test::RandomFloats;
using cpu_test::Rng;
using cpu_test::ToDouble;

// fp32 against float64 with reductions of up to a few hundred terms: a few
// fp32 ulps, scaled as in AllClose.
constexpr double kFp32Tol = 2e-6;

TEST(ThreadPoolTest, RunsEveryIndexOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (int repeat = 0; repeat < 3; ++repeat) {
        pool.ParallelFor(n, [&](int64_t i) { hits[static_cast<size_t>(i)]++; });
      }
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 3) << "threads " << threads << " n " << n;
      }
    }
  }
}

TEST(CpuOpsTest, RmsNorm) {
  ThreadPool pool(2);
  Rng rng(1);
  for (int64_t rows : {1, 7, 33}) {
    for (int64_t cols : {64, 96}) {
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " cols " << cols);
      const std::vector<float> x = RandomFloats(rng, rows * cols, -3, 3);
      const std::vector<float> w = RandomFloats(rng, cols, 0.5, 1.5);
      std::vector<float> out(x.size(), NAN);
      RmsNorm(x.data(), rows, cols, w.data(), 1e-5f, out.data(), &pool);
      const std::vector<double> want =
          reference::RmsNorm(ToDouble(x), rows, cols, ToDouble(w), static_cast<double>(1e-5f));
      EXPECT_TRUE(AllClose(out, want, kFp32Tol));
      // In place, without a pool.
      std::vector<float> inplace = x;
      RmsNorm(inplace.data(), rows, cols, w.data(), 1e-5f, inplace.data(), nullptr);
      EXPECT_TRUE(AllClose(inplace, want, kFp32Tol));
    }
  }
}

TEST(CpuOpsTest, LinearWithAndWithoutBias) {
  ThreadPool pool(3);
  Rng rng(2);
  for (int64_t rows : {1, 5, 37}) {
    for (int64_t in : {64, 96}) {
      // 200 columns split into slices of 80, 80 and 40 across the pool.
      for (int64_t out_features : {80, 200}) {
        for (ThreadPool* p : {&pool, static_cast<ThreadPool*>(nullptr)}) {
          SCOPED_TRACE(::testing::Message() << "rows " << rows << " in " << in << " out "
                                            << out_features << (p ? " pool" : " inline"));
          const std::vector<float> x = RandomFloats(rng, rows * in);
          const std::vector<float> w = RandomFloats(rng, out_features * in);
          const std::vector<float> b = RandomFloats(rng, out_features);
          const std::vector<double> prod =
              reference::Linear(ToDouble(x), rows, in, ToDouble(w), out_features, {});
          std::vector<float> y(rows * out_features, NAN);
          Linear(x.data(), rows, in, w.data(), out_features, nullptr, y.data(), p);
          EXPECT_TRUE(AllClose(y, prod, kFp32Tol));

          std::fill(y.begin(), y.end(), NAN);
          Linear(x.data(), rows, in, w.data(), out_features, b.data(), y.data(), p);
          EXPECT_TRUE(AllClose(
              y, reference::Linear(ToDouble(x), rows, in, ToDouble(w), out_features, ToDouble(b)),
              kFp32Tol));

          // Accumulate adds onto what is there (the residual).
          std::vector<float> acc = RandomFloats(rng, rows * out_features);
          std::vector<double> want = ToDouble(acc);
          for (size_t i = 0; i < want.size(); ++i) want[i] += prod[i];
          LinearAccumulate(x.data(), rows, in, w.data(), out_features, acc.data(), p);
          EXPECT_TRUE(AllClose(acc, want, kFp32Tol));
        }
      }
    }
  }
}

TEST(CpuOpsTest, RopeOnPackedSequences) {
  ThreadPool pool(3);
  Rng rng(3);
  const std::vector<std::vector<int32_t>> layouts = {{0, 1}, {0, 5, 12, 13}, {0, 37}, {0, 0, 3}};
  for (int64_t head_dim : {64, 128}) {
    for (const auto& cu : layouts) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " tokens " << cu.back());
      const int64_t heads = 3;
      // Rotate only the first `heads` heads of a wider row, as in fused qkv;
      // the last head must stay untouched.
      const int64_t stride = (heads + 1) * head_dim;
      const int64_t tokens = cu.back();
      std::vector<float> x = RandomFloats(rng, tokens * stride);
      reference::Config rc;
      rc.head_dim = head_dim;
      rc.rope_theta = 10000.0;
      std::vector<float> inv_freq;
      for (double f : reference::RopeInvFreq(rc)) inv_freq.push_back(static_cast<float>(f));

      std::vector<double> want_rotated(tokens * heads * head_dim);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t c = 0; c < heads * head_dim; ++c) {
          want_rotated[t * heads * head_dim + c] = x[t * stride + c];
        }
      }
      reference::Rope(want_rotated, heads, head_dim, cu, ToDouble(inv_freq));
      const std::vector<float> original = x;
      ApplyRope(x.data(), stride, heads, head_dim, cu, inv_freq, &pool);

      std::vector<float> got_rotated(want_rotated.size());
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t c = 0; c < heads * head_dim; ++c) {
          got_rotated[t * heads * head_dim + c] = x[t * stride + c];
        }
        for (int64_t c = heads * head_dim; c < stride; ++c) {
          ASSERT_EQ(x[t * stride + c], original[t * stride + c]) << "token " << t << " col " << c;
        }
      }
      EXPECT_TRUE(AllClose(got_rotated, want_rotated, 4e-6));
    }
  }
}

struct AttentionCase {
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  std::vector<int32_t> cu_seqlens;
  int64_t window = 0;  // sliding window; 0: full causal
};

TEST(CpuOpsTest, CausalGqaAttention) {
  ThreadPool pool(3);
  Rng rng(4);
  const std::vector<AttentionCase> cases = {
      {4, 4, 64, {0, 1}},               // ratio 1, single token
      {4, 2, 64, {0, 1, 8, 27}},        // ratio 2, three sequences
      {8, 2, 128, {0, 13, 14, 45}},     // ratio 4, head_dim 128
      {4, 1, 64, {0, 300}},             // crosses the 128-row query blocks
      {2, 2, 128, {0, 129, 130, 259}},  // block edges at 128 / 129
      // Sliding windows (query i sees keys i-window+1..i):
      {4, 2, 64, {0, 1, 8, 27}, 1},         // each query sees only itself
      {4, 2, 64, {0, 9, 40}, 5},            // shorter than the sequences
      {4, 1, 64, {0, 300}, 100},            // shorter than a 128-row query block
      {2, 1, 128, {0, 300, 555}, 200},      // longer than a block, shorter than the sequences
      {2, 2, 64, {0, 129, 130, 259}, 129},  // equal to a sequence: full causal
      {2, 2, 64, {0, 50}, 4096},            // longer than every sequence
  };
  for (const AttentionCase& c : cases) {
    for (ThreadPool* p : {&pool, static_cast<ThreadPool*>(nullptr)}) {
      SCOPED_TRACE(::testing::Message() << "heads " << c.heads << " kv " << c.kv_heads << " d "
                                        << c.head_dim << " tokens " << c.cu_seqlens.back()
                                        << " window " << c.window << (p ? " pool" : " inline"));
      const int64_t tokens = c.cu_seqlens.back();
      const int64_t qw = c.heads * c.head_dim;
      const int64_t kvw = c.kv_heads * c.head_dim;
      // Scores of a few units: softmax neither uniform nor one-hot.
      const std::vector<float> q = RandomFloats(rng, tokens * qw, -2, 2);
      const std::vector<float> k = RandomFloats(rng, tokens * kvw, -2, 2);
      const std::vector<float> v = RandomFloats(rng, tokens * kvw);
      std::vector<float> out(tokens * qw, NAN);
      AttentionArgs args;
      args.q = q.data();
      args.q_stride = qw;
      args.k = k.data();
      args.v = v.data();
      args.kv_stride = kvw;
      args.out = out.data();
      args.out_stride = qw;
      args.num_heads = c.heads;
      args.num_kv_heads = c.kv_heads;
      args.head_dim = c.head_dim;
      args.window = c.window;
      CausalAttention(args, c.cu_seqlens, p);
      const std::vector<double> want =
          reference::Attention(ToDouble(q), ToDouble(k), ToDouble(v), c.cu_seqlens, c.heads,
                               c.kv_heads, c.head_dim, c.window);
      EXPECT_TRUE(AllClose(out, want, 1e-5));
    }
  }
}

TEST(CpuOpsTest, AttentionSoftmaxSurvivesLargeScores) {
  // Scores near 1e4 overflow exp() without the max subtraction.
  const int64_t d = 64;
  const std::vector<int32_t> cu = {0, 5};
  std::vector<float> q(5 * d, 12.0f), k(5 * d, 12.0f), v(5 * d);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 7);
  std::vector<float> out(5 * d, NAN);
  AttentionArgs args{q.data(), d, k.data(), v.data(), d, out.data(), d, 1, 1, d};
  CausalAttention(args, cu, nullptr);
  const std::vector<double> want =
      reference::Attention(ToDouble(q), ToDouble(k), ToDouble(v), cu, 1, 1, d);
  EXPECT_TRUE(AllClose(out, want, 1e-5));
}

// A NaN or Inf in the key and value of one token must reach only the queries
// that see that token: never an earlier token (keys after a query are not
// read at all) and never a token past the window.
TEST(CpuOpsTest, AttentionKeepsNonFiniteTokensToThoseThatSeeThem) {
  ThreadPool pool(3);
  Rng rng(6);
  const int64_t heads = 4, kv_heads = 2, d = 64, tokens = 300;
  const int64_t qw = heads * d, kvw = kv_heads * d;
  const std::vector<int32_t> cu = {0, tokens};
  for (const int64_t window : {int64_t{0}, int64_t{7}, int64_t{150}}) {
    for (const int64_t bad : {int64_t{0}, int64_t{60}, int64_t{200}}) {
      for (const float poison : {NAN, INFINITY}) {
        SCOPED_TRACE(::testing::Message()
                     << "window " << window << " bad token " << bad << " value " << poison);
        const std::vector<float> q = RandomFloats(rng, tokens * qw, -2, 2);
        std::vector<float> k = RandomFloats(rng, tokens * kvw, -2, 2);
        std::vector<float> v = RandomFloats(rng, tokens * kvw);
        for (int64_t c = 0; c < kvw; ++c) {
          k[bad * kvw + c] = poison;
          v[bad * kvw + c] = poison;
        }
        std::vector<float> out(tokens * qw, NAN);
        AttentionArgs args{q.data(), qw,    k.data(), v.data(), kvw,   out.data(),
                           qw,       heads, kv_heads, d,        window};
        CausalAttention(args, cu, &pool);
        for (int64_t t = 0; t < tokens; ++t) {
          const bool sees_bad = t >= bad && (window == 0 || t - bad < window);
          if (sees_bad) continue;
          for (int64_t c = 0; c < qw; ++c) {
            ASSERT_TRUE(std::isfinite(out[t * qw + c])) << "token " << t << " column " << c;
          }
        }
      }
    }
  }
}

TEST(CpuOpsTest, SiluMul) {
  ThreadPool pool(2);
  Rng rng(5);
  for (int64_t rows : {1, 9, 40}) {
    const int64_t inter = 40;
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    const std::vector<float> gate_up = RandomFloats(rng, rows * 2 * inter, -8, 8);
    std::vector<double> gate, up;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < inter; ++j) {
        gate.push_back(gate_up[r * 2 * inter + j]);
        up.push_back(gate_up[r * 2 * inter + inter + j]);
      }
    }
    std::vector<float> out(rows * inter, NAN);
    SiluMul(gate_up.data(), rows, inter, out.data(), &pool);
    EXPECT_TRUE(AllClose(out, reference::SiluMul(gate, up), kFp32Tol));
  }
}

}  // namespace
}  // namespace layerserve::cpu
