// Sessions on the CPU backend (server/core/sessions.h). The oracle: a session
// fed its sequences in steps must give every new token the hidden state that
// one stateless request over the whole sequences gives it. Steps cover a
// prefill, single tokens and chunks that cross 4-token blocks; block tables
// are hand-built from shuffled block ids or handed out by a real SessionTable
// (as the batcher does); models have GQA at head_dim 64 and 128, with and
// without sliding windows; requests carry B > 1 sequences in FP32, BF16 and
// FP16; one batch mixes a stateless request with steps of two sessions at
// different positions; rollbacks overwrite rows already written. Then the KV
// cache hooks, and the session errors the backend reports through `done`.
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/core/kv_blocks.h"
#include "server/core/sessions.h"
#include "server/cpu/cpu_backend.h"
#include "tests/support/fp8_model.h"
#include "tests/support/random_model.h"
#include "tests/unit/cpu/backend_test_util.h"

namespace layerserve {
namespace {

using cpu_test::BuildBatch;
using cpu_test::BuiltBatch;
using cpu_test::ExpectOutputsMatch;
using cpu_test::Llama3StyleConfig;
using cpu_test::MistralStyleConfig;
using cpu_test::MixtralStyleConfig;
using cpu_test::Qwen2StyleConfig;
using cpu_test::RepresentableInputs;
using cpu_test::RequestShape;
using cpu_test::Rng;
using cpu_test::RunSync;
using test_support::RandomModel;
using ::testing::HasSubstr;

// Session and stateless answers are both float32 computations of the same
// math, summed in different orders (other GEMM shapes, keys gathered from the
// cache): they agree to a few float32 ulps per layer.
constexpr double kFp32Tol = 1e-5;

// ---- sequences ----------------------------------------------------------

// B sequences of N tokens, [B][N][hidden] floats.
struct Sequences {
  int64_t batch = 0;
  int64_t tokens = 0;
  int64_t hidden = 0;
  std::vector<float> x;

  // Rows [begin, end) of every sequence: one request's [B, end - begin, hidden].
  std::vector<float> Rows(int64_t begin, int64_t end) const {
    std::vector<float> out;
    for (int64_t b = 0; b < batch; ++b) {
      out.insert(out.end(), x.begin() + (b * tokens + begin) * hidden,
                 x.begin() + (b * tokens + end) * hidden);
    }
    return out;
  }
};

// Values representable in BF16, so FP32 and BF16 requests carry the same ones.
Sequences RandomSequences(Rng& rng, int64_t batch, int64_t tokens, int64_t hidden) {
  return {batch, tokens, hidden,
          RepresentableInputs(rng, static_cast<size_t>(batch * tokens * hidden))};
}

// Another history: the first `keep` tokens of every sequence, then fresh ones.
Sequences Diverge(const Sequences& s, int64_t keep, Rng& rng) {
  Sequences out = s;
  const Sequences fresh = RandomSequences(rng, s.batch, s.tokens, s.hidden);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = keep; t < s.tokens; ++t) {
      std::copy_n(fresh.x.begin() + (b * s.tokens + t) * s.hidden, s.hidden,
                  out.x.begin() + (b * s.tokens + t) * s.hidden);
    }
  }
  return out;
}

// The oracle: one stateless FP32 request over the whole sequences.
Sequences Stateless(Backend& backend, const Sequences& in) {
  BuiltBatch built = BuildBatch({{in.batch, in.tokens, DType::kF32}}, in.x, in.hidden);
  const absl::Status status = RunSync(backend, built.batch);
  EXPECT_TRUE(status.ok()) << status;
  Sequences out = in;
  std::memcpy(out.x.data(), built.batch->requests[0]->output.data(), out.x.size() * sizeof(float));
  return out;
}

// ---- sessions -----------------------------------------------------------

// Where one session's block tables come from: hand-built (sequence b owns the
// block ids blocks[b], cut to each step's length), or a real SessionTable used
// as the batcher uses it (BeginStep before the step, FinishStep after).
class TestSession {
 public:
  TestSession(std::vector<std::vector<KvBlockId>> blocks, int64_t block_tokens)
      : blocks_(std::move(blocks)), block_tokens_(block_tokens) {}
  TestSession(SessionTable* table, int64_t id) : table_(table), id_(id) {}

  SessionStep Begin(int64_t batch, int64_t position, int64_t tokens) {
    if (table_ != nullptr) {
      SessionStepRequest request;
      request.id = id_;
      request.start = !started_;
      request.batch = batch;
      request.tokens = tokens;
      request.position = position;  // equal to the length: append; smaller: roll back
      absl::StatusOr<SessionStep> step = table_->BeginStep(request, SteadyTime{});
      EXPECT_TRUE(step.ok()) << step.status();
      started_ = true;
      return step.ok() ? *std::move(step) : SessionStep{};
    }
    SessionStep step;
    step.position = position;
    step.tokens = tokens;
    step.block_tokens = block_tokens_;
    const int64_t blocks = BlocksForTokens(position + tokens, block_tokens_);
    for (const std::vector<KvBlockId>& ids : blocks_) {
      step.block_tables.emplace_back(ids.begin(), ids.begin() + blocks);
    }
    return step;
  }

  void Finish(bool ok) {
    if (table_ == nullptr) return;
    EXPECT_TRUE(table_->FinishStep(id_, ok, /*end=*/false, SteadyTime{}).ok());
    EXPECT_TRUE(table_->CheckConsistency().ok());
  }

  SessionId id() const { return id_; }

 private:
  std::vector<std::vector<KvBlockId>> blocks_;
  int64_t block_tokens_ = 0;
  SessionTable* table_ = nullptr;
  SessionId id_;
  bool started_ = false;
};

// One request of a test batch: rows [begin, end) of every sequence of `in`.
// Stateless (begin 0) without a session; otherwise a step of `session` whose
// new tokens sit at positions begin..end-1. Its output must match the same
// rows of `want`, the stateless answer for `in`.
struct Part {
  const Sequences* in;
  const Sequences* want;
  int64_t begin;
  int64_t end;
  DType dtype = DType::kF32;
  TestSession* session = nullptr;
};

// Runs `parts` as one batch, finishes its session steps, and checks every
// request against its rows of the stateless answer (rounded to its dtype).
void RunParts(Backend& backend, const std::vector<Part>& parts) {
  std::vector<RequestShape> shapes;
  std::vector<float> x;
  std::vector<double> want;
  for (const Part& part : parts) {
    shapes.push_back({part.in->batch, part.end - part.begin, part.dtype});
    const std::vector<float> rows = part.in->Rows(part.begin, part.end);
    x.insert(x.end(), rows.begin(), rows.end());
    const std::vector<float> answer = part.want->Rows(part.begin, part.end);
    want.insert(want.end(), answer.begin(), answer.end());
  }
  BuiltBatch built = BuildBatch(shapes, x, parts.front().in->hidden);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].session == nullptr) continue;
    InferRequest& request = *built.batch->requests[i];
    request.session = SessionParams{parts[i].session->id()};
    request.step =
        parts[i].session->Begin(request.batch, parts[i].begin, parts[i].end - parts[i].begin);
  }
  built.batch->Pack();
  const absl::Status status = RunSync(backend, built.batch);
  for (const Part& part : parts) {
    if (part.session != nullptr) part.session->Finish(status.ok());
  }
  ASSERT_TRUE(status.ok()) << status;
  ExpectOutputsMatch(*built.batch, want, kFp32Tol);
}

// Feeds rows [start, start + sum(pieces)) of `in` to `session`, one step of
// `pieces[i]` tokens per batch, each checked against `want`.
void FeedInSteps(Backend& backend, const Sequences& in, const Sequences& want, TestSession& session,
                 const std::vector<int64_t>& pieces, DType dtype, int64_t start = 0) {
  int64_t position = start;
  for (const int64_t t : pieces) {
    SCOPED_TRACE(::testing::Message() << "step of " << t << " tokens at position " << position);
    RunParts(backend, {{&in, &want, position, position + t, dtype, &session}});
    position += t;
  }
}

std::unique_ptr<Backend> MakeBackend(const ModelSpan& model, const KvCacheShape& cache) {
  auto backend = MakeCpuBackend(model, CpuBackendOptions{2});
  EXPECT_TRUE(backend.ok()) << backend.status();
  const absl::Status status = (*backend)->AllocateKvCache({cache.num_blocks, cache.block_tokens});
  EXPECT_TRUE(status.ok()) << status;
  return *std::move(backend);
}

// ---- the oracle ---------------------------------------------------------

// Prefill 5, then 1, 3, 1, 4, 1 and 2 tokens: 17 in all, steps that fill a
// 4-token block exactly, cross one, and start on a block boundary.
const std::vector<int64_t> kPieces = {5, 1, 3, 1, 4, 1, 2};

// qwen2-style: head_dim 64, 4 query heads per KV head, q/k/v biases.
TEST(CpuSessionsTest, StepsMatchStatelessGqa4HeadDim64) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 101);
  std::unique_ptr<Backend> backend = MakeBackend(model, {12, 4});
  Rng rng(102);
  const Sequences in = RandomSequences(rng, 2, 17, model.config.hidden_size);
  const Sequences want = Stateless(*backend, in);
  // Five blocks per sequence out of twelve, in no order; 4 and 8 stay unused.
  TestSession session({{7, 2, 11, 0, 5}, {3, 9, 1, 10, 6}}, 4);
  FeedInSteps(*backend, in, want, session, kPieces, DType::kF32);
}

// Two sequences of 17 tokens of a 2-layer model with config `c` (weights and
// inputs from `seed`), fed in pieces through 5 of 12 blocks each, in no
// order: each piece's outputs equal the stateless run's.
void ExpectStepsMatchStateless(const LlamaConfig& c, uint64_t seed,
                               std::optional<Fp8Quantization> fp8 = std::nullopt) {
  ModelSpan model = RandomModel(c, 0, 2, DType::kF32, seed);
  if (fp8) test_support::QuantizeSpanFp8(model, *fp8);
  std::unique_ptr<Backend> backend = MakeBackend(model, {12, 4});
  Rng rng(seed + 1);
  const Sequences in = RandomSequences(rng, 2, 17, model.config.hidden_size);
  const Sequences want = Stateless(*backend, in);
  TestSession session({{7, 2, 11, 0, 5}, {3, 9, 1, 10, 6}}, 4);
  FeedInSteps(*backend, in, want, session, kPieces, DType::kF32);
}

// Mixtral-style: the experts route each step's tokens as they would route
// the whole sequence (a mixture of experts changes nothing about sessions).
TEST(CpuSessionsTest, StepsMatchStatelessMixtral) {
  ExpectStepsMatchStateless(MixtralStyleConfig(), 121);
}

// Qwen2-MoE-style: weights not renormalised, and a shared expert.
TEST(CpuSessionsTest, StepsMatchStatelessQwen2Moe) {
  ExpectStepsMatchStateless(cpu_test::Qwen2MoeStyleConfig(), 123);
}

// FP8 checkpoints: each token's activations are quantized on their own (per
// token, or per token and 128 channels), so a session's steps equal the
// stateless run as in any other checkpoint.
TEST(CpuSessionsTest, StepsMatchStatelessFp8) {
  ExpectStepsMatchStateless(cpu_test::Llama3StyleConfig(), 127, test_support::FineGrainedFp8());
  ExpectStepsMatchStateless(cpu_test::Qwen3MoeStyleConfig(), 129, test_support::PerChannelFp8());
}

// Qwen3-style: the cached keys are the normalised, rotated ones.
TEST(CpuSessionsTest, StepsMatchStatelessQwen3) {
  ExpectStepsMatchStateless(cpu_test::Qwen3StyleConfig(), 125);
}

// llama3-scaled RoPE (positions matter), head_dim 128, 2 query heads per KV
// head, three sequences; then the same blocks reused by a second session in
// BF16, which overwrites every row from position 0.
TEST(CpuSessionsTest, StepsMatchStatelessGqa2HeadDim128Fp32AndBf16) {
  LlamaConfig c = Llama3StyleConfig();
  c.num_key_value_heads = 1;
  const ModelSpan model = RandomModel(c, 5, 2, DType::kF32, 103);
  std::unique_ptr<Backend> backend = MakeBackend(model, {16, 4});
  Rng rng(104);
  const Sequences in = RandomSequences(rng, 3, 17, model.config.hidden_size);
  const Sequences want = Stateless(*backend, in);
  const std::vector<std::vector<KvBlockId>> blocks = {
      {15, 4, 9, 0, 12}, {1, 14, 6, 11, 3}, {8, 2, 13, 5, 10}};
  {
    SCOPED_TRACE("FP32");
    TestSession session(blocks, 4);
    FeedInSteps(*backend, in, want, session, kPieces, DType::kF32);
  }
  {
    SCOPED_TRACE("BF16");
    TestSession session(blocks, 4);
    FeedInSteps(*backend, in, want, session, {4, 1, 1, 6, 5}, DType::kBF16);
  }
}

// Block tables from a real SessionTable: blocks of 3 tokens, ids as its
// allocator hands them out.
TEST(CpuSessionsTest, SessionTableStepsMatchStateless) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 105);
  SessionTableOptions options;
  options.num_blocks = 20;
  options.block_tokens = 3;
  auto table = SessionTable::Create(options);
  ASSERT_TRUE(table.ok()) << table.status();
  std::unique_ptr<Backend> backend = MakeBackend(model, {options.num_blocks, options.block_tokens});
  Rng rng(106);
  const Sequences in = RandomSequences(rng, 2, 13, model.config.hidden_size);
  const Sequences want = Stateless(*backend, in);
  TestSession session(table->get(), 1);
  FeedInSteps(*backend, in, want, session, {4, 1, 1, 5, 2}, DType::kF32);
}

// One batch: a step of session A (B = 2, at position 5), a stateless request,
// and a step of session B (B = 1, at position 9), in three dtypes.
TEST(CpuSessionsTest, BatchMixesStatelessRequestAndTwoSessions) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 107);
  std::unique_ptr<Backend> backend = MakeBackend(model, {16, 4});
  const int64_t hidden = model.config.hidden_size;
  Rng rng(108);
  const Sequences a = RandomSequences(rng, 2, 8, hidden);
  const Sequences b = RandomSequences(rng, 1, 10, hidden);
  const Sequences s = RandomSequences(rng, 1, 7, hidden);
  const Sequences want_a = Stateless(*backend, a);
  const Sequences want_b = Stateless(*backend, b);
  const Sequences want_s = Stateless(*backend, s);
  TestSession session_a({{0, 5}, {9, 2}}, 4);
  TestSession session_b({{12, 7, 14}}, 4);
  // Both prefills in one batch too.
  RunParts(*backend, {{&a, &want_a, 0, 5, DType::kF32, &session_a},
                      {&b, &want_b, 0, 9, DType::kF32, &session_b}});
  RunParts(*backend, {{&a, &want_a, 5, 8, DType::kF32, &session_a},
                      {&s, &want_s, 0, 7, DType::kBF16},
                      {&b, &want_b, 9, 10, DType::kF16, &session_b}});
}

// ---- rollback -----------------------------------------------------------

// Rolling back to position p and sending other tokens must equal never having
// sent the dropped ones: the step overwrites their rows, and later steps read
// the new ones. Once mid-block (10 -> 6) and once on a block boundary
// (12 -> 4), through a real SessionTable (which truncates the tables).
TEST(CpuSessionsTest, RollbackEqualsNeverSendingTheDroppedTokens) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 109);
  SessionTableOptions options;
  options.num_blocks = 12;
  options.block_tokens = 4;
  auto table = SessionTable::Create(options);
  ASSERT_TRUE(table.ok()) << table.status();
  std::unique_ptr<Backend> backend = MakeBackend(model, {options.num_blocks, options.block_tokens});
  Rng rng(110);
  const Sequences x = RandomSequences(rng, 2, 12, model.config.hidden_size);
  const Sequences y = Diverge(x, 6, rng);
  const Sequences z = Diverge(y, 4, rng);
  const Sequences want_x = Stateless(*backend, x);
  const Sequences want_y = Stateless(*backend, y);
  const Sequences want_z = Stateless(*backend, z);
  TestSession session(table->get(), 7);
  {
    SCOPED_TRACE("x: 0..9");
    FeedInSteps(*backend, x, want_x, session, {7, 3}, DType::kF32);
  }
  {
    SCOPED_TRACE("y: back to 6, then 6..11");
    FeedInSteps(*backend, y, want_y, session, {3, 1, 2}, DType::kF32, 6);
  }
  {
    SCOPED_TRACE("z: back to 4, then 4..11");
    FeedInSteps(*backend, z, want_z, session, {2, 1, 5}, DType::kF32, 4);
  }
}

// ---- sliding windows ----------------------------------------------------

// Steps far past the window (20 tokens, windows of 4 and 5, blocks of 3) give
// what the stateless whole sequence gives through the windowed attention
// (which cpu_backend_test checks against the float64 reference).
void CheckWindowedSession(const ModelSpan& model, uint64_t seed) {
  std::unique_ptr<Backend> backend = MakeBackend(model, {14, 3});
  Rng rng(seed);
  const Sequences in = RandomSequences(rng, 2, 20, model.config.hidden_size);
  const Sequences want = Stateless(*backend, in);
  TestSession session({{13, 0, 7, 2, 11, 4, 9}, {6, 1, 12, 3, 8, 10, 5}}, 3);
  FeedInSteps(*backend, in, want, session, {6, 1, 1, 5, 1, 6}, DType::kF32);
}

TEST(CpuSessionsTest, MistralSlidingWindowStepsPastTheWindow) {
  CheckWindowedSession(RandomModel(MistralStyleConfig(), 1, 2, DType::kF32, 111), 112);
}

TEST(CpuSessionsTest, Qwen2WindowInLaterLayersStepsPastTheWindow) {
  // Of the span 1:3, layer 1 attends fully and layer 2 through a window of 5.
  LlamaConfig c = Qwen2StyleConfig();
  c.num_hidden_layers = 4;
  c.sliding_window = 5;
  c.sliding_layers = {false, false, true, true};
  CheckWindowedSession(RandomModel(c, 1, 2, DType::kF32, 113), 114);
}

// ---- the KV cache hooks -------------------------------------------------

TEST(CpuSessionsTest, KvCacheHooks) {
  // 2 layers x (K, V) x 16 tokens x 1 KV head x 64 dims x 4 bytes.
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 115);
  auto backend = MakeCpuBackend(model, CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->KvBlockBytes(16), 2 * 2 * 16 * 64 * 4);
  EXPECT_EQ((*backend)->KvBlockBytes(0), 0);
  EXPECT_GT((*backend)->KvMemoryAvailable(), 0);

  EXPECT_EQ((*backend)->AllocateKvCache({-1, 16}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*backend)->AllocateKvCache({4, 0}).code(), absl::StatusCode::kInvalidArgument);
  // 2^30 blocks of 2^16 tokens: 2^56 bytes, which no machine has.
  const absl::Status huge = (*backend)->AllocateKvCache({1 << 30, 1 << 16});
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted) << huge;
  EXPECT_THAT(huge.message(), HasSubstr(absl::StrCat(int64_t{1} << 56, " bytes")));
  const absl::Status overflow = (*backend)->AllocateKvCache({1 << 30, int64_t{1} << 40});
  EXPECT_EQ(overflow.code(), absl::StatusCode::kResourceExhausted) << overflow;

  // None of the failures installed a pool: this one does, once.
  EXPECT_TRUE((*backend)->AllocateKvCache({4, 16}).ok());
  EXPECT_EQ((*backend)->AllocateKvCache({4, 16}).code(), absl::StatusCode::kFailedPrecondition);
}

// ---- errors -------------------------------------------------------------

// A one-request batch of B = 1, T = 2 tokens: a session step at position 0 of
// a table with block ids {0}, for the error tests to spoil.
BuiltBatch OneStep(const Sequences& in) {
  BuiltBatch built = BuildBatch({{1, 2, DType::kF32}}, in.Rows(0, 2), in.hidden);
  InferRequest& request = *built.batch->requests[0];
  request.session = SessionParams{SessionId(1)};
  request.step.position = 0;
  request.step.tokens = 2;
  request.step.block_tokens = 4;
  request.step.block_tables = {{0}};
  built.batch->Pack();
  return built;
}

TEST(CpuSessionsTest, SessionStepWithoutACacheFails) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 1, DType::kF32, 117);
  Rng rng(118);
  const Sequences in = RandomSequences(rng, 1, 4, model.config.hidden_size);
  auto backend = MakeCpuBackend(model, CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::Status s = RunSync(**backend, OneStep(in).batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("no KV cache"));

  // A pool of no blocks is allowed, and is no cache either.
  ASSERT_TRUE((*backend)->AllocateKvCache({0, 4}).ok());
  s = RunSync(**backend, OneStep(in).batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ((*backend)->AllocateKvCache({8, 4}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CpuSessionsTest, BadStepsFailAndTheBackendKeepsServing) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 1, DType::kF32, 119);
  std::unique_ptr<Backend> backend = MakeBackend(model, {8, 4});
  Rng rng(120);
  const Sequences in = RandomSequences(rng, 1, 4, model.config.hidden_size);

  struct BadCase {
    const char* what;
    void (*spoil)(Batch&);
    const char* message;
  };
  const BadCase cases[] = {
      {"block id outside the pool", [](Batch& b) { b.requests[0]->step.block_tables = {{8}}; },
       "outside the pool"},
      {"negative block id", [](Batch& b) { b.requests[0]->step.block_tables = {{-1}}; },
       "outside the pool"},
      {"table too short for position + T",
       [](Batch& b) {
         b.requests[0]->step.position = 3;
         b.requests[0]->step.block_tables = {{0}};
       },
       "1 blocks for 2 needed"},
      {"no table", [](Batch& b) { b.requests[0]->step.block_tables.clear(); },
       "does not match its shape"},
      {"block size not the pool's", [](Batch& b) { b.requests[0]->step.block_tokens = 3; },
       "does not match its shape"},
      {"kv entries not packed", [](Batch& b) { b.kv.clear(); }, "kv entries"},
      {"has_sessions not set", [](Batch& b) { b.has_sessions = false; }, "kv entries"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.what);
    // Spoiled after Pack, as a buggy caller would.
    BuiltBatch built = OneStep(in);
    c.spoil(*built.batch);
    const absl::Status s = RunSync(*backend, built.batch);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }

  // The good step still computes what a stateless request does.
  const Sequences want = Stateless(*backend, in);
  TestSession session({{3}}, 4);
  FeedInSteps(*backend, in, want, session, {2, 1, 1}, DType::kF32);
}

}  // namespace
}  // namespace layerserve
