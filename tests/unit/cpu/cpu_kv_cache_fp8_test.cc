// The FP8 KV cache on the CPU backend (--kv-cache-dtype=fp8,
// server/core/kv_cache_dtype.h). The cache's rows against base/dtype.h's
// e4m3 conversion (itself bit-exact with ml_dtypes); its bytes; then a
// session fed in steps against the float64 reference whose attention reads
// every K and V row quantized per token and KV head, which must be far
// closer to it than to the unquantized reference (so a cache that skipped
// or misplaced the quantization fails); stateless requests in the same
// batches unchanged by the cache.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/core/kv_cache_dtype.h"
#include "server/core/sessions.h"
#include "server/cpu/cpu_backend.h"
#include "server/cpu/kv_cache.h"
#include "tests/support/random_model.h"
#include "tests/support/reference_model.h"
#include "tests/unit/cpu/backend_test_util.h"

namespace layerserve {
namespace {

using cpu_test::BuildBatch;
using cpu_test::BuiltBatch;
using cpu_test::RepresentableInputs;
using cpu_test::Rng;
using cpu_test::RunSync;
using test_support::RandomModel;

TEST(KvCacheDTypeTest, ParsesTheFlag) {
  EXPECT_EQ(*ParseKvCacheDType("auto"), KvCacheDType::kActivation);
  EXPECT_EQ(*ParseKvCacheDType("fp8"), KvCacheDType::kFp8E4M3);
  EXPECT_EQ(*ParseKvCacheDType("fp8_e4m3"), KvCacheDType::kFp8E4M3);
  const absl::StatusOr<KvCacheDType> bad = ParseKvCacheDType("int8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--kv-cache-dtype=int8"), std::string_view::npos);
}

// Each head's row reads back as e4m3(x / s) * s, s = amax / 448 of that
// head's values (a head of zeros as zeros), bit for bit; rows of other
// positions and of the other pool are untouched.
TEST(CpuKvCacheFp8Test, RowsReadBackAsCodesTimesTheirHeadsScale) {
  const cpu::KvCache::RowShape row{3, 16, KvCacheDType::kFp8E4M3};
  absl::StatusOr<std::unique_ptr<cpu::KvCache>> cache = cpu::KvCache::Create(2, row, {5, 2});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Rng rng(7);
  const int64_t width = row.width();
  std::vector<float> k(3 * width), v(3 * width);
  for (int64_t i = 0; i < 3 * width; ++i) {
    // Heads of very different magnitudes: the scale is per head.
    const double magnitude = std::ldexp(1.0, static_cast<int>((i / row.head_dim) % 3) * 6 - 6);
    k[i] = static_cast<float>(rng.Uniform(-1, 1) * magnitude);
    v[i] = static_cast<float>(rng.Uniform(-1, 1) * magnitude * 3);
  }
  std::fill_n(k.begin() + width + row.head_dim, row.head_dim, 0.f);  // position 1, head 1
  const std::vector<KvBlockId> table = {3, 0};
  (*cache)->Write(1, table, 0, 3, k.data(), v.data(), width);

  std::vector<float> k_out(3 * width, NAN), v_out(3 * width, NAN);
  (*cache)->Read(1, table, 0, 3, k_out.data(), v_out.data());
  const auto expected = [&](const std::vector<float>& x) {
    std::vector<float> out(x.size());
    for (int64_t r = 0; r < 3 * row.kv_heads; ++r) {
      const float* head = x.data() + r * row.head_dim;
      float amax = 0.f;
      for (int64_t i = 0; i < row.head_dim; ++i) amax = std::max(amax, std::fabs(head[i]));
      const float s = amax / kFp8E4M3Max;
      for (int64_t i = 0; i < row.head_dim; ++i) {
        out[r * row.head_dim + i] =
            s == 0.f ? 0.f : Fp8E4M3ToFloat(FloatToFp8E4M3(head[i] / s)) * s;
      }
    }
    return out;
  };
  EXPECT_EQ(k_out, expected(k));
  EXPECT_EQ(v_out, expected(v));
  for (int64_t i = 0; i < row.head_dim; ++i) EXPECT_EQ(k_out[width + row.head_dim + i], 0.f);
  // Quantized: not the float values (3 bits of mantissa).
  EXPECT_NE(k_out, k);

  // A rewrite of position 1 in layer 0 leaves layer 1's rows alone.
  std::vector<float> other(width, 1.f);
  (*cache)->Write(0, table, 1, 2, other.data(), other.data(), width);
  std::vector<float> again(3 * width), again_v(3 * width);
  (*cache)->Read(1, table, 0, 3, again.data(), again_v.data());
  EXPECT_EQ(again, k_out);
  EXPECT_EQ(again_v, v_out);
}

// A row costs a byte per value and four per head's scale, against four per
// value in float32.
TEST(CpuKvCacheFp8Test, BlockBytes) {
  const cpu::KvCache::RowShape fp8{2, 64, KvCacheDType::kFp8E4M3};
  const cpu::KvCache::RowShape f32{2, 64, KvCacheDType::kActivation};
  EXPECT_EQ(cpu::KvCache::BlockBytes(3, fp8, 16), 3 * 2 * 16 * (128 + 2 * 4));
  EXPECT_EQ(cpu::KvCache::BlockBytes(3, f32, 16), 3 * 2 * 16 * 128 * 4);
  EXPECT_EQ(cpu::KvCache::BlockBytes(3, fp8, 0), 0);

  const ModelSpan model = RandomModel(cpu_test::Qwen2StyleConfig(), 0, 2, DType::kF32, 11);
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeCpuBackend(model, {.num_threads = 1, .kv_cache_dtype = KvCacheDType::kFp8E4M3});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const int64_t kv_heads = model.config.num_key_value_heads;
  const int64_t width = kv_heads * model.config.head_dim;
  EXPECT_EQ((*backend)->KvBlockBytes(16), 2 * 2 * 16 * (width + 4 * kv_heads));
}

// Runs rows [begin, end) of B sequences of `tokens` tokens (x: [B][tokens]
// [hidden]) as a session step with `tables` (one per sequence, whole), beside
// a stateless request over `stateless` ([1][n][hidden]) in the same batch.
// Returns the step's output rows ([B][end - begin][hidden]) and writes the
// stateless request's to *stateless_out.
std::vector<float> Step(Backend& backend, const std::vector<float>& x, int64_t batch,
                        int64_t tokens, int64_t hidden, int64_t begin, int64_t end,
                        const std::vector<std::vector<KvBlockId>>& tables, int64_t block_tokens,
                        const std::vector<float>& stateless, std::vector<float>* stateless_out) {
  std::vector<float> rows;
  for (int64_t b = 0; b < batch; ++b) {
    rows.insert(rows.end(), x.begin() + (b * tokens + begin) * hidden,
                x.begin() + (b * tokens + end) * hidden);
  }
  const int64_t n = static_cast<int64_t>(stateless.size()) / hidden;
  rows.insert(rows.end(), stateless.begin(), stateless.end());
  BuiltBatch built =
      BuildBatch({{batch, end - begin, DType::kF32}, {1, n, DType::kF32}}, rows, hidden);
  InferRequest& request = *built.batch->requests[0];
  request.session = SessionParams{SessionId{1}};
  SessionStep step;
  step.position = begin;
  step.tokens = end - begin;
  step.block_tokens = block_tokens;
  for (const auto& table : tables) {
    step.block_tables.emplace_back(table.begin(),
                                   table.begin() + BlocksForTokens(end, block_tokens));
  }
  request.step = step;
  built.batch->Pack();
  const absl::Status status = RunSync(backend, built.batch);
  EXPECT_TRUE(status.ok()) << status;
  std::vector<float> out(static_cast<size_t>(batch * (end - begin) * hidden));
  std::memcpy(out.data(), request.output.data(), out.size() * sizeof(float));
  stateless_out->resize(stateless.size());
  std::memcpy(stateless_out->data(), built.batch->requests[1]->output.data(),
              stateless.size() * sizeof(float));
  return out;
}

// ||(got - x) - (want - x)|| / ||want - x|| over rows [begin, end) of every
// sequence: the error of the layers' contribution, which the residual would
// otherwise hide.
double ContributionError(const std::vector<float>& got, const std::vector<double>& want,
                         const std::vector<float>& x, int64_t batch, int64_t tokens, int64_t hidden,
                         int64_t begin, int64_t end) {
  double num = 0, den = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < hidden; ++i) {
        const size_t full = static_cast<size_t>((b * tokens + t) * hidden + i);
        const size_t piece = static_cast<size_t>((b * (end - begin) + t - begin) * hidden + i);
        const double contribution = want[full] - x[full];
        const double d = static_cast<double>(got[piece]) - want[full];
        num += d * d;
        den += contribution * contribution;
      }
    }
  }
  return std::sqrt(num / den);
}

// Two sequences of 17 tokens fed in steps of 5, 1, 3, 1, 4, 1, 2 through
// blocks of 4 in no order: every step within float32 of the FP8-cache
// reference and at least 20x closer to it than to the unquantized one; a
// stateless request in each batch exactly as a float cache's backend gives it.
void ExpectSessionsMatchTheFp8Reference(const LlamaConfig& config, uint64_t seed) {
  const ModelSpan model = RandomModel(config, 0, 2, DType::kF32, seed);
  const int64_t hidden = model.config.hidden_size;
  auto make = [&](KvCacheDType dtype) {
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        MakeCpuBackend(model, {.num_threads = 2, .kv_cache_dtype = dtype});
    EXPECT_TRUE(backend.ok()) << backend.status();
    EXPECT_TRUE((*backend)->AllocateKvCache({12, 4}).ok());
    return *std::move(backend);
  };
  std::unique_ptr<Backend> fp8 = make(KvCacheDType::kFp8E4M3);
  std::unique_ptr<Backend> f32 = make(KvCacheDType::kActivation);

  Rng rng(seed + 1);
  constexpr int64_t kBatch = 2, kTokens = 17;
  const std::vector<float> x = RepresentableInputs(rng, kBatch * kTokens * hidden);
  const std::vector<float> stateless = RepresentableInputs(rng, 6 * hidden);
  std::vector<double> x64(x.begin(), x.end());
  const std::vector<int32_t> cu_seqlens = {0, kTokens, 2 * kTokens};
  test_support::ReferenceModel reference = test_support::ToReference(model);
  const std::vector<double> plain = test_support::ReferenceForward(reference, x64, cu_seqlens);
  reference.config.kv_cache_fp8 = true;
  const std::vector<double> quantized = test_support::ReferenceForward(reference, x64, cu_seqlens);

  const std::vector<std::vector<KvBlockId>> tables = {{7, 2, 11, 0, 5}, {3, 9, 1, 10, 6}};
  int64_t position = 0;
  for (const int64_t t : {5, 1, 3, 1, 4, 1, 2}) {
    SCOPED_TRACE(::testing::Message() << "step of " << t << " tokens at position " << position);
    std::vector<float> stateless_fp8, stateless_f32;
    const std::vector<float> got = Step(*fp8, x, kBatch, kTokens, hidden, position, position + t,
                                        tables, 4, stateless, &stateless_fp8);
    Step(*f32, x, kBatch, kTokens, hidden, position, position + t, tables, 4, stateless,
         &stateless_f32);
    const double to_quantized =
        ContributionError(got, quantized, x, kBatch, kTokens, hidden, position, position + t);
    const double to_plain =
        ContributionError(got, plain, x, kBatch, kTokens, hidden, position, position + t);
    EXPECT_LT(to_quantized, 1e-4);
    EXPECT_GT(to_plain, 20 * to_quantized) << "the step does not see its keys quantized";
    EXPECT_EQ(stateless_fp8, stateless_f32) << "a stateless request met the FP8 cache";
    position += t;
  }
}

// Qwen2-style: head_dim 64, 4 query heads per KV head, q/k/v biases.
TEST(CpuKvCacheFp8Test, SessionsMatchTheFp8ReferenceQwen2) {
  ExpectSessionsMatchTheFp8Reference(cpu_test::Qwen2StyleConfig(), 301);
}

// Llama-3-style: head_dim 128, scaled RoPE.
TEST(CpuKvCacheFp8Test, SessionsMatchTheFp8ReferenceLlama3) {
  ExpectSessionsMatchTheFp8Reference(cpu_test::Llama3StyleConfig(), 303);
}

// Mistral-style: a sliding window shorter than the sequences.
TEST(CpuKvCacheFp8Test, SessionsMatchTheFp8ReferenceMistralWindow) {
  ExpectSessionsMatchTheFp8Reference(cpu_test::MistralStyleConfig(), 305);
}

}  // namespace
}  // namespace layerserve
