// Each CPU operator against the float64 reference (tests/reference) on random
// inputs with fixed seeds: sequence lengths 1, odd and longer than the
// attention query block, several packed sequences, GQA ratios 1/2/4, head_dim
// 64 and 128, with and without the thread pool. A session step (sequences
// that start past position 0, queries fewer than keys) is checked as the tail
// of the whole sequence the reference computes from position 0.
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

// Qwen3's q/k norm: each q head with one weight, each k head with the other,
// and the v heads after them untouched.
TEST(CpuOpsTest, HeadRmsNormNormalisesEachQAndKHead) {
  ThreadPool pool(2);
  Rng rng(9);
  const int64_t rows = 5, q_heads = 4, k_heads = 2, v_heads = 2, d = 64;
  const int64_t stride = (q_heads + k_heads + v_heads) * d;
  const std::vector<float> x = RandomFloats(rng, rows * stride, -3, 3);
  const std::vector<float> qw = RandomFloats(rng, d, 0.5, 1.5);
  const std::vector<float> kw = RandomFloats(rng, d, 0.5, 1.5);
  std::vector<float> got = x;
  HeadRmsNorm(got.data(), rows, stride, q_heads, k_heads, d, qw.data(), kw.data(), 1e-6f, &pool);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < q_heads + k_heads + v_heads; ++h) {
      SCOPED_TRACE(::testing::Message() << "row " << r << " head " << h);
      const size_t at = static_cast<size_t>(r * stride + h * d);
      const std::vector<float> head(x.begin() + at, x.begin() + at + d);
      const std::vector<float> out(got.begin() + at, got.begin() + at + d);
      if (h >= q_heads + k_heads) {
        EXPECT_EQ(out, head);
        continue;
      }
      const std::vector<double> want = reference::RmsNorm(
          ToDouble(head), 1, d, ToDouble(h < q_heads ? qw : kw), static_cast<double>(1e-6f));
      EXPECT_TRUE(AllClose(out, want, kFp32Tol));
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
      ApplyRope(x.data(), stride, heads, head_dim, cu, {}, inv_freq, &pool);

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

// Sequences that start at positions 5, 0 and 29 rotate as the tails of whole
// sequences the reference rotates from position 0. (Positions stay below 40,
// as above: the float32 angle's rounding grows with the position.)
TEST(CpuOpsTest, RopeFromStartPositions) {
  ThreadPool pool(3);
  Rng rng(7);
  const int64_t heads = 2, head_dim = 64, width = heads * head_dim;
  const std::vector<int32_t> cu = {0, 3, 4, 11};
  const std::vector<int64_t> starts = {5, 0, 29};
  reference::Config rc;
  rc.head_dim = head_dim;
  rc.rope_theta = 10000.0;
  std::vector<float> inv_freq;
  for (double f : reference::RopeInvFreq(rc)) inv_freq.push_back(static_cast<float>(f));

  std::vector<float> x = RandomFloats(rng, cu.back() * width);
  std::vector<double> want(x.size());
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    // The whole sequence: starts[s] rows the step does not hold, then its own.
    const int64_t len = cu[s + 1] - cu[s];
    std::vector<double> whole = ToDouble(RandomFloats(rng, starts[s] * width));
    whole.insert(whole.end(), x.begin() + cu[s] * width, x.begin() + cu[s + 1] * width);
    reference::Rope(whole, heads, head_dim, {0, static_cast<int32_t>(starts[s] + len)},
                    ToDouble(inv_freq));
    std::copy(whole.end() - len * width, whole.end(), want.begin() + cu[s] * width);
  }
  ApplyRope(x.data(), width, heads, head_dim, cu, starts, inv_freq, &pool);
  EXPECT_TRUE(AllClose(x, want, 4e-6));
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
      CausalAttention(args, c.cu_seqlens, {}, p);
      const std::vector<double> want =
          reference::Attention(ToDouble(q), ToDouble(k), ToDouble(v), c.cu_seqlens, c.heads,
                               c.kv_heads, c.head_dim, c.window);
      EXPECT_TRUE(AllClose(out, want, 1e-5));
    }
  }
}

// Queries that are the last lq of a sequence's lk positions (a session step
// over cached keys) must equal the last lq rows the reference computes over
// the whole sequence.
struct CachedAttentionCase {
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  std::vector<std::pair<int32_t, int32_t>> lengths;  // (lq, lk) per sequence
  int64_t window = 0;
};

TEST(CpuOpsTest, AttentionOverCachedKeys) {
  ThreadPool pool(3);
  Rng rng(8);
  const std::vector<CachedAttentionCase> cases = {
      {4, 2, 64, {{1, 1}, {1, 9}, {3, 20}}},      // decode steps and a short chunk
      {8, 2, 128, {{1, 300}}},                    // one query, keys past a query block
      {4, 1, 64, {{200, 330}, {0, 4}, {5, 5}}},   // a chunk over two query blocks; no queries
      {4, 2, 64, {{1, 9}, {3, 20}, {7, 40}}, 4},  // windows shorter than the cache
      {2, 1, 128, {{150, 400}}, 200},             // a window inside a query block's keys
      {2, 2, 64, {{2, 10}}, 1},                   // each query sees only itself
  };
  for (const CachedAttentionCase& c : cases) {
    const int64_t qw = c.heads * c.head_dim;
    const int64_t kvw = c.kv_heads * c.head_dim;
    std::vector<int32_t> cu_q = {0}, cu_k = {0};
    for (const auto& [lq, lk] : c.lengths) {
      cu_q.push_back(cu_q.back() + lq);
      cu_k.push_back(cu_k.back() + lk);
    }
    // Queries for every position; the step holds only the last lq of each.
    const std::vector<float> q_whole = RandomFloats(rng, cu_k.back() * qw, -2, 2);
    const std::vector<float> k = RandomFloats(rng, cu_k.back() * kvw, -2, 2);
    const std::vector<float> v = RandomFloats(rng, cu_k.back() * kvw);
    const std::vector<double> whole =
        reference::Attention(ToDouble(q_whole), ToDouble(k), ToDouble(v), cu_k, c.heads, c.kv_heads,
                             c.head_dim, c.window);
    std::vector<float> q;
    std::vector<double> want;
    for (size_t s = 0; s + 1 < cu_k.size(); ++s) {
      const int64_t tail = (cu_k[s + 1] - (cu_q[s + 1] - cu_q[s])) * qw;
      q.insert(q.end(), q_whole.begin() + tail, q_whole.begin() + cu_k[s + 1] * qw);
      want.insert(want.end(), whole.begin() + tail, whole.begin() + cu_k[s + 1] * qw);
    }
    for (ThreadPool* p : {&pool, static_cast<ThreadPool*>(nullptr)}) {
      SCOPED_TRACE(::testing::Message()
                   << "heads " << c.heads << " kv " << c.kv_heads << " d " << c.head_dim << " keys "
                   << cu_k.back() << " window " << c.window << (p ? " pool" : " inline"));
      std::vector<float> out(q.size(), NAN);
      AttentionArgs args{q.data(), qw,      k.data(),   v.data(),   kvw,     out.data(),
                         qw,       c.heads, c.kv_heads, c.head_dim, c.window};
      CausalAttention(args, cu_q, cu_k, p);
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
  CausalAttention(args, cu, {}, nullptr);
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
  // cached > 0: the queries are the last tokens - cached positions, as in a
  // session step.
  for (const int64_t cached : {int64_t{0}, int64_t{100}}) {
    const std::vector<int32_t> cu_q = {0, static_cast<int32_t>(tokens - cached)};
    const std::vector<int32_t> cu_k = {0, static_cast<int32_t>(tokens)};
    for (const int64_t window : {int64_t{0}, int64_t{7}, int64_t{150}}) {
      for (const int64_t bad : {int64_t{0}, int64_t{60}, int64_t{200}}) {
        for (const float poison : {NAN, INFINITY}) {
          SCOPED_TRACE(::testing::Message() << "cached " << cached << " window " << window
                                            << " bad token " << bad << " value " << poison);
          const std::vector<float> q = RandomFloats(rng, cu_q.back() * qw, -2, 2);
          std::vector<float> k = RandomFloats(rng, tokens * kvw, -2, 2);
          std::vector<float> v = RandomFloats(rng, tokens * kvw);
          for (int64_t c = 0; c < kvw; ++c) {
            k[bad * kvw + c] = poison;
            v[bad * kvw + c] = poison;
          }
          std::vector<float> out(q.size(), NAN);
          AttentionArgs args{q.data(), qw,    k.data(), v.data(), kvw,   out.data(),
                             qw,       heads, kv_heads, d,        window};
          CausalAttention(args, cu_q, cu_k, &pool);
          for (int64_t t = 0; t < cu_q.back(); ++t) {
            const int64_t position = cached + t;
            const bool sees_bad = position >= bad && (window == 0 || position - bad < window);
            if (sees_bad) continue;
            for (int64_t c = 0; c < qw; ++c) {
              ASSERT_TRUE(std::isfinite(out[t * qw + c]))
                  << "position " << position << " column " << c;
            }
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

TEST(CpuOpsTest, RouteTopKMatchesReference) {
  Rng rng(6);
  for (const auto& [experts, top_k, normalize] : {std::tuple{8, 2, true},
                                                  {4, 1, true},
                                                  {16, 4, true},
                                                  {3, 3, true},
                                                  {60, 4, false},
                                                  {8, 2, false}}) {
    SCOPED_TRACE(::testing::Message() << experts << " experts, top " << top_k
                                      << (normalize ? ", renormalised" : ", as they are"));
    const int64_t rows = 25;
    const std::vector<float> logits = RandomFloats(rng, rows * experts, -4, 4);
    std::vector<int32_t> ids(rows * top_k, -1);
    std::vector<float> weights(rows * top_k, NAN);
    RouteTopK(logits.data(), rows, experts, top_k, normalize, ids.data(), weights.data());
    const std::vector<reference::Routing> want =
        reference::RouteTopK(ToDouble(logits), rows, experts, top_k, normalize);
    for (int64_t r = 0; r < rows; ++r) {
      const reference::Routing& w = want[r];
      // Only a margin wider than float32 rounding fixes the expected order.
      if (w.margin < 1e-5) continue;
      for (int64_t j = 0; j < top_k; ++j) {
        EXPECT_EQ(ids[r * top_k + j], w.experts[j]) << "row " << r << " choice " << j;
        EXPECT_NEAR(weights[r * top_k + j], w.weights[j], 1e-6) << "row " << r << " choice " << j;
      }
    }
  }
}

TEST(CpuOpsTest, RouteTopKTiesAndPoisonedRows) {
  // Equal logits: the lower index first, equal weights.
  const std::vector<float> ties = {1, 3, 3, 0};
  std::vector<int32_t> ids(2);
  std::vector<float> weights(2);
  RouteTopK(ties.data(), 1, 4, 2, /*normalize=*/true, ids.data(), weights.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(weights[0], 0.5f);
  EXPECT_FLOAT_EQ(weights[1], 0.5f);
  // A NaN or infinite logit (a poisoned token) still yields valid, distinct
  // expert ids; the next row is routed as if alone.
  const std::vector<float> poisoned = {0, NAN, 2, 1, INFINITY, 0, -INFINITY, 5, 1, 2, 3, 4};
  std::vector<int32_t> pids(3 * 2, -1);
  std::vector<float> pweights(3 * 2);
  RouteTopK(poisoned.data(), 3, 4, 2, /*normalize=*/true, pids.data(), pweights.data());
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_GE(pids[2 * r], 0);
    EXPECT_LT(pids[2 * r], 4);
    EXPECT_GE(pids[2 * r + 1], 0);
    EXPECT_LT(pids[2 * r + 1], 4);
    EXPECT_NE(pids[2 * r], pids[2 * r + 1]);
  }
  EXPECT_EQ(pids[4], 3);
  EXPECT_EQ(pids[5], 2);
  EXPECT_TRUE(std::isfinite(pweights[4]) && std::isfinite(pweights[5]));
}

TEST(CpuOpsTest, ExpertMlpsMatchReference) {
  ThreadPool pool(3);
  Rng rng(7);
  const int64_t hidden = 64;
  const int64_t inter = 48;
  // 1 row (most experts idle), a few, and more rows than experts.
  for (const auto& [rows, experts, top_k] :
       {std::tuple{1, 8, 2}, {5, 8, 2}, {37, 4, 1}, {20, 6, 3}}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows, " << experts << " experts, top " << top_k);
    reference::Config config;
    config.hidden = hidden;
    config.intermediate = inter;
    config.experts = experts;
    config.top_k = top_k;
    const std::vector<float> x = RandomFloats(rng, rows * hidden);
    const std::vector<float> router = RandomFloats(rng, experts * hidden, -0.5, 0.5);
    const std::vector<float> gate_up = RandomFloats(rng, experts * 2 * inter * hidden, -0.2, 0.2);
    const std::vector<float> down = RandomFloats(rng, experts * hidden * inter, -0.2, 0.2);
    reference::Layer layer;
    layer.router = ToDouble(router);
    layer.experts_gate_up = ToDouble(gate_up);
    layer.experts_down = ToDouble(down);
    const std::vector<double> moe = reference::ExpertMlps(ToDouble(x), rows, config, layer);

    std::vector<float> logits(rows * experts);
    Linear(x.data(), rows, hidden, router.data(), experts, nullptr, logits.data(), &pool);
    std::vector<int32_t> ids(rows * top_k);
    std::vector<float> weights(rows * top_k);
    RouteTopK(logits.data(), rows, experts, top_k, /*normalize=*/true, ids.data(), weights.data());
    // The output accumulates onto what it holds (the residual).
    const std::vector<float> residual = RandomFloats(rng, rows * hidden);
    std::vector<float> out = residual;
    const ExpertWeights w{.gate_up = gate_up.data(),
                          .down = down.data(),
                          .experts = experts,
                          .hidden = hidden,
                          .intermediate = inter};
    ExpertMlps(x.data(), rows, ids.data(), weights.data(), top_k, w, out.data(), &pool);
    std::vector<double> want(moe.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = residual[i] + moe[i];
    EXPECT_TRUE(AllClose(out, want, kFp32Tol));
  }
}

}  // namespace
}  // namespace layerserve::cpu
