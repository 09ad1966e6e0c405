// CPU operators of a decoder layer (see cpu_ops.h): CBLAS for every matrix
// product, plain loops for the element-wise parts, and one thread pool that
// splits GEMMs by output columns, attention by (sequence, head, query block)
// and element-wise work by rows.
#include "server/cpu/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/functional/function_ref.h"
#include "base/dtype.h"

namespace layerserve::cpu {
namespace {

// Rows per task for the cheap element-wise operators: large enough that a
// task outweighs the hand-off, small enough to balance short batches.
constexpr int64_t kRowsPerTask = 16;

// Query rows per attention task. Bounds the score scratch to
// kQueryBlock x sequence_length floats per thread, and gives long single
// sequences enough tasks to use every thread.
constexpr int64_t kQueryBlock = 128;

// Narrowest output slice a GEMM is split into; below this a thread hand-off
// costs more than it saves.
constexpr int64_t kMinSliceColumns = 64;

void ParallelRows(ThreadPool* pool, int64_t rows,
                  absl::FunctionRef<void(int64_t begin, int64_t end)> fn) {
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  if (pool == nullptr || tasks <= 1) {
    fn(0, rows);
    return;
  }
  pool->ParallelFor(
      tasks, [&](int64_t t) { fn(t * kRowsPerTask, std::min(rows, (t + 1) * kRowsPerTask)); });
}

// y[:, n0:n1] = x W[n0:n1]^T + beta y[:, n0:n1] for one column slice per
// thread: each thread streams its own rows of W once, which is also what
// matters when `rows` is small and the GEMM is bound by weight reads.
void Gemm(const float* x, int64_t rows, int64_t in_features, const float* weight,
          int64_t out_features, float beta, float* y, ThreadPool* pool) {
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  const int64_t slices = std::clamp<int64_t>(out_features / kMinSliceColumns, 1, threads);
  // Slices in multiples of 16 columns keep every slice on whole SIMD panels.
  const int64_t per_slice = ((out_features + slices - 1) / slices + 15) / 16 * 16;
  const auto slice = [&](int64_t s) {
    const int64_t begin = s * per_slice;
    const int64_t end = std::min(out_features, begin + per_slice);
    if (begin >= end) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(end - begin), static_cast<int>(in_features), 1.0f, x,
                static_cast<int>(in_features), weight + begin * in_features,
                static_cast<int>(in_features), beta, y + begin, static_cast<int>(out_features));
  };
  if (slices == 1) {
    slice(0);
  } else {
    pool->ParallelFor(slices, slice);
  }
}

// y = weight * (x / rms(x)) over one row of n, the sum of squares in double;
// y may be x.
void NormRow(const float* x, int64_t n, const float* weight, float eps, float* y) {
  double sum_sq = 0;
  for (int64_t c = 0; c < n; ++c) sum_sq += static_cast<double>(x[c]) * x[c];
  const float variance = static_cast<float>(sum_sq / static_cast<double>(n));
  const float inv_rms = 1.0f / std::sqrt(variance + eps);
  for (int64_t c = 0; c < n; ++c) y[c] = weight[c] * (x[c] * inv_rms);
}

}  // namespace

void UseSingleThreadedBlas() { openblas_set_num_threads(1); }

void RmsNorm(const float* x, int64_t rows, int64_t cols, const float* weight, float eps, float* out,
             ThreadPool* pool) {
  ParallelRows(pool, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) NormRow(x + r * cols, cols, weight, eps, out + r * cols);
  });
}

void HeadRmsNorm(float* x, int64_t rows, int64_t stride, int64_t q_heads, int64_t k_heads,
                 int64_t head_dim, const float* q_weight, const float* k_weight, float eps,
                 ThreadPool* pool) {
  ParallelRows(pool, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < q_heads + k_heads; ++h) {
        float* v = x + r * stride + h * head_dim;
        NormRow(v, head_dim, h < q_heads ? q_weight : k_weight, eps, v);
      }
    }
  });
}

void Linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
            int64_t out_features, const float* bias, float* y, ThreadPool* pool) {
  if (rows == 0) return;
  float beta = 0.0f;
  if (bias != nullptr) {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(bias, out_features, y + r * out_features);
    beta = 1.0f;
  }
  Gemm(x, rows, in_features, weight, out_features, beta, y, pool);
}

void LinearAccumulate(const float* x, int64_t rows, int64_t in_features, const float* weight,
                      int64_t out_features, float* y, ThreadPool* pool) {
  if (rows == 0) return;
  Gemm(x, rows, in_features, weight, out_features, 1.0f, y, pool);
}

void ApplyRope(float* x, int64_t stride, int64_t num_heads, int64_t head_dim,
               std::span<const int32_t> cu_seqlens, std::span<const int64_t> start_positions,
               std::span<const float> inv_freq, ThreadPool* pool) {
  if (cu_seqlens.size() < 2) return;
  const int64_t half = head_dim / 2;
  const int64_t num_sequences = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const int64_t total = cu_seqlens.back();
  ParallelRows(pool, total, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_row(static_cast<size_t>(half));
    std::vector<float> sin_row(static_cast<size_t>(half));
    // The sequence holding row `begin`; rows advance monotonically from there.
    int64_t s =
        std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), begin) - cu_seqlens.begin() - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (s + 1 < num_sequences && t >= cu_seqlens[s + 1]) ++s;
      const int64_t start = start_positions.empty() ? 0 : start_positions[s];
      const float pos = static_cast<float>(start + t - cu_seqlens[s]);
      for (int64_t i = 0; i < half; ++i) {
        // float32 angle as in HF, then cos/sin of exactly that angle.
        const double angle = static_cast<double>(pos * inv_freq[i]);
        cos_row[i] = static_cast<float>(std::cos(angle));
        sin_row[i] = static_cast<float>(std::sin(angle));
      }
      float* row = x + t * stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* v = row + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i];
          const float b = v[i + half];
          v[i] = a * cos_row[i] - b * sin_row[i];
          v[i + half] = b * cos_row[i] + a * sin_row[i];
        }
      }
    }
  });
}

void CausalAttention(const AttentionArgs& args, std::span<const int32_t> cu_seqlens_q,
                     std::span<const int32_t> cu_seqlens_k, ThreadPool* pool) {
  if (cu_seqlens_k.empty()) cu_seqlens_k = cu_seqlens_q;
  // Rows are indexed globally: query rows in q and out, key rows in k and v.
  // Query row i sees key rows [first_key(i), i + shift], where shift maps the
  // sequence's last query row onto its last key row (bottom-right alignment).
  struct QueryBlock {
    int64_t seq_key_begin;  // first key row of the sequence
    int64_t shift;          // key row of query row i's own position: i + shift
    int64_t begin;          // query rows [begin, end)
    int64_t end;
  };
  std::vector<QueryBlock> blocks;
  for (size_t s = 0; s + 1 < cu_seqlens_q.size(); ++s) {
    const int64_t shift = int64_t{cu_seqlens_k[s + 1]} - cu_seqlens_q[s + 1];
    for (int64_t b = cu_seqlens_q[s]; b < cu_seqlens_q[s + 1]; b += kQueryBlock) {
      blocks.push_back(
          {cu_seqlens_k[s], shift, b, std::min<int64_t>(b + kQueryBlock, cu_seqlens_q[s + 1])});
    }
  }
  const int64_t d = args.head_dim;
  const int64_t group = args.num_heads / args.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  const auto task = [&](int64_t index) {
    const QueryBlock& blk = blocks[static_cast<size_t>(index / args.num_heads)];
    const int64_t h = index % args.num_heads;
    const int64_t kv_h = h / group;
    const int64_t rows = blk.end - blk.begin;
    // Query row i sees key rows [first_key(i), last_key(i)].
    const auto last_key = [&](int64_t i) { return i + blk.shift; };
    const auto first_key = [&](int64_t i) {
      return args.window > 0 ? std::max(blk.seq_key_begin, last_key(i) - args.window + 1)
                             : blk.seq_key_begin;
    };
    // Scores cover key rows [k0, k0 + keys): every key some row of the block sees.
    const int64_t k0 = first_key(blk.begin);
    const int64_t keys = last_key(blk.end - 1) + 1 - k0;
    // Per-thread scratch that keeps its high-water mark: at most
    // kQueryBlock x (kQueryBlock + window, or the most keys of a sequence) floats.
    thread_local std::vector<float> scores;
    scores.resize(static_cast<size_t>(rows * keys));

    const float* q = args.q + blk.begin * args.q_stride + h * d;
    const float* k = args.k + kv_h * d;
    const float* v = args.v + kv_h * d;
    float* out = args.out + h * d;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(keys), static_cast<int>(d), scale, q,
                static_cast<int>(args.q_stride), k + k0 * args.kv_stride,
                static_cast<int>(args.kv_stride), 0.0f, scores.data(), static_cast<int>(keys));
    // Softmax of each row over the keys it sees; the other scores stay as they
    // are and are never read again.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = blk.begin + r;
      float* p = scores.data() + r * keys + (first_key(i) - k0);
      const int64_t visible = last_key(i) - first_key(i) + 1;
      // Subtracting the row maximum keeps every exp() in (0, 1].
      const float max_score = *std::max_element(p, p + visible);
      double sum = 0;
      for (int64_t j = 0; j < visible; ++j) {
        p[j] = std::exp(p[j] - max_score);
        sum += p[j];
      }
      const float inv_sum = static_cast<float>(1.0 / sum);
      for (int64_t j = 0; j < visible; ++j) p[j] *= inv_sum;
    }
    // P V in two parts, so that no row multiplies a value row it does not see
    // (0 x NaN is NaN): keys [c0, c1] that every row of the block sees go
    // through one GEMM; each row adds its own remaining keys, at most
    // kQueryBlock - 1 on the diagonal plus, with a window, its left edge.
    const int64_t c0 = first_key(blk.end - 1);
    const int64_t c1 = last_key(blk.begin);
    float* out_rows = out + blk.begin * args.out_stride;
    if (c0 <= c1) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                  static_cast<int>(d), static_cast<int>(c1 - c0 + 1), 1.0f,
                  scores.data() + (c0 - k0), static_cast<int>(keys), v + c0 * args.kv_stride,
                  static_cast<int>(args.kv_stride), 0.0f, out_rows,
                  static_cast<int>(args.out_stride));
    } else {
      for (int64_t r = 0; r < rows; ++r) std::fill_n(out_rows + r * args.out_stride, d, 0.0f);
    }
    // out_row += p[a..b] V[a..b] for the keys a..b (inclusive) outside [c0, c1].
    const auto add_keys = [&](int64_t r, int64_t a, int64_t b) {
      if (a > b) return;
      cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<int>(b - a + 1), static_cast<int>(d), 1.0f,
                  v + a * args.kv_stride, static_cast<int>(args.kv_stride),
                  scores.data() + r * keys + (a - k0), 1, 1.0f, out_rows + r * args.out_stride, 1);
    };
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = blk.begin + r;
      if (c0 <= c1) {
        add_keys(r, first_key(i), c0 - 1);
        add_keys(r, c1 + 1, last_key(i));
      } else {
        add_keys(r, first_key(i), last_key(i));
      }
    }
  };
  const int64_t num_tasks = static_cast<int64_t>(blocks.size()) * args.num_heads;
  if (pool == nullptr) {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
  } else {
    pool->ParallelFor(num_tasks, task);
  }
}

void SiluMul(const float* gate_up, int64_t rows, int64_t intermediate, float* out,
             ThreadPool* pool) {
  ParallelRows(pool, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * intermediate;
      const float* up = gate + intermediate;
      float* o = out + r * intermediate;
      for (int64_t j = 0; j < intermediate; ++j) {
        o[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
      }
    }
  });
}

void QuantizeDequantizeFp8(float* x, int64_t rows, int64_t cols, const Fp8InputQuant& q,
                           ThreadPool* pool) {
  if (!q.enabled) return;
  const int64_t group = q.group > 0 ? q.group : cols;
  ParallelRows(pool, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < cols; g += group) {
        float* v = x + r * cols + g;
        const int64_t n = std::min(group, cols - g);
        float scale = q.static_scale;
        if (!(scale > 0)) {
          float amax = 0;
          for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
          if (amax == 0) continue;  // all zero: stays zero whatever the scale
          scale = amax / kFp8E4M3Max;
        }
        for (int64_t i = 0; i < n; ++i) v[i] = Fp8E4M3ToFloat(FloatToFp8E4M3(v[i] / scale)) * scale;
      }
    }
  });
}

void RouteTopK(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool normalize,
               int32_t* ids, float* weights) {
  std::vector<float> probs(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * experts;
    const float max_logit = *std::max_element(l, l + experts);
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      probs[e] = std::exp(l[e] - max_logit);
      sum += probs[e];
    }
    for (float& p : probs) p = static_cast<float>(p / sum);
    // A stable sort on "greater" keeps the lower index first among equals.
    // NaN ranks lowest, which keeps the order a strict weak one.
    const auto rank = [&](int32_t e) {
      return std::isnan(probs[e]) ? -std::numeric_limits<float>::infinity() : probs[e];
    };
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return rank(a) > rank(b); });
    float chosen = 1;
    if (normalize) {
      chosen = 0;
      for (int64_t j = 0; j < top_k; ++j) chosen += probs[order[j]];
    }
    for (int64_t j = 0; j < top_k; ++j) {
      ids[r * top_k + j] = order[j];
      weights[r * top_k + j] = probs[order[j]] / chosen;
    }
  }
}

void ExpertMlps(const float* x, int64_t rows, const int32_t* ids, const float* weights,
                int64_t top_k, const ExpertWeights& w, float* out, ThreadPool* pool) {
  const int64_t hidden = w.hidden;
  const int64_t inter = w.intermediate;
  const int64_t choices = rows * top_k;
  // Counting sort of the (row, j) choices by expert: expert e's rows are
  // permuted rows [offset[e], offset[e + 1]); slot[c] is where choice c went.
  std::vector<int64_t> offset(static_cast<size_t>(w.experts + 1), 0);
  for (int64_t c = 0; c < choices; ++c) ++offset[ids[c] + 1];
  std::partial_sum(offset.begin(), offset.end(), offset.begin());
  std::vector<int64_t> next(offset.begin(), offset.end() - 1);
  std::vector<int64_t> slot(static_cast<size_t>(choices));
  std::vector<float> permuted(static_cast<size_t>(choices * hidden));
  for (int64_t c = 0; c < choices; ++c) {
    slot[c] = next[ids[c]]++;
    std::copy_n(x + (c / top_k) * hidden, hidden, permuted.data() + slot[c] * hidden);
  }
  QuantizeDequantizeFp8(permuted.data(), choices, hidden, w.gate_up_input, pool);
  std::vector<float> gate_up(static_cast<size_t>(choices * 2 * inter));
  std::vector<float> act(static_cast<size_t>(choices * inter));
  std::vector<float> expert_out(static_cast<size_t>(choices * hidden));
  for (int64_t e = 0; e < w.experts; ++e) {
    const int64_t first = offset[e];
    const int64_t count = offset[e + 1] - first;
    if (count == 0) continue;
    Linear(permuted.data() + first * hidden, count, hidden, w.gate_up + e * 2 * inter * hidden,
           2 * inter, nullptr, gate_up.data() + first * 2 * inter, pool);
  }
  SiluMul(gate_up.data(), choices, inter, act.data(), pool);
  QuantizeDequantizeFp8(act.data(), choices, inter, w.down_input, pool);
  for (int64_t e = 0; e < w.experts; ++e) {
    const int64_t first = offset[e];
    const int64_t count = offset[e + 1] - first;
    if (count == 0) continue;
    Linear(act.data() + first * inter, count, inter, w.down + e * hidden * inter, hidden, nullptr,
           expert_out.data() + first * hidden, pool);
  }
  ParallelRows(pool, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = out + r * hidden;
      for (int64_t j = 0; j < top_k; ++j) {
        const float weight = weights[r * top_k + j];
        const float* y = expert_out.data() + slot[r * top_k + j] * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] += weight * y[i];
      }
    }
  });
}

}  // namespace layerserve::cpu
