// GPU tests of the paged KV cache's kernels (layerserve/kernels/paged_attention.h)
// against float64 references built from the same rounded inputs:
//   - PagedAttention: every query of a packed batch that mixes session
//     sequences (keys below their start in the cache, through shuffled block
//     tables) with stateless ones, for decode (1 query) and multi-token steps,
//     GQA and MHA, head_dim 64 and 128, bf16 and fp16, blocks of 16 tokens and
//     odd sizes (1, 5, 7), with and without sliding windows; decode-shaped
//     (narrow) and prefill-shaped (wide) items.
//   - RopeKvAppend: q and k rotate bit for bit as LaunchRope rotates them,
//     the new rows land bit-exactly at their slots, and nothing else in the
//     pool changes.
//   - The FP8 cache (PagedKv's FP8 layout): the same cases' session keys
//     quantized per row and KV head on the host (base/dtype.h's e4m3, the
//     CPU backend's), the attention against the float64 reference over code
//     * scale, and the append storing exactly those codes and scales and
//     writing code * scale back over its session rows' K and V columns.
//   - Validation: bad params are INVALID_ARGUMENT before any launch.
//
// Every pool row the attention must not read (rows past a sequence's start,
// and spare blocks no table names) holds NaN, as does the output before the
// launch: a key read from the wrong row, or an output never written, fails.
// In an FP8 pool those rows hold NaN codes (0x7f) and NaN scales.
//
// Every case runs under three plans: the device's own, one that splits every
// tile's keys as finely as it can (one 64-key tile per split), padded with
// idle items and combine tasks as the server's CUDA graphs pad their plans,
// and one that never splits, so the direct and the split-and-combine paths
// both see it.
//
// Tolerance (STYLE rule 2): attention is a reduction over up to 32k keys
// here, so the kernel's error against the float64 reference must stay within
// twice the error of a plain same-precision implementation of the same math
// (scores and probabilities rounded to the dtype, fp32 sums), as the flash
// attention test demands; a wrong key or a wrong weight shows up as errors of
// 0.1 and more. The plan's heuristic has its own tests, which need no GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "layerserve/kernels/layer_ops.h"
#include "layerserve/kernels/paged_attention.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::kernels {
namespace {

using testing::AllClose;
using testing::Decode;
using testing::DeviceBuffer;
using testing::DTypeEpsilon;
using testing::DTypeName;
using testing::Encode;
using testing::Errors;
using testing::ErrorStats;
using testing::ParallelFor;
using testing::RandomValues;
using testing::RoundToDType;

// One packed sequence: `len` new tokens at positions start..start+len-1. A
// session sequence has a block table covering start + len tokens (its keys
// below start are in the cache); a stateless one has start 0 and no table.
struct SeqSpec {
  int start;
  int len;
  bool session;
};

struct PagedCase {
  const char* name;
  DType dtype;
  int head_dim;
  int heads;
  int kv_heads;
  int block_tokens;
  int window;
  std::vector<SeqSpec> seqs;
  bool fp8 = false;  // the cache holds e4m3 codes and scales
};

void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.name; }

// The host side of one case: the packing, the tables, the fused qkv rows of
// the new tokens and the pool as the kernels see it.
struct PagedProblem {
  int64_t tokens = 0;
  int64_t qkv_width = 0;
  int64_t kv_width = 0;
  int64_t num_blocks = 0;
  std::vector<int32_t> cu_seqlens, start, cu_blocks, block_tables;
  std::vector<double> qkv;             // [tokens, (heads + 2 kv_heads) * head_dim], q | k | v
  std::vector<double> pool_k, pool_v;  // [num_blocks * block_tokens, kv_width]
};

int64_t BlocksFor(int64_t tokens, int64_t block_tokens) { return (tokens + block_tokens - 1) / block_tokens; }

// Tables take block ids from a shuffled permutation of the pool, which has
// three spare blocks no table names. With `history`, each session sequence's
// positions below its start hold random keys and values, its new positions
// its new K and V rows (as RopeKvAppend leaves them for the attention), and
// every other row NaN (the attention test); without, every row holds random
// values (the append test, which checks that the rows it does not own keep
// theirs).
PagedProblem BuildProblem(const PagedCase& c, bool history, uint64_t seed) {
  PagedProblem pr;
  pr.qkv_width = int64_t{c.heads + 2 * c.kv_heads} * c.head_dim;
  pr.kv_width = int64_t{c.kv_heads} * c.head_dim;
  pr.cu_seqlens = {0};
  pr.cu_blocks = {0};
  for (const SeqSpec& s : c.seqs) {
    pr.cu_seqlens.push_back(pr.cu_seqlens.back() + s.len);
    pr.start.push_back(s.start);
    pr.cu_blocks.push_back(pr.cu_blocks.back() +
                           static_cast<int32_t>(s.session ? BlocksFor(s.start + s.len, c.block_tokens) : 0));
  }
  pr.tokens = pr.cu_seqlens.back();
  pr.num_blocks = pr.cu_blocks.back() + 3;
  std::vector<int32_t> ids(static_cast<size_t>(pr.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<uint32_t>(seed)));
  pr.block_tables.assign(ids.begin(), ids.begin() + pr.cu_blocks.back());

  pr.qkv = RandomValues(c.dtype, pr.tokens * pr.qkv_width, -2.0, 2.0, seed + 1);
  const size_t pool_elements = static_cast<size_t>(pr.num_blocks * c.block_tokens * pr.kv_width);
  const std::vector<double> random_k = RandomValues(c.dtype, pool_elements, -2.0, 2.0, seed + 2);
  const std::vector<double> random_v = RandomValues(c.dtype, pool_elements, -2.0, 2.0, seed + 3);
  if (!history) {
    pr.pool_k = random_k;
    pr.pool_v = random_v;
    return pr;
  }
  pr.pool_k.assign(pool_elements, NAN);
  pr.pool_v.assign(pool_elements, NAN);
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    if (!c.seqs[s].session) continue;
    for (int p = 0; p < c.seqs[s].start + c.seqs[s].len; ++p) {
      const int64_t row =
          int64_t{pr.block_tables[pr.cu_blocks[s] + p / c.block_tokens]} * c.block_tokens + p % c.block_tokens;
      const int64_t token = pr.cu_seqlens[s] + (p - c.seqs[s].start);  // a new row, for p >= start
      for (int64_t e = 0; e < pr.kv_width; ++e) {
        const int64_t at = row * pr.kv_width + e;
        const bool fresh = p >= c.seqs[s].start;
        pr.pool_k[at] = fresh ? pr.qkv[token * pr.qkv_width + int64_t{c.heads} * c.head_dim + e] : random_k[at];
        pr.pool_v[at] =
            fresh ? pr.qkv[token * pr.qkv_width + int64_t{c.heads + c.kv_heads} * c.head_dim + e] : random_v[at];
      }
    }
  }
  return pr;
}

// An FP8 pool as PagedKv lays it out (paged_attention.h), quantized from a
// problem's pool on the host.
struct Fp8Pool {
  std::vector<uint8_t> k;  // K codes, rows as in bf16
  std::vector<uint8_t> v;  // V groups of 16 keys: codes [head_dim][16], 16 K scales, 16 V scales
};

// Where key `slot` of a block sits among its group's V codes of one
// dimension: its group of 16 ordered 0, 1, 8, 9, 2, 3, 10, 11, ...
int ValueSlot(int slot) {
  const int place[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};  // key -> place
  return place[slot % 16];
}

// The byte offset of the V group that holds `slot` of `block`, KV head `h`.
int64_t GroupOffset(const PagedCase& c, int64_t block, int h, int slot) {
  return ((block * c.kv_heads + h) * (c.block_tokens / 16) + slot / 16) * 16 * (c.head_dim + 8);
}

// Stores one token's codes and scales of KV head `h` at `slot` of `block`.
void PutCodes(const PagedCase& c, int64_t kv_width, int64_t block, int slot, int h, bool value, const uint8_t* codes,
              float scale, Fp8Pool* pool) {
  const int d = c.head_dim;
  uint8_t* group = &pool->v[static_cast<size_t>(GroupOffset(c, block, h, slot))];
  for (int e = 0; e < d; ++e) {
    if (value) {
      group[e * 16 + ValueSlot(slot)] = codes[e];
    } else {
      pool->k[static_cast<size_t>((block * c.block_tokens + slot) * kv_width + int64_t{h} * d + e)] = codes[e];
    }
  }
  std::memcpy(group + d * 16 + (value ? 64 : 0) + 4 * (slot % 16), &scale, 4);
}

// The e4m3 codes and scale of one head's row x[0..d): s = amax / 448 in
// float32, code e4m3(x / s) (zero codes for s = 0); a row holding NaN gets
// NaN codes and a NaN scale.
float QuantizeHead(const double* x, int d, uint8_t* codes) {
  float amax = 0.f;
  bool nan = false;
  for (int e = 0; e < d; ++e) {
    nan = nan || std::isnan(x[e]);
    amax = std::max(amax, std::fabs(static_cast<float>(x[e])));
  }
  if (nan) {
    std::fill_n(codes, d, uint8_t{0x7f});
    return NAN;
  }
  const float s = amax / kFp8E4M3Max;
  for (int e = 0; e < d; ++e) codes[e] = s == 0.f ? 0 : FloatToFp8E4M3(static_cast<float>(x[e]) / s);
  return s;
}

// Quantizes pr's pools in place (each value becomes code * scale, NaN rows
// stay NaN) and returns the codes and scales in the device layout.
Fp8Pool QuantizePool(const PagedCase& c, PagedProblem* pr) {
  Fp8Pool pool;
  const int d = c.head_dim;
  const int64_t rows = pr->num_blocks * c.block_tokens;
  pool.k.resize(static_cast<size_t>(rows * pr->kv_width));
  pool.v.resize(static_cast<size_t>(rows * c.kv_heads * (d + 8)));
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  for (int64_t row = 0; row < rows; ++row) {
    for (int h = 0; h < c.kv_heads; ++h) {
      for (const bool value : {false, true}) {
        double* x = &(value ? pr->pool_v : pr->pool_k)[row * pr->kv_width + int64_t{h} * d];
        const float s = QuantizeHead(x, d, codes.data());
        PutCodes(c, pr->kv_width, row / c.block_tokens, static_cast<int>(row % c.block_tokens), h, value, codes.data(),
                 s, &pool);
        for (int e = 0; e < d; ++e) x[e] = std::isnan(s) ? NAN : static_cast<double>(Fp8E4M3ToFloat(codes[e])) * s;
      }
    }
  }
  return pool;
}

// The sequence that packed row `token` belongs to.
size_t SequenceOf(const PagedProblem& pr, int64_t token) {
  return static_cast<size_t>(std::upper_bound(pr.cu_seqlens.begin(), pr.cu_seqlens.end(), token) -
                             pr.cu_seqlens.begin()) -
         1;
}

// Attention of every (token, head), [tokens, heads * head_dim]: in float64
// (exact) and as a plain same-precision implementation computes it (plain).
struct Expected {
  std::vector<double> exact, plain;
};

Expected Reference(const PagedCase& c, const PagedProblem& pr) {
  const int d = c.head_dim;
  const int64_t out_width = int64_t{c.heads} * d;
  Expected want;
  want.exact.assign(static_cast<size_t>(pr.tokens * out_width), 0.0);
  want.plain.assign(want.exact.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  ParallelFor(static_cast<size_t>(pr.tokens * c.heads), [&](size_t job) {
    const int64_t token = static_cast<int64_t>(job) / c.heads;
    const int h = static_cast<int>(job % c.heads);
    const int kvh = h / (c.heads / c.kv_heads);
    const size_t s = SequenceOf(pr, token);
    const int start = pr.start[s];
    const int q_pos = start + static_cast<int>(token - pr.cu_seqlens[s]);
    const int lo = c.window > 0 ? std::max(0, q_pos - c.window + 1) : 0;
    // Key and value j: from the pool below start, from the new rows after;
    // a session's all from an FP8 pool (the append stored its new ones).
    const bool pooled = c.fp8 && c.seqs[s].session;
    const auto kv_at = [&](int j, bool value) -> const double* {
      if (j < start || pooled) {
        const int64_t row =
            int64_t{pr.block_tables[pr.cu_blocks[s] + j / c.block_tokens]} * c.block_tokens + j % c.block_tokens;
        return &(value ? pr.pool_v : pr.pool_k)[row * pr.kv_width + int64_t{kvh} * d];
      }
      const int64_t row = pr.cu_seqlens[s] + (j - start);
      return &pr.qkv[row * pr.qkv_width + (int64_t{c.heads} + (value ? c.kv_heads : 0) + kvh) * d];
    };
    const double* q = &pr.qkv[token * pr.qkv_width + int64_t{h} * d];
    const size_t n = static_cast<size_t>(q_pos - lo + 1);
    std::vector<double> exact(n);
    std::vector<float> plain(n);
    double max_exact = -INFINITY;
    float max_plain = -INFINITY;
    for (int j = lo; j <= q_pos; ++j) {
      const double* k = kv_at(j, false);
      double dot = 0;
      float dot_f = 0;
      for (int e = 0; e < d; ++e) {
        dot += q[e] * k[e];
        dot_f += static_cast<float>(q[e]) * static_cast<float>(k[e]);
      }
      exact[j - lo] = dot * scale;
      plain[j - lo] = static_cast<float>(RoundToDType(c.dtype, dot_f * static_cast<float>(scale)));
      max_exact = std::max(max_exact, exact[j - lo]);
      max_plain = std::max(max_plain, plain[j - lo]);
    }
    double sum_exact = 0;
    float sum_plain = 0;
    for (size_t i = 0; i < n; ++i) {
      sum_exact += (exact[i] = std::exp(exact[i] - max_exact));
      sum_plain += (plain[i] = std::exp(plain[i] - max_plain));
    }
    double* o = &want.exact[token * out_width + int64_t{h} * d];
    std::vector<float> acc(static_cast<size_t>(d), 0.f);
    for (int j = lo; j <= q_pos; ++j) {
      const double* v = kv_at(j, true);
      const float p = static_cast<float>(RoundToDType(c.dtype, plain[j - lo] / sum_plain));
      for (int e = 0; e < d; ++e) {
        o[e] += exact[j - lo] / sum_exact * v[e];
        acc[static_cast<size_t>(e)] += p * static_cast<float>(v[e]);
      }
    }
    double* o_plain = &want.plain[token * out_width + int64_t{h} * d];
    for (int e = 0; e < d; ++e) o_plain[e] = RoundToDType(c.dtype, acc[static_cast<size_t>(e)]);
  });
  return want;
}

// The device copies of a problem and the PagedKv over them.
// With `fp8`, the pools are its codes and scales.
struct DeviceProblem {
  DeviceProblem(const PagedCase& c, const PagedProblem& pr, const Fp8Pool* fp8 = nullptr)
      : qkv(pr.qkv.size() * DTypeBytes(c.dtype)),
        pool_k(fp8 != nullptr ? fp8->k.size() : pr.pool_k.size() * DTypeBytes(c.dtype)),
        pool_v(fp8 != nullptr ? fp8->v.size() : pr.pool_v.size() * DTypeBytes(c.dtype)),
        cu_seqlens(pr.cu_seqlens.size() * 4),
        start(pr.start.size() * 4),
        cu_blocks(pr.cu_blocks.size() * 4),
        block_tables(pr.block_tables.size() * 4) {
    qkv.Upload(Encode(c.dtype, pr.qkv).data(), qkv.bytes());
    if (fp8 != nullptr) {
      pool_k.Upload(fp8->k.data(), pool_k.bytes());
      pool_v.Upload(fp8->v.data(), pool_v.bytes());
      cache.fp8 = true;
    } else {
      pool_k.Upload(Encode(c.dtype, pr.pool_k).data(), pool_k.bytes());
      pool_v.Upload(Encode(c.dtype, pr.pool_v).data(), pool_v.bytes());
    }
    cu_seqlens.Upload(pr.cu_seqlens.data(), cu_seqlens.bytes());
    start.Upload(pr.start.data(), start.bytes());
    cu_blocks.Upload(pr.cu_blocks.data(), cu_blocks.bytes());
    block_tables.Upload(pr.block_tables.data(), block_tables.bytes());
    cache.k = pool_k.get();
    cache.v = pool_v.get();
    cache.num_blocks = pr.num_blocks;
    cache.block_tokens = c.block_tokens;
    cache.start = static_cast<const int32_t*>(start.get());
    cache.cu_blocks = static_cast<const int32_t*>(cu_blocks.get());
    cache.block_tables = static_cast<const int32_t*>(block_tables.get());
    const auto* base = static_cast<const char*>(qkv.get());
    k = base + int64_t{c.heads} * c.head_dim * DTypeBytes(c.dtype);
    v = base + int64_t{c.heads + c.kv_heads} * c.head_dim * DTypeBytes(c.dtype);
  }

  DeviceBuffer qkv, pool_k, pool_v, cu_seqlens, start, cu_blocks, block_tables;
  PagedKv cache;
  const void* k = nullptr;  // the K and V columns of the fused qkv rows
  const void* v = nullptr;
};

class PagedAttentionTest : public testing::GpuTestWithParam<PagedCase> {};

// A plan uploaded to the device, with the workspace its splits write.
struct DevicePlan {
  DevicePlan(const PagedAttentionPlan& plan, int kv_heads, int head_dim)
      : items(std::max<size_t>(1, plan.items.size()) * sizeof(PagedWorkItem)),
        combines(std::max<size_t>(1, plan.combines.size()) * sizeof(PagedCombineTask)),
        partial_out(std::max<size_t>(1, static_cast<size_t>(plan.partial_rows * kv_heads * head_dim)) * 4),
        partial_lse(std::max<size_t>(1, static_cast<size_t>(plan.partial_rows * kv_heads)) * 4) {
    if (!plan.items.empty()) items.Upload(plan.items.data(), plan.items.size() * sizeof(PagedWorkItem));
    if (!plan.combines.empty()) {
      combines.Upload(plan.combines.data(), plan.combines.size() * sizeof(PagedCombineTask));
    }
    partial_out.Poison();
    partial_lse.Poison();
  }
  void Apply(const PagedAttentionPlan& plan, PagedAttentionParams& p) const {
    p.items = static_cast<const PagedWorkItem*>(items.get());
    p.num_items = static_cast<int>(plan.items.size());
    p.combines = static_cast<const PagedCombineTask*>(combines.get());
    p.num_combines = static_cast<int>(plan.combines.size());
    p.partial_out = static_cast<float*>(partial_out.get());
    p.partial_lse = static_cast<float*>(partial_lse.get());
  }
  DeviceBuffer items, combines, partial_out, partial_lse;
};

TEST_P(PagedAttentionTest, WithinTwiceThePlainImplementationsError) {
  const PagedCase& c = GetParam();
  PagedProblem pr = BuildProblem(c, /*history=*/true, 7000 + c.head_dim + c.block_tokens);
  std::optional<Fp8Pool> fp8;
  if (c.fp8) fp8 = QuantizePool(c, &pr);
  const Expected want = Reference(c, pr);
  const ErrorStats plain = Errors(want.plain, want.exact);
  DeviceProblem dp(c, pr, fp8 ? &*fp8 : nullptr);
  const int64_t out_width = int64_t{c.heads} * c.head_dim;
  DeviceBuffer out(pr.tokens * out_width * DTypeBytes(c.dtype));

  PagedAttentionParams p;
  p.q = dp.qkv.get();
  p.k = dp.k;
  p.v = dp.v;
  p.out = out.get();
  p.q_row_stride = p.k_row_stride = p.v_row_stride = pr.qkv_width;
  p.out_row_stride = out_width;
  p.cu_seqlens = static_cast<const int32_t*>(dp.cu_seqlens.get());
  p.num_seqs = static_cast<int>(c.seqs.size());
  p.tokens = pr.tokens;
  p.cache = dp.cache;
  p.num_heads = c.heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.window = c.window;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.dtype = c.dtype;

  const auto describe = [&](size_t i) {
    const int64_t token = static_cast<int64_t>(i) / out_width;
    const int64_t col = static_cast<int64_t>(i) % out_width;
    const size_t s = SequenceOf(pr, token);
    return "seq " + std::to_string(s) + " (start " + std::to_string(pr.start[s]) + ") query at position " +
           std::to_string(pr.start[s] + token - pr.cu_seqlens[s]) + " head " + std::to_string(col / c.head_dim) +
           " dim " + std::to_string(col % c.head_dim);
  };
  std::vector<PagedSequence> seqs;
  for (const SeqSpec& spec : c.seqs) seqs.push_back({spec.len, spec.start});
  const absl::StatusOr<DeviceInfo> dev = CurrentDeviceInfo();
  ASSERT_TRUE(dev.ok()) << dev.status();
  // The device's plan; every tile split into single key tiles (as if the
  // device had 100000 SMs, without limits); no split at all (one SM).
  struct PlanRun {
    const char* name;
    int num_sms;
    PagedPlanLimits limits;
    bool padded = false;
  };
  const PagedPlanLimits unlimited{INT32_MAX, INT32_MAX};
  const PlanRun runs[] = {
      {"device plan", dev->num_sms,
       PagedPlanCapacity(pr.tokens, static_cast<int64_t>(c.seqs.size()), c.heads, c.kv_heads, dev->num_sms)},
      {"finest splits, padded", 100000, unlimited, true},
      {"no splits", 1, unlimited},
  };
  for (const PlanRun& run : runs) {
    SCOPED_TRACE(run.name);
    absl::StatusOr<PagedAttentionPlan> plan = PlanPagedAttention(seqs, c.heads, c.kv_heads, run.num_sms, run.limits);
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (run.padded) {
      // Idle items and combine tasks after the real ones.
      const absl::Status padded = PadPagedPlan(static_cast<int64_t>(plan->items.size()) + 5,
                                               static_cast<int64_t>(plan->combines.size()) + 3, &*plan);
      ASSERT_TRUE(padded.ok()) << padded;
    }
    DevicePlan device_plan(*plan, c.kv_heads, c.head_dim);
    device_plan.Apply(*plan, p);
    out.Poison();
    const absl::Status launched = LaunchPagedAttention(p, nullptr);
    ASSERT_TRUE(launched.ok()) << launched;
    LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

    std::vector<uint8_t> bytes(out.bytes());
    out.Download(bytes.data(), bytes.size());
    const std::vector<double> got = Decode(c.dtype, bytes);
    const ErrorStats kernel = Errors(got, want.exact);
    const std::string report = std::to_string(plan->items.size()) + " items, " + std::to_string(plan->combines.size()) +
                               " combines; kernel max|err| " + std::to_string(kernel.max_abs) + " mean " +
                               std::to_string(kernel.mean_abs) + "; plain max|err| " + std::to_string(plain.max_abs) +
                               " mean " + std::to_string(plain.mean_abs) + "; worst at " + describe(kernel.worst) +
                               ": got " + std::to_string(got[kernel.worst]) + ", expected " +
                               std::to_string(want.exact[kernel.worst]);
    EXPECT_EQ(kernel.non_finite, 0u) << kernel.non_finite << " non-finite outputs (unwritten or NaN); first at "
                                     << describe(kernel.worst);
    // A floor of a quarter ulp at 1.0 keeps exact-looking tiny cases (one
    // key: output = v) from demanding better than exact.
    const double floor = 0.25 * DTypeEpsilon(c.dtype);
    EXPECT_LE(kernel.max_abs, 2 * plain.max_abs + floor) << report;
    EXPECT_LE(kernel.mean_abs, 2 * plain.mean_abs + floor) << report;
  }
}

// The FP8 append's results: the codes and scales of each session token's
// rotated K and V heads at its slot (quantized on the host as the CPU cache
// does, so bit for bit), every other code and scale as it was; the qkv rows
// as LaunchRope left them (`rotated`) but the session rows' K and V columns,
// which hold code * scale rounded to the dtype.
void ExpectFp8Append(const PagedCase& c, const PagedProblem& pr, Fp8Pool want, const std::vector<double>& rotated,
                     const std::vector<double>& got_qkv, const DeviceProblem& fused) {
  const int d = c.head_dim;
  std::vector<double> want_qkv = rotated;
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    if (!c.seqs[s].session) continue;
    for (int i = 0; i < c.seqs[s].len; ++i) {
      const int pos = c.seqs[s].start + i;
      const int64_t block = pr.block_tables[pr.cu_blocks[s] + pos / c.block_tokens];
      const int slot = pos % c.block_tokens;
      double* row = &want_qkv[(pr.cu_seqlens[s] + i) * pr.qkv_width + int64_t{c.heads} * d];
      for (int h = 0; h < c.kv_heads; ++h) {
        for (const bool value : {false, true}) {
          double* x = row + (value ? pr.kv_width : 0) + int64_t{h} * d;
          const float scale = QuantizeHead(x, d, codes.data());
          PutCodes(c, pr.kv_width, block, slot, h, value, codes.data(), scale, &want);
          for (int e = 0; e < d; ++e) {
            x[e] = RoundToDType(c.dtype, static_cast<float>(Fp8E4M3ToFloat(codes[e]) * scale));
          }
        }
      }
    }
  }
  const auto describe_qkv = [&](size_t i) {
    return "token " + std::to_string(static_cast<int64_t>(i) / pr.qkv_width) + " column " +
           std::to_string(static_cast<int64_t>(i) % pr.qkv_width);
  };
  EXPECT_TRUE(AllClose(got_qkv, want_qkv, 0, 0, describe_qkv)) << "qkv rows";
  std::vector<uint8_t> got(want.k.size());
  fused.pool_k.Download(got.data(), got.size());
  EXPECT_EQ(got, want.k) << "K codes";
  got.resize(want.v.size());
  fused.pool_v.Download(got.data(), got.size());
  EXPECT_EQ(got, want.v) << "V groups (codes and scales)";
}

// RoPE and the cache write in one launch, on two copies of one problem whose
// pool rows all hold random values: on one, LaunchRope alone (the stateless
// path's kernel, tested against its reference in layer_ops_test); on the
// other, LaunchRopeKvAppend. The qkv rows must match bit for bit (the fused
// kernel rotates exactly as RoPE does), and the pools must hold what they
// held with each session token's rotated K row and its V row at its slot,
// bit for bit, and nothing else changed. Positions are each token's own (a
// session token's start + i).
TEST_P(PagedAttentionTest, RopeAndAppendRotateAsRopeAndStoreTheNewRowsOnly) {
  const PagedCase& c = GetParam();
  PagedProblem pr = BuildProblem(c, /*history=*/false, 9000 + c.head_dim + c.block_tokens);
  std::optional<Fp8Pool> fp8;
  if (c.fp8) fp8 = QuantizePool(c, &pr);
  std::vector<int32_t> positions;
  for (const SeqSpec& spec : c.seqs) {
    for (int i = 0; i < spec.len; ++i) positions.push_back(spec.start + i);
  }
  std::vector<float> inv_freq(static_cast<size_t>(c.head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * static_cast<double>(i) / c.head_dim));
  }
  DeviceBuffer d_positions(std::max<size_t>(1, positions.size()) * 4), d_inv_freq(inv_freq.size() * 4);
  if (!positions.empty()) d_positions.Upload(positions.data(), positions.size() * 4);
  d_inv_freq.Upload(inv_freq.data(), inv_freq.size() * 4);

  DeviceProblem rope_only(c, pr), fused(c, pr, fp8 ? &*fp8 : nullptr);
  const auto rope_of = [&](const DeviceProblem& dp) {
    RopeParams r;
    r.qkv = dp.qkv.get();
    r.positions = static_cast<const int32_t*>(d_positions.get());
    r.inv_freq = static_cast<const float*>(d_inv_freq.get());
    r.tokens = pr.tokens;
    r.num_heads = c.heads;
    r.num_kv_heads = c.kv_heads;
    r.head_dim = c.head_dim;
    r.dtype = c.dtype;
    return r;
  };
  absl::Status launched = LaunchRope(rope_of(rope_only), nullptr);
  ASSERT_TRUE(launched.ok()) << launched;
  const KvAppendParams append{static_cast<const int32_t*>(fused.cu_seqlens.get()), static_cast<int>(c.seqs.size()),
                              fused.cache};
  launched = LaunchRopeKvAppend(rope_of(fused), append, nullptr);
  ASSERT_TRUE(launched.ok()) << launched;
  LS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<uint8_t> bytes(rope_only.qkv.bytes());
  rope_only.qkv.Download(bytes.data(), bytes.size());
  const std::vector<double> rotated = Decode(c.dtype, bytes);
  fused.qkv.Download(bytes.data(), bytes.size());
  const auto describe_qkv = [&](size_t i) {
    return "token " + std::to_string(static_cast<int64_t>(i) / pr.qkv_width) + " column " +
           std::to_string(static_cast<int64_t>(i) % pr.qkv_width);
  };
  EXPECT_NE(rotated, pr.qkv) << "nothing was rotated: the test would prove nothing";
  if (c.fp8) {
    ExpectFp8Append(c, pr, *fp8, rotated, Decode(c.dtype, bytes), fused);
    return;
  }
  EXPECT_TRUE(AllClose(Decode(c.dtype, bytes), rotated, 0, 0, describe_qkv)) << "qkv rows";

  // The pool as it was, with each session token's K and V row at its slot.
  std::vector<double> want_k = pr.pool_k, want_v = pr.pool_v;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    if (!c.seqs[s].session) continue;
    for (int i = 0; i < c.seqs[s].len; ++i) {
      const int pos = c.seqs[s].start + i;
      const int64_t slot =
          int64_t{pr.block_tables[pr.cu_blocks[s] + pos / c.block_tokens]} * c.block_tokens + pos % c.block_tokens;
      const double* row = &rotated[(pr.cu_seqlens[s] + i) * pr.qkv_width + int64_t{c.heads} * c.head_dim];
      std::copy_n(row, pr.kv_width, &want_k[slot * pr.kv_width]);
      std::copy_n(row + pr.kv_width, pr.kv_width, &want_v[slot * pr.kv_width]);
    }
  }
  const auto describe = [&](size_t i) {
    const int64_t row = static_cast<int64_t>(i) / pr.kv_width;
    return "block " + std::to_string(row / c.block_tokens) + " row " + std::to_string(row % c.block_tokens) +
           " element " + std::to_string(static_cast<int64_t>(i) % pr.kv_width);
  };
  bytes.resize(fused.pool_k.bytes());
  fused.pool_k.Download(bytes.data(), bytes.size());
  EXPECT_TRUE(AllClose(Decode(c.dtype, bytes), want_k, 0, 0, describe)) << "K pool";
  fused.pool_v.Download(bytes.data(), bytes.size());
  EXPECT_TRUE(AllClose(Decode(c.dtype, bytes), want_v, 0, 0, describe)) << "V pool";
}

std::vector<PagedCase> Cases() {
  // Session sequences: {start, len, true}; stateless ones: {0, len, false}.
  const std::vector<SeqSpec> mixed = {{37, 1, true}, {0, 5, false}, {0, 20, true}, {16, 16, true}, {100, 9, true}};
  // A decode batch at starts around block edges.
  const std::vector<SeqSpec> decode = {{1, 1, true},  {15, 1, true}, {16, 1, true},
                                       {17, 1, true}, {64, 1, true}, {300, 1, true}};
  const auto make = [](const char* name, DType dtype, int head_dim, int heads, int kv_heads, int block_tokens,
                       int window, std::vector<SeqSpec> seqs) {
    return PagedCase{name, dtype, head_dim, heads, kv_heads, block_tokens, window, std::move(seqs)};
  };
  return {
      make("bf16_d128_gqa4_block16_mixed", DType::kBF16, 128, 8, 2, 16, 0, mixed),
      make("fp16_d128_gqa4_block16_mixed", DType::kF16, 128, 8, 2, 16, 0, mixed),
      // An empty sequence (offsets repeat in cu_seqlens) between two others.
      make("bf16_d64_mha_block5", DType::kBF16, 64, 4, 4, 5, 0,
           {{13, 1, true}, {5, 0, true}, {7, 6, true}, {0, 11, false}}),
      make("fp16_d64_gqa8_block1", DType::kF16, 64, 8, 1, 1, 0, {{9, 3, true}, {0, 1, false}, {4, 1, true}}),
      // 6 heads: the second CTA of each token has two warps with no head.
      make("bf16_d64_gqa6_block7_window8", DType::kBF16, 64, 6, 1, 7, 8,
           {{30, 1, true}, {3, 12, true}, {0, 17, false}, {6, 2, true}}),
      make("fp16_d128_gqa4_block16_window33", DType::kF16, 128, 8, 2, 16, 33,
           {{50, 4, true}, {200, 1, true}, {0, 40, false}, {20, 30, true}}),
      // Llama-3-8B's heads.
      make("bf16_d128_llama3_decode", DType::kBF16, 128, 32, 8, 16, 0, decode),
      make("bf16_d128_stateless_only", DType::kBF16, 128, 4, 2, 16, 0, {{0, 3, false}, {0, 70, false}}),
      // Decode over long, ragged contexts (many key tiles, so splits), and
      // speculative steps of 7 and 16 tokens (several 16-row tiles each).
      make("bf16_d128_llama3_long_decode", DType::kBF16, 128, 32, 8, 16, 0,
           {{1023, 1, true}, {4000, 1, true}, {70, 1, true}, {2049, 1, true}}),
      make("fp16_d128_llama3_speculative", DType::kF16, 128, 32, 8, 16, 0, {{500, 16, true}, {33, 7, true}}),
      make("bf16_d64_mqa32_window100", DType::kBF16, 64, 32, 1, 16, 100, {{700, 3, true}, {90, 2, true}}),
      // One sequence at a 32k context: the longest the plan is tested at.
      make("bf16_d128_gqa4_32k", DType::kBF16, 128, 8, 2, 16, 0, {{32767, 1, true}}),
      // A prefill chunk after an earlier one, beside decoders (200 and 130
      // new tokens: wide items, the decoder a narrow one).
      make("bf16_d128_llama3_prefill_chunk", DType::kBF16, 128, 32, 8, 16, 0,
           {{256, 200, true}, {900, 1, true}, {0, 130, true}}),
      // Wide items through a window, with head_dim 64, and MHA (a group of
      // one: 64 tokens a wide item), each beside a narrow sequence.
      make("fp16_d64_gqa4_window40_wide", DType::kF16, 64, 8, 2, 16, 40,
           {{300, 100, true}, {0, 90, false}, {5, 1, true}}),
      make("bf16_d64_mha_block7_wide", DType::kBF16, 64, 4, 4, 7, 0, {{50, 80, true}, {3, 1, true}, {0, 63, false}}),
  };
}

INSTANTIATE_TEST_SUITE_P(Kernels, PagedAttentionTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<PagedCase>& info) { return std::string(info.param.name); });

// The FP8 cache: every case whose blocks are a multiple of 16 tokens, and
// blocks of 32 and 64 (K boxes of 32 and 64 keys).
std::vector<PagedCase> Fp8Cases() {
  std::vector<PagedCase> cases;
  for (PagedCase c : Cases()) {
    if (c.block_tokens % 16 != 0) continue;
    c.fp8 = true;
    cases.push_back(c);
  }
  cases.push_back({"bf16_d128_llama3_block32_mixed",
                   DType::kBF16,
                   128,
                   32,
                   8,
                   32,
                   0,
                   {{37, 1, true}, {0, 5, false}, {700, 1, true}, {16, 70, true}},
                   true});
  cases.push_back({"fp16_d64_gqa4_block64_window50",
                   DType::kF16,
                   64,
                   8,
                   2,
                   64,
                   50,
                   {{130, 2, true}, {0, 9, false}, {300, 66, true}},
                   true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fp8Cache, PagedAttentionTest, ::testing::ValuesIn(Fp8Cases()),
                         [](const ::testing::TestParamInfo<PagedCase>& info) { return std::string(info.param.name); });

// Validation rejects bad params before launching anything, so this runs
// without a GPU: the pointers are aligned and never dereferenced.
TEST(PagedAttentionValidationTest, RejectsBadParams) {
  alignas(16) static int32_t dummy[64];
  PagedAttentionParams good;
  good.q = good.k = good.v = dummy;
  good.out = dummy;
  good.q_row_stride = good.out_row_stride = 256;
  good.k_row_stride = good.v_row_stride = 256;
  good.cu_seqlens = dummy;
  good.num_seqs = 1;
  good.tokens = 1;
  good.cache = {.k = dummy,
                .v = dummy,
                .num_blocks = 1,
                .block_tokens = 16,
                .start = dummy,
                .cu_blocks = dummy,
                .block_tables = dummy};
  good.num_heads = 2;
  good.num_kv_heads = 1;
  good.head_dim = 128;
  good.softmax_scale = 0.088f;
  good.items = reinterpret_cast<const PagedWorkItem*>(dummy);
  good.num_items = 1;
  // RoPE and the append take the attention's packing, cache and head shape.
  const auto rope_of = [](const PagedAttentionParams& p) {
    RopeParams r;
    r.qkv = const_cast<void*>(p.q);  // never dereferenced: validation fails, or there are no tokens
    r.positions = p.cu_seqlens;
    r.inv_freq = reinterpret_cast<const float*>(p.cu_seqlens);
    r.tokens = p.tokens;
    r.num_heads = p.num_heads;
    r.num_kv_heads = p.num_kv_heads;
    r.head_dim = p.head_dim;
    r.dtype = p.dtype;
    return r;
  };
  const auto append_of = [](const PagedAttentionParams& p) {
    return KvAppendParams{p.cu_seqlens, p.num_seqs, p.cache};
  };
  struct Spoiler {
    const char* what;
    void (*spoil)(PagedAttentionParams&);
    bool shared;  // a param RoPE + append takes too
  };
  const Spoiler spoilers[] = {
      {"head_dim 96", [](PagedAttentionParams& p) { p.head_dim = 96; }, true},
      {"fp32", [](PagedAttentionParams& p) { p.dtype = DType::kF32; }, true},
      {"block_tokens 0", [](PagedAttentionParams& p) { p.cache.block_tokens = 0; }, true},
      {"no block tables", [](PagedAttentionParams& p) { p.cache.block_tables = nullptr; }, true},
      {"no start positions", [](PagedAttentionParams& p) { p.cache.start = nullptr; }, true},
      {"tokens without sequences", [](PagedAttentionParams& p) { p.num_seqs = 0; }, true},
      {"misaligned k", [](PagedAttentionParams& p) { p.k = reinterpret_cast<const char*>(p.k) + 2; }, false},
      {"k stride not a multiple of 8", [](PagedAttentionParams& p) { p.k_row_stride = 100; }, false},
      {"v stride shorter than a row", [](PagedAttentionParams& p) { p.v_row_stride = 64; }, false},
      {"heads not a multiple of kv heads",
       [](PagedAttentionParams& p) {
         p.num_heads = 3;
         p.num_kv_heads = 2;
       },
       false},
      {"negative window", [](PagedAttentionParams& p) { p.window = -1; }, false},
      {"num_blocks 0", [](PagedAttentionParams& p) { p.cache.num_blocks = 0; }, false},
      {"no q", [](PagedAttentionParams& p) { p.q = nullptr; }, false},
      {"zero softmax scale", [](PagedAttentionParams& p) { p.softmax_scale = 0.f; }, false},
      {"no work items", [](PagedAttentionParams& p) { p.num_items = 0; }, false},
      {"null work items", [](PagedAttentionParams& p) { p.items = nullptr; }, false},
      {"FP8 blocks of 8 tokens",
       [](PagedAttentionParams& p) {
         p.cache.fp8 = true;
         p.cache.block_tokens = 8;
       },
       true},
      {"combines without workspace",
       [](PagedAttentionParams& p) {
         p.num_combines = 1;
         p.combines = reinterpret_cast<const PagedCombineTask*>(p.q);
       },
       false},
  };
  for (const Spoiler& s : spoilers) {
    PagedAttentionParams p = good;
    s.spoil(p);
    EXPECT_EQ(LaunchPagedAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument) << s.what;
    if (s.shared) {
      EXPECT_EQ(LaunchRopeKvAppend(rope_of(p), append_of(p), nullptr).code(), absl::StatusCode::kInvalidArgument)
          << s.what << " (rope + append)";
    }
  }
  RopeParams misaligned_qkv = rope_of(good);
  misaligned_qkv.qkv = reinterpret_cast<char*>(dummy) + 2;
  EXPECT_EQ(LaunchRopeKvAppend(misaligned_qkv, append_of(good), nullptr).code(), absl::StatusCode::kInvalidArgument)
      << "misaligned qkv (rope + append)";

  // No tokens: nothing to launch, and nothing fails.
  PagedAttentionParams empty = good;
  empty.tokens = 0;
  EXPECT_TRUE(LaunchPagedAttention(empty, nullptr).ok());
  EXPECT_TRUE(LaunchRopeKvAppend(rope_of(empty), append_of(empty), nullptr).ok());
}

}  // namespace
}  // namespace layerserve::kernels
