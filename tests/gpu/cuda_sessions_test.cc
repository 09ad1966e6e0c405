// Sessions on the CUDA backend (docs/sessions.md; server/cuda/kv_pool.h). The
// oracle: a session fed its sequences in steps must give every new token the
// hidden state that one stateless request over the whole sequences gives it
// (on the CUDA backend itself, whose stateless path is flash attention), and
// what the CPU backend's sessions give it, both at the backend's bf16
// precision (backend_test_util.h). Block tables come from a real SessionTable
// used as the batcher uses it, and each step runs on both backends with the
// same table (their pools have one shape).
//
// Steps cover a prefill, single tokens and multi-token steps that cross
// blocks of 16 and of 5 tokens, B > 1 sequences, head_dim 64 and 128 with GQA,
// bf16 and fp16 checkpoints, a mixture of experts, FP32/BF16/FP16 on the wire; a batch mixing a
// stateless request with two sessions' steps; a long request computed in
// chunked pieces; sliding-window models stepped far past their window;
// rollbacks that overwrite rows already written; sessions on several streams
// at once; then the KV cache hooks, and the session errors the backend
// reports through `done`.
#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/core/clock.h"
#include "server/core/kv_blocks.h"
#include "server/core/kv_cache_dtype.h"
#include "server/core/sessions.h"
#include "server/cpu/cpu_backend.h"
#include "server/cuda/cuda_backend.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/support/model_zoo.h"
#include "tests/support/random_model.h"

namespace layerserve {
namespace {

using cuda_test::ExpectCloseValues;
using cuda_test::MakeQwenModel;
using cuda_test::OutputFloats;
using cuda_test::RunSync;
using cuda_test::Start;
using cuda_test::Wait;
using test_support::Rng;
using ::testing::HasSubstr;

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
      out.insert(out.end(), x.begin() + (b * tokens + begin) * hidden, x.begin() + (b * tokens + end) * hidden);
    }
    return out;
  }
};

// Values in [-2, 2) representable in BF16, so every wire dtype carries them.
Sequences RandomSequences(Rng& rng, int64_t batch, int64_t tokens, int64_t hidden) {
  Sequences s{batch, tokens, hidden, std::vector<float>(static_cast<size_t>(batch * tokens * hidden))};
  for (float& v : s.x) v = static_cast<float>(rng.Uniform(-2, 2));
  std::vector<uint16_t> bf16(s.x.size());
  ConvertFromFloat(s.x.data(), s.x.size(), DType::kBF16, bf16.data());
  ConvertToFloat(DType::kBF16, bf16.data(), s.x.size(), s.x.data());
  return s;
}

// Another history: the first `keep` tokens of every sequence, then fresh ones.
Sequences Diverge(const Sequences& s, int64_t keep, Rng& rng) {
  Sequences out = s;
  const Sequences fresh = RandomSequences(rng, s.batch, s.tokens, s.hidden);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t row = b * s.tokens;
    std::copy(fresh.x.begin() + (row + keep) * s.hidden, fresh.x.begin() + (row + s.tokens) * s.hidden,
              out.x.begin() + (row + keep) * s.hidden);
  }
  return out;
}

// A request over `input` (owned by the caller), its output poisoned with
// 0xff bytes (NaN in every dtype).
std::unique_ptr<InferRequest> MakeRequest(const std::string& input, int64_t batch, int64_t seq_len, int64_t hidden,
                                          DType dtype) {
  auto r = std::make_unique<InferRequest>();
  r->dtype = dtype;
  r->batch = batch;
  r->seq_len = seq_len;
  r->hidden = hidden;
  r->input = input;
  r->output.assign(input.size(), '\xff');
  return r;
}

std::string Encode(const std::vector<float>& values, DType dtype) {
  std::string bytes(values.size() * DTypeSize(dtype), '\0');
  ConvertFromFloat(values.data(), values.size(), dtype, bytes.data());
  return bytes;
}

// The stateless answer for `in`: one FP32 request over the whole sequences.
Sequences Stateless(Backend& backend, const Sequences& in) {
  const std::string input = Encode(in.x, DType::kF32);
  auto batch = std::make_shared<Batch>();
  batch->requests.push_back(MakeRequest(input, in.batch, in.tokens, in.hidden, DType::kF32));
  batch->Pack();
  const absl::Status status = RunSync(backend, batch);
  EXPECT_TRUE(status.ok()) << status;
  Sequences out = in;
  out.x = OutputFloats(*batch->requests[0]);
  return out;
}

// ---- backends and sessions ----------------------------------------------

// The CUDA backend under test and the CPU reference, each with a KV pool of
// `cache`'s shape, so that one session table's block ids serve both.
struct Backends {
  std::unique_ptr<CudaBackend> cuda;
  std::unique_ptr<Backend> cpu;
};

Backends MakeBackends(const ModelSpan& model, const KvCacheShape& cache, int num_streams = 1,
                      KvCacheDType kv_dtype = KvCacheDType::kActivation) {
  CudaBackendOptions options;
  options.num_streams = num_streams;
  options.max_batch_tokens = 512;
  options.kv_cache_dtype = kv_dtype;
  Backends b;
  auto cuda = MakeCudaBackend(model, options);
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  auto cpu = MakeCpuBackend(model, CpuBackendOptions{.num_threads = 2, .kv_cache_dtype = kv_dtype});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cuda.ok() || !cpu.ok()) return b;
  b.cuda = *std::move(cuda);
  b.cpu = *std::move(cpu);
  EXPECT_TRUE(b.cuda->AllocateKvCache(cache).ok());
  EXPECT_TRUE(b.cpu->AllocateKvCache(cache).ok());
  return b;
}

std::unique_ptr<SessionTable> MakeTable(const KvCacheShape& cache) {
  SessionTableOptions options;
  options.num_blocks = cache.num_blocks;
  options.block_tokens = cache.block_tokens;
  auto table = SessionTable::Create(options);
  EXPECT_TRUE(table.ok()) << table.status();
  return table.ok() ? *std::move(table) : nullptr;
}

// One session of a SessionTable, stepped as the batcher steps it: BeginStep
// before the step (a position below the length rolls back), FinishStep after.
class TestSession {
 public:
  TestSession(SessionTable* table, int64_t id) : table_(table), id_(id) {}

  SessionStep Begin(int64_t batch, int64_t position, int64_t tokens) {
    SessionStepRequest request;
    request.id = id_;
    request.start = !started_;
    request.batch = batch;
    request.tokens = tokens;
    request.position = position;
    absl::StatusOr<SessionStep> step = table_->BeginStep(request, SteadyTime{});
    EXPECT_TRUE(step.ok()) << step.status();
    started_ = true;
    return step.ok() ? *std::move(step) : SessionStep{};
  }

  void Finish(bool ok) {
    EXPECT_TRUE(table_->FinishStep(id_, ok, /*end=*/false, SteadyTime{}).ok());
    EXPECT_TRUE(table_->CheckConsistency().ok());
  }

  const SessionId& id() const { return id_; }

 private:
  SessionTable* table_;
  SessionId id_;
  bool started_ = false;
};

// One request of a test batch: rows [begin, end) of every sequence of `in`,
// stateless (begin 0) without a session, otherwise a step of `session` at
// position `begin`. Its output must match the same rows of `want` (when
// set) and the CPU backend's.
struct Part {
  const Sequences* in;
  const Sequences* want;
  int64_t begin;
  int64_t end;
  DType dtype = DType::kF32;
  TestSession* session = nullptr;
};

// Runs `parts` as one batch on both backends (one session step each, shared),
// finishes the steps, and checks every CUDA output against its rows of the
// stateless answer and against the CPU backend's output.
void RunParts(const Backends& backends, const std::vector<Part>& parts) {
  std::vector<std::string> inputs;
  for (const Part& part : parts) inputs.push_back(Encode(part.in->Rows(part.begin, part.end), part.dtype));
  auto on_cuda = std::make_shared<Batch>();
  auto on_cpu = std::make_shared<Batch>();
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& part = parts[i];
    SessionStep step;
    if (part.session != nullptr) step = part.session->Begin(part.in->batch, part.begin, part.end - part.begin);
    for (Batch* batch : {on_cuda.get(), on_cpu.get()}) {
      auto r = MakeRequest(inputs[i], part.in->batch, part.end - part.begin, part.in->hidden, part.dtype);
      r->id = "part" + std::to_string(i);
      if (part.session != nullptr) {
        r->session = SessionParams{part.session->id()};
        r->step = step;
      }
      batch->requests.push_back(std::move(r));
    }
  }
  on_cuda->Pack();
  on_cpu->Pack();
  const absl::Status cuda_status = RunSync(*backends.cuda, on_cuda);
  const absl::Status cpu_status = RunSync(*backends.cpu, on_cpu);
  for (const Part& part : parts) {
    if (part.session != nullptr) part.session->Finish(cuda_status.ok() && cpu_status.ok());
  }
  ASSERT_TRUE(cuda_status.ok()) << cuda_status;
  ASSERT_TRUE(cpu_status.ok()) << cpu_status;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& part = parts[i];
    const std::string what =
        absl::StrCat("part ", i, " (rows ", part.begin, "..", part.end - 1, ", ",
                     std::string(DTypeProtocolName(part.dtype)), part.session ? ", session" : "", ")");
    const std::vector<float> got = OutputFloats(*on_cuda->requests[i]);
    if (part.want != nullptr) {
      ExpectCloseValues(got, part.want->Rows(part.begin, part.end), part.in->hidden, what + ", cuda vs stateless");
    }
    ExpectCloseValues(got, OutputFloats(*on_cpu->requests[i]), part.in->hidden, what + ", cuda vs cpu");
  }
}

// Feeds rows [start, start + sum(pieces)) of `in` to `session`, one step of
// `pieces[i]` tokens per batch, each checked against `want`.
void FeedInSteps(const Backends& backends, const Sequences& in, const Sequences& want, TestSession& session,
                 const std::vector<int64_t>& pieces, DType dtype, int64_t start = 0) {
  int64_t position = start;
  for (const int64_t t : pieces) {
    SCOPED_TRACE(::testing::Message() << "step of " << t << " tokens at position " << position);
    RunParts(backends, {{&in, &want, position, position + t, dtype, &session}});
    if (::testing::Test::HasFailure()) return;
    position += t;
  }
}

// A llama3-style span: head_dim 128, 4 query heads per KV head, llama3 RoPE
// scaling whose scaled bands matter at these positions.
ModelSpan MakeLlama3Model(uint64_t seed) {
  const LlamaConfig c = test_support::Llama3GqaConfig();
  return test_support::RandomModel(c, 0, 2, DType::kBF16, seed);
}

// ---- the oracle ---------------------------------------------------------

// B sequences of sum(pieces) tokens fed in `pieces`, on a pool of `cache`.
void CheckSteps(const ModelSpan& model, const KvCacheShape& cache, int64_t batch, const std::vector<int64_t>& pieces,
                DType dtype, uint64_t seed) {
  const Backends backends = MakeBackends(model, cache);
  ASSERT_NE(backends.cuda, nullptr);
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  Rng rng(seed);
  int64_t tokens = 0;
  for (const int64_t t : pieces) tokens += t;
  const Sequences in = RandomSequences(rng, batch, tokens, model.config.hidden_size);
  const Sequences want = Stateless(*backends.cuda, in);
  TestSession session(table.get(), 1);
  FeedInSteps(backends, in, want, session, pieces, dtype);
}

// Prefill 20, then steps of 1, 1, 5, 1, 16 and 1 token: 45 in all, across
// blocks of 16 (a step ends on a boundary, another crosses one).
const std::vector<int64_t> kPieces = {20, 1, 1, 5, 1, 16, 1};

// --kv-cache-dtype=fp8: a session attends over K and V as the FP8 cache
// holds them (its first prefill too, over the rows the append wrote back),
// so its oracle is the CPU backend with the same cache (whose numerics
// cpu_kv_cache_fp8_test checks against the float64 reference); the
// attention kernel's are paged_attention_test's. A stateless request in
// every batch must still equal the stateless answer. head_dim 64 and 128.
TEST(CudaSessionsTest, Fp8CacheStepsMatchTheCpuBackendsFp8Cache) {
  SKIP_WITHOUT_GPU();
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama3, head_dim 128" : "qwen2, head_dim 64");
    const ModelSpan model = llama ? MakeLlama3Model(241) : MakeQwenModel(DType::kBF16, 243);
    const KvCacheShape cache{64, 16};
    const Backends backends = MakeBackends(model, cache, 1, KvCacheDType::kFp8E4M3);
    ASSERT_NE(backends.cuda, nullptr);
    const int64_t kv_heads = model.config.num_key_value_heads;
    EXPECT_EQ(backends.cuda->KvBlockBytes(16), 2 * 2 * 16 * (kv_heads * model.config.head_dim + 4 * kv_heads));
    std::unique_ptr<SessionTable> table = MakeTable(cache);
    Rng rng(245);
    const Sequences in = RandomSequences(rng, 2, 45, model.config.hidden_size);
    const Sequences other = RandomSequences(rng, 1, 9, model.config.hidden_size);
    const Sequences other_want = Stateless(*backends.cuda, other);
    TestSession session(table.get(), 1);
    int64_t position = 0;
    for (const int64_t t : kPieces) {
      SCOPED_TRACE(::testing::Message() << "step of " << t << " tokens at position " << position);
      RunParts(backends, {{&in, nullptr, position, position + t, DType::kF32, &session},
                          {&other, &other_want, 0, 9, DType::kF32, nullptr}});
      if (::testing::Test::HasFailure()) return;
      position += t;
    }
  }
}

TEST(CudaSessionsTest, StepsMatchStatelessQwen2Bf16HeadDim64) {
  SKIP_WITHOUT_GPU();
  CheckSteps(MakeQwenModel(DType::kBF16, 201), {64, 16}, 2, kPieces, DType::kF32, 202);
}

// fp16 checkpoint: the backend computes, caches and attends in fp16.
TEST(CudaSessionsTest, StepsMatchStatelessQwen2Fp16) {
  SKIP_WITHOUT_GPU();
  CheckSteps(MakeQwenModel(DType::kF16, 203), {64, 16}, 2, kPieces, DType::kF16, 204);
}

// head_dim 128, three sequences, blocks of 5 tokens.
TEST(CudaSessionsTest, StepsMatchStatelessLlama3HeadDim128Block5) {
  SKIP_WITHOUT_GPU();
  CheckSteps(MakeLlama3Model(205), {64, 5}, 3, {7, 1, 3, 1, 1, 9, 2}, DType::kBF16, 206);
}

// Qwen3's head norms in the session path's kernel (RoPE and the cache write
// in one launch): the cache must hold the normed, rotated keys.
TEST(CudaSessionsTest, StepsMatchStatelessQwen3HeadNormsHeadDim128) {
  SKIP_WITHOUT_GPU();
  LlamaConfig c = MakeLlama3Model(0).config;
  c.model_type = "qwen3";
  c.qk_norm = true;
  CheckSteps(test_support::RandomModel(c, 0, 2, DType::kBF16, 217), {64, 16}, 2, kPieces, DType::kF32, 218);
}

// A Mixtral-style span (8 experts, 2 per token; the grouped GEMMs and the
// routing kernels) stepped like the dense ones. The router is scaled up
// tenfold over RandomModel's, so that no token's top two are nearly tied:
// the session path's attention rounds differently from the stateless one's,
// and a near tie could then pick another expert, which the dense oracle's
// tolerance cannot excuse (cuda_backend_test checks routing near ties).
TEST(CudaSessionsTest, StepsMatchStatelessMixtral) {
  SKIP_WITHOUT_GPU();
  const LlamaConfig c = cuda_test::MixtralTestConfig();
  ModelSpan model = test_support::RandomModel(c, 0, c.num_hidden_layers, DType::kBF16, 209);
  for (LayerWeights& layer : model.layers) {
    std::vector<float> router = layer.router.ToFloat();
    for (float& w : router) w *= 10.0f;
    ConvertFromFloat(router.data(), router.size(), DType::kBF16, layer.router.data.data());
  }
  CheckSteps(model, {64, 16}, 2, kPieces, DType::kF32, 210);
}

// One batch: a step of session A (B = 2, at position 9), a stateless request,
// and a step of session B (B = 1, at position 17), in three dtypes; before
// it, both prefills in one batch.
TEST(CudaSessionsTest, BatchMixesStatelessRequestAndTwoSessions) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 207);
  const KvCacheShape cache{64, 16};
  const Backends backends = MakeBackends(model, cache);
  ASSERT_NE(backends.cuda, nullptr);
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  const int64_t hidden = model.config.hidden_size;
  Rng rng(208);
  const Sequences a = RandomSequences(rng, 2, 12, hidden);
  const Sequences b = RandomSequences(rng, 1, 18, hidden);
  const Sequences s = RandomSequences(rng, 1, 7, hidden);
  const Sequences want_a = Stateless(*backends.cuda, a);
  const Sequences want_b = Stateless(*backends.cuda, b);
  const Sequences want_s = Stateless(*backends.cuda, s);
  TestSession session_a(table.get(), 1);
  TestSession session_b(table.get(), 2);
  RunParts(backends, {{&a, &want_a, 0, 9, DType::kF32, &session_a}, {&b, &want_b, 0, 17, DType::kF32, &session_b}});
  RunParts(backends, {{&a, &want_a, 9, 12, DType::kF32, &session_a},
                      {&s, &want_s, 0, 7, DType::kBF16},
                      {&b, &want_b, 17, 18, DType::kF16, &session_b}});
}

// A request of T = 40 tokens computed in pieces of 16, 16 and 8 (chunked
// prefill: each piece a step in a batch of its own, the second beside a
// stateless request), answered whole after the last: equal to the stateless
// answer on every row, so each piece was read from and written to its rows.
TEST(CudaSessionsTest, ChunkedRequestMatchesStateless) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 209);
  const KvCacheShape cache{64, 16};
  const Backends backends = MakeBackends(model, cache);
  ASSERT_NE(backends.cuda, nullptr);
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  const int64_t hidden = model.config.hidden_size;
  Rng rng(210);
  const Sequences in = RandomSequences(rng, 2, 40, hidden);
  const Sequences other = RandomSequences(rng, 1, 5, hidden);
  const Sequences want = Stateless(*backends.cuda, in);
  const Sequences want_other = Stateless(*backends.cuda, other);
  const std::string input = Encode(in.x, DType::kBF16);
  const std::string other_input = Encode(other.x, DType::kF32);
  TestSession session(table.get(), 3);
  std::unique_ptr<InferRequest> request = MakeRequest(input, 2, 40, hidden, DType::kBF16);
  request->session = SessionParams{session.id()};
  for (const auto& [begin, tokens] : std::vector<std::pair<int64_t, int64_t>>{{0, 16}, {16, 16}, {32, 8}}) {
    SCOPED_TRACE(::testing::Message() << "piece at " << begin);
    request->chunk_begin = begin;
    request->chunk_tokens = tokens;
    request->step = session.Begin(2, begin, tokens);
    auto batch = std::make_shared<Batch>();
    batch->requests.push_back(std::move(request));
    if (begin == 16) batch->requests.push_back(MakeRequest(other_input, 1, 5, hidden, DType::kF32));
    batch->Pack();
    const absl::Status status = RunSync(*backends.cuda, batch);
    session.Finish(status.ok());
    ASSERT_TRUE(status.ok()) << status;
    if (begin == 16) {
      ExpectCloseValues(OutputFloats(*batch->requests[1]), want_other.x, hidden, "stateless request beside a piece");
    }
    request = std::move(batch->requests[0]);
  }
  ExpectCloseValues(OutputFloats(*request), want.x, hidden, "chunked request, all 40 rows");
}

// ---- sliding windows ----------------------------------------------------

// A windowed span stepped far past its window: session steps attend through
// the paged kernel's window, the stateless answer through flash attention's
// and the CPU backend through its own, and all three must agree. The prefill
// alone is longer than the window, so flash attention skips key tiles there.
TEST(CudaSessionsTest, SlidingWindowStepsPastTheWindowHeadDim64) {
  SKIP_WITHOUT_GPU();
  ModelSpan model = MakeQwenModel(DType::kBF16, 213);
  model.config.sliding_window = 40;  // every layer
  CheckSteps(model, {64, 16}, 2, {130, 1, 1, 70, 1, 47}, DType::kF32, 214);
}

// head_dim 128 (flash attention v8 on Hopper), a window in layer 0 only,
// blocks of 5 tokens.
TEST(CudaSessionsTest, WindowInOneLayerStepsPastTheWindowHeadDim128) {
  SKIP_WITHOUT_GPU();
  ModelSpan model = MakeLlama3Model(215);
  model.config.sliding_window = 100;
  model.config.sliding_layers = {true, false};
  CheckSteps(model, {128, 5}, 1, {200, 1, 150, 1, 3}, DType::kBF16, 216);
}

// ---- rollback -----------------------------------------------------------

// Rolling back to position p and sending other tokens must equal never having
// sent the dropped ones: the step overwrites their rows, and later steps read
// the new ones. Once mid-block (10 -> 6) and once on a block boundary
// (12 -> 4), blocks of 4 tokens; the table frees and reassigns the blocks.
TEST(CudaSessionsTest, RollbackEqualsNeverSendingTheDroppedTokens) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 211);
  const KvCacheShape cache{12, 4};
  const Backends backends = MakeBackends(model, cache);
  ASSERT_NE(backends.cuda, nullptr);
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  Rng rng(212);
  const Sequences x = RandomSequences(rng, 2, 12, model.config.hidden_size);
  const Sequences y = Diverge(x, 6, rng);
  const Sequences z = Diverge(y, 4, rng);
  const Sequences want_x = Stateless(*backends.cuda, x);
  const Sequences want_y = Stateless(*backends.cuda, y);
  const Sequences want_z = Stateless(*backends.cuda, z);
  TestSession session(table.get(), 7);
  {
    SCOPED_TRACE("x: 0..9");
    FeedInSteps(backends, x, want_x, session, {7, 3}, DType::kF32);
  }
  {
    SCOPED_TRACE("y: back to 6, then 6..11");
    FeedInSteps(backends, y, want_y, session, {3, 1, 2}, DType::kF32, 6);
  }
  {
    SCOPED_TRACE("z: back to 4, then 4..11");
    FeedInSteps(backends, z, want_z, session, {2, 1, 5}, DType::kF32, 4);
  }
}

// ---- streams ------------------------------------------------------------

// Four sessions stepped at once on three streams: each round submits one
// batch per session before waiting for any, so steps of different sessions
// overlap on the stream pool (each stream with its own KV staging) while
// each session has one step in flight.
TEST(CudaSessionsTest, SessionsOnSeveralStreamsAtOnce) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 213);
  const KvCacheShape cache{64, 16};
  const Backends backends = MakeBackends(model, cache, /*num_streams=*/3);
  ASSERT_NE(backends.cuda, nullptr);
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  const int64_t hidden = model.config.hidden_size;
  const std::vector<int64_t> pieces = {9, 1, 8, 1, 1};
  constexpr int kSessions = 4;
  Rng rng(214);
  std::vector<Sequences> in, want;
  std::vector<std::unique_ptr<TestSession>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    in.push_back(RandomSequences(rng, 1 + i % 2, 20, hidden));
    want.push_back(Stateless(*backends.cuda, in.back()));
    sessions.push_back(std::make_unique<TestSession>(table.get(), 100 + i));
  }
  int64_t position = 0;
  for (const int64_t t : pieces) {
    SCOPED_TRACE(::testing::Message() << "round at position " << position);
    std::vector<std::string> inputs;
    std::vector<std::shared_ptr<Batch>> batches;
    std::vector<std::future<absl::Status>> futures;
    for (int i = 0; i < kSessions; ++i) inputs.push_back(Encode(in[i].Rows(position, position + t), DType::kF32));
    for (int i = 0; i < kSessions; ++i) {
      auto batch = std::make_shared<Batch>();
      batch->requests.push_back(MakeRequest(inputs[i], in[i].batch, t, hidden, DType::kF32));
      batch->requests[0]->session = SessionParams{sessions[i]->id()};
      batch->requests[0]->step = sessions[i]->Begin(in[i].batch, position, t);
      batch->Pack();
      batches.push_back(batch);
      futures.push_back(Start(*backends.cuda, batch));
    }
    for (int i = 0; i < kSessions; ++i) {
      const absl::Status status = Wait(futures[i]);
      sessions[i]->Finish(status.ok());
      ASSERT_TRUE(status.ok()) << "session " << i << ": " << status;
      ExpectCloseValues(OutputFloats(*batches[i]->requests[0]), want[i].Rows(position, position + t), hidden,
                        "session " + std::to_string(i));
    }
    position += t;
  }
}

// ---- the KV cache hooks -------------------------------------------------

TEST(CudaSessionsTest, KvCacheHooks) {
  SKIP_WITHOUT_GPU();
  // 2 layers x (K, V) x 16 tokens x 2 KV heads x 64 dims x 2 bytes (bf16).
  const ModelSpan model = MakeQwenModel(DType::kBF16, 215);
  auto backend = MakeCudaBackend(model, CudaBackendOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->KvBlockBytes(16), 2 * 2 * 16 * 2 * 64 * 2);
  EXPECT_EQ((*backend)->KvBlockBytes(0), 0);
  // What is free, less 1 GiB kept back (within 64 MiB: the device is shared).
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const int64_t available = (*backend)->KvMemoryAvailable();
  EXPECT_GT(available, 0);
  EXPECT_NEAR(static_cast<double>(available + (int64_t{1} << 30)), static_cast<double>(free_bytes), 64 << 20);

  EXPECT_EQ((*backend)->AllocateKvCache({-1, 16}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*backend)->AllocateKvCache({4, 0}).code(), absl::StatusCode::kInvalidArgument);
  // The kernels address a block's rows with int32.
  EXPECT_EQ((*backend)->AllocateKvCache({4, int64_t{1} << 40}).code(), absl::StatusCode::kInvalidArgument);
  // 2^30 blocks of 2^16 tokens at 2^10 bytes a token: 2^56 bytes, which no GPU has.
  const absl::Status huge = (*backend)->AllocateKvCache({1 << 30, 1 << 16});
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted) << huge;
  EXPECT_THAT(huge.message(), HasSubstr(absl::StrCat(int64_t{1} << 56, " bytes")));
  const absl::Status overflow = (*backend)->AllocateKvCache({INT32_MAX, INT32_MAX});
  EXPECT_EQ(overflow.code(), absl::StatusCode::kResourceExhausted) << overflow;

  // None of the failures installed a pool: this one does, once, and takes
  // the device memory it names.
  const int64_t pool_bytes = 256 * (*backend)->KvBlockBytes(16);
  ASSERT_TRUE((*backend)->AllocateKvCache({256, 16}).ok());
  EXPECT_LE((*backend)->KvMemoryAvailable(), available - pool_bytes);
  EXPECT_EQ((*backend)->AllocateKvCache({4, 16}).code(), absl::StatusCode::kFailedPrecondition);

  // The failed allocations left nothing behind: a batch still computes.
  Rng rng(216);
  Stateless(**backend, RandomSequences(rng, 1, 9, model.config.hidden_size));
  EXPECT_TRUE((*backend)->Health().ok());
}

// ---- errors -------------------------------------------------------------

// A batch of one request of B sequences of T = 2 tokens: a session step at
// `position` with the given tables (blocks of 4), for the error tests.
std::shared_ptr<Batch> HandMadeStep(const std::string& input, int64_t hidden, int64_t position,
                                    std::vector<std::vector<KvBlockId>> tables) {
  auto batch = std::make_shared<Batch>();
  const int64_t b = static_cast<int64_t>(tables.size());
  batch->requests.push_back(MakeRequest(input, b, 2, hidden, DType::kF32));
  InferRequest& request = *batch->requests[0];
  request.session = SessionParams{SessionId(1)};
  request.step.position = position;
  request.step.tokens = 2;
  request.step.block_tokens = 4;
  request.step.block_tables = std::move(tables);
  batch->Pack();
  return batch;
}

TEST(CudaSessionsTest, SessionStepWithoutACacheFails) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 217);
  const int64_t hidden = model.config.hidden_size;
  auto backend = MakeCudaBackend(model, CudaBackendOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status();
  Rng rng(218);
  const std::string input = Encode(RandomSequences(rng, 1, 2, hidden).x, DType::kF32);
  absl::Status s = RunSync(**backend, HandMadeStep(input, hidden, 0, {{0}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("no KV cache"));

  // A pool of no blocks is allowed, and is no cache either.
  ASSERT_TRUE((*backend)->AllocateKvCache({0, 4}).ok());
  s = RunSync(**backend, HandMadeStep(input, hidden, 0, {{0}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ((*backend)->AllocateKvCache({8, 4}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*backend)->Health().ok());
}

TEST(CudaSessionsTest, BadStepsFailAndTheBackendKeepsServing) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 219);
  const int64_t hidden = model.config.hidden_size;
  const KvCacheShape cache{8, 4};
  const Backends backends = MakeBackends(model, cache);
  ASSERT_NE(backends.cuda, nullptr);
  Rng rng(220);
  const std::string one = Encode(RandomSequences(rng, 1, 2, hidden).x, DType::kF32);
  const std::string three = Encode(RandomSequences(rng, 3, 2, hidden).x, DType::kF32);

  // Caught by Batch::Validate.
  absl::Status s = RunSync(*backends.cuda, HandMadeStep(one, hidden, 0, {{8}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("outside the pool"));
  // Each table is valid, but together they name 9 blocks of a pool of 8: the
  // sequences share blocks, which the metadata staging (sized for the pool)
  // refuses rather than overflow.
  s = RunSync(*backends.cuda, HandMadeStep(three, hidden, 8, {{0, 1, 2}, {3, 4, 5}, {6, 7, 0}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("share blocks"));
  EXPECT_TRUE(backends.cuda->Health().ok());

  // A good session still computes what a stateless request does.
  std::unique_ptr<SessionTable> table = MakeTable(cache);
  const Sequences in = RandomSequences(rng, 1, 6, hidden);
  const Sequences want = Stateless(*backends.cuda, in);
  TestSession session(table.get(), 5);
  FeedInSteps(backends, in, want, session, {3, 1, 2}, DType::kF32);
}

}  // namespace
}  // namespace layerserve
