// CUDA graphs in the CUDA backend (server/cuda/forward_graphs.h). The oracle:
// a backend that replays captured graphs gives, bit for bit, the outputs of
// one that launches every kernel directly (--cuda-graph-max-tokens=0), since
// both run the same kernels on the same data, and the padding a graph's plan
// gets is idle work. Checked over many decode steps of three sessions whose
// contexts cross key tiles, so that the paged plan under one graph changes
// from step to step; over prefills, through flash attention; and over
// stateless batches of repeating sizes. The launches must go direct (first
// batch of a shape), captured (second), then replayed. And the plan counts'
// rounding, on the host, and the fallback when a capture fails.
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_resources.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/core/sessions.h"
#include "server/cuda/cuda_backend.h"
#include "server/cuda/forward_graphs.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/support/random_model.h"

namespace layerserve {
namespace {

using cuda_test::MakeQwenModel;
using cuda_test::RunSync;
using test_support::Rng;

std::unique_ptr<InferRequest> Copy(const InferRequest& r) {
  auto copy = std::make_unique<InferRequest>();
  copy->dtype = r.dtype;
  copy->batch = r.batch;
  copy->seq_len = r.seq_len;
  copy->hidden = r.hidden;
  copy->input = r.input;
  copy->output.assign(r.input.size(), '\xff');
  copy->session = r.session;
  copy->step = r.step;
  return copy;
}

// The rounding that lets nearby plans share a graph (host code: runs
// without a GPU): never below the count, at most a fifth idle, and few
// distinct values.
TEST(GraphPlanCountTest, RoundsUpToAQuarterOfTheLargestPowerOfTwo) {
  EXPECT_EQ(cuda::GraphPlanCount(0), 0);
  EXPECT_EQ(cuda::GraphPlanCount(4), 4);
  EXPECT_EQ(cuda::GraphPlanCount(5), 5);
  EXPECT_EQ(cuda::GraphPlanCount(17), 20);
  EXPECT_EQ(cuda::GraphPlanCount(33), 40);
  EXPECT_EQ(cuda::GraphPlanCount(64), 64);
  EXPECT_EQ(cuda::GraphPlanCount(66), 80);
  std::set<int64_t> distinct;
  for (int64_t n = 1; n <= 1024; ++n) {
    const int64_t padded = cuda::GraphPlanCount(n);
    ASSERT_GE(padded, n);
    ASSERT_LE(5 * (padded - n), padded) << n << " pads to " << padded;
    distinct.insert(padded);
  }
  EXPECT_LE(distinct.size(), 4u + 4u * 9u);  // 1..4, then four per octave up to 1024
}

// Which batches take the graph path (host code: runs without a GPU): small
// ones, untimed, onto an idle device; behind a computing batch, direct.
TEST(UseForwardGraphTest, OnlySmallUntimedBatchesOntoAnIdleDevice) {
  EXPECT_TRUE(cuda::UseForwardGraph(1, 256, /*timed=*/false, 0));
  EXPECT_TRUE(cuda::UseForwardGraph(256, 256, false, 0));
  EXPECT_FALSE(cuda::UseForwardGraph(257, 256, false, 0));
  EXPECT_FALSE(cuda::UseForwardGraph(1, 0, false, 0));  // --cuda-graph-max-tokens=0
  EXPECT_FALSE(cuda::UseForwardGraph(1, 256, /*timed=*/true, 0));
  EXPECT_FALSE(cuda::UseForwardGraph(1, 256, false, 1));
  EXPECT_FALSE(cuda::UseForwardGraph(64, 256, false, 3));
}

class CudaGraphsTest : public ::testing::Test {
 protected:
  static constexpr KvCacheShape kCache{512, 16};

  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    model_ = MakeQwenModel(DType::kBF16, 401);
    for (const int64_t graph_tokens : {int64_t{0}, int64_t{256}}) {
      CudaBackendOptions options;
      options.num_streams = 1;  // one stream: one cache of graphs sees every batch
      options.max_batch_tokens = 512;
      options.cuda_graph_max_tokens = graph_tokens;
      // The built-in GEMM table on both: two autotune passes may pick
      // different split counts, which round differently.
      options.gemm_tuning.autotune = false;
      // No warm-up batches: they would be the first of some shapes here.
      options.warm_up = false;
      auto backend = MakeCudaBackend(model_, options);
      ASSERT_TRUE(backend.ok()) << backend.status();
      ASSERT_TRUE((*backend)->AllocateKvCache(kCache).ok());
      (graph_tokens == 0 ? direct_ : graphed_) = *std::move(backend);
    }
    SessionTableOptions options;
    options.num_blocks = kCache.num_blocks;
    options.block_tokens = kCache.block_tokens;
    auto table = SessionTable::Create(options);
    ASSERT_TRUE(table.ok()) << table.status();
    table_ = *std::move(table);
  }

  int64_t hidden() const { return model_.config.hidden_size; }

  // A BF16 request of `tokens` tokens per sequence, random in [-2, 2); the
  // fixture keeps its input (requests do not own theirs).
  std::unique_ptr<InferRequest> RandomRequest(int64_t batch, int64_t tokens) {
    auto r = std::make_unique<InferRequest>();
    r->dtype = DType::kBF16;
    r->batch = batch;
    r->seq_len = tokens;
    r->hidden = hidden();
    std::vector<float> values(static_cast<size_t>(batch * tokens * hidden()));
    for (float& v : values) v = static_cast<float>(rng_.Uniform(-2, 2));
    std::string& input = inputs_.emplace_back(values.size() * 2, '\0');
    ConvertFromFloat(values.data(), values.size(), DType::kBF16, input.data());
    r->input = input;
    r->output.assign(input.size(), '\xff');
    return r;
  }

  // A step of `tokens` tokens for each of session `id`'s `batch` sequences
  // (opening it on its first step).
  std::unique_ptr<InferRequest> Step(int64_t id, int64_t batch, int64_t tokens) {
    const bool start = !started_[id];
    started_[id] = true;
    absl::StatusOr<SessionStep> step =
        table_->BeginStep({.id = SessionId(id), .start = start, .batch = batch, .tokens = tokens}, SteadyTime{});
    EXPECT_TRUE(step.ok()) << step.status();
    auto r = RandomRequest(batch, tokens);
    r->session = SessionParams{SessionId(id)};
    if (step.ok()) r->step = *std::move(step);
    return r;
  }

  // Runs `requests` as one batch on both backends, finishes their session
  // steps, and expects the same bytes out of both; returns how the graphed
  // backend launched it.
  std::string RunBoth(std::vector<std::unique_ptr<InferRequest>> requests, const std::string& what) {
    auto on_direct = std::make_shared<Batch>();
    auto on_graphs = std::make_shared<Batch>();
    for (auto& r : requests) {
      on_direct->requests.push_back(Copy(*r));
      on_graphs->requests.push_back(std::move(r));
    }
    on_direct->Pack();
    on_graphs->Pack();
    const absl::Status direct = RunSync(*direct_, on_direct);
    const absl::Status graphed = RunSync(*graphed_, on_graphs);
    for (const auto& r : on_graphs->requests) {
      if (r->session) EXPECT_TRUE(table_->FinishStep(r->session->id, true, false, SteadyTime{}).ok());
    }
    EXPECT_TRUE(direct.ok()) << what << ": " << direct;
    EXPECT_TRUE(graphed.ok()) << what << ": " << graphed;
    EXPECT_EQ(on_direct->timings.launch, "direct") << what;
    for (size_t i = 0; i < on_graphs->requests.size(); ++i) {
      const std::string& want = on_direct->requests[i]->output;
      const std::string& got = on_graphs->requests[i]->output;
      EXPECT_TRUE(got.size() == want.size() && std::memcmp(got.data(), want.data(), want.size()) == 0)
          << what << ": request " << i << " differs between graph and direct launches";
    }
    return std::string(on_graphs->timings.launch);
  }

  ModelSpan model_;
  std::unique_ptr<CudaBackend> direct_;
  std::unique_ptr<CudaBackend> graphed_;
  std::unique_ptr<SessionTable> table_;
  std::map<int64_t, bool> started_;
  Rng rng_{402};
  std::deque<std::string> inputs_;
};

TEST_F(CudaGraphsTest, DecodeStepsReplayBitForBit) {
  // Prefills of 30 tokens (one batch: flash attention, no cached keys), then
  // 150 steps of one token for sessions of 1, 1 and 2 sequences: contexts
  // 30 to 180 cross key tiles of 64 twice, so the plan's splits change.
  std::vector<std::unique_ptr<InferRequest>> prefill;
  prefill.push_back(Step(1, 1, 30));
  prefill.push_back(Step(2, 1, 30));
  prefill.push_back(Step(3, 2, 30));
  EXPECT_EQ(RunBoth(std::move(prefill), "prefill"), "direct");
  std::map<std::string, int> launches;
  std::vector<std::string> first_three;
  for (int step = 0; step < 150 && !HasFailure(); ++step) {
    std::vector<std::unique_ptr<InferRequest>> batch;
    for (int64_t id : {1, 2, 3}) batch.push_back(Step(id, id == 3 ? 2 : 1, 1));
    const std::string launch = RunBoth(std::move(batch), "decode step " + std::to_string(step));
    ++launches[launch];
    if (first_three.size() < 3) first_three.push_back(launch);
  }
  EXPECT_EQ(first_three, (std::vector<std::string>{"direct", "captured", "replayed"}));
  // One key per padded plan size (a handful), each direct once and captured
  // once: every other step replays.
  EXPECT_GE(launches["replayed"], 130) << launches["direct"] << " direct, " << launches["captured"] << " captured";
  EXPECT_EQ(launches["direct"], launches["captured"]);
}

TEST_F(CudaGraphsTest, StatelessBatchesReplayBitForBit) {
  // Sizes 1..6 one-token requests, and a 5-token request beside 3 one-token
  // ones, each shape three times: direct, captured, replayed.
  for (int round = 0; round < 3 && !HasFailure(); ++round) {
    const std::string want = round == 0 ? "direct" : round == 1 ? "captured" : "replayed";
    for (int n = 1; n <= 6; ++n) {
      std::vector<std::unique_ptr<InferRequest>> batch;
      for (int i = 0; i < n; ++i) batch.push_back(RandomRequest(1, 1));
      EXPECT_EQ(RunBoth(std::move(batch), absl::StrCat(n, " one-token requests, round ", round)), want);
    }
    std::vector<std::unique_ptr<InferRequest>> mixed;
    mixed.push_back(RandomRequest(1, 5));
    for (int i = 0; i < 3; ++i) mixed.push_back(RandomRequest(1, 1));
    EXPECT_EQ(RunBoth(std::move(mixed), absl::StrCat("mixed lengths, round ", round)), want);
  }
  // Past --cuda-graph-max-tokens a batch always launches directly.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::unique_ptr<InferRequest>> big;
    big.push_back(RandomRequest(1, 300));
    EXPECT_EQ(RunBoth(std::move(big), "300 tokens"), "direct");
  }
}

// A key's second batch launches directly and enqueues the rest of its work
// before its capture, so that the capture overlaps the device's work rather
// than delaying it; the third replays the capture. Each batch's layers run
// on its own input.
TEST(ForwardGraphsTest, TheSecondBatchRunsDirectlyAndIsCapturedAfterItsRest) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  absl::StatusOr<cuda::CudaStream> stream = cuda::CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<cuda::DeviceBuffer> word = cuda::DeviceBuffer::Allocate(sizeof(int32_t));
  ASSERT_TRUE(word.ok()) << word.status();
  absl::StatusOr<cuda::PinnedBuffer> host = cuda::PinnedBuffer::Allocate(sizeof(int32_t));
  ASSERT_TRUE(host.ok()) << host.status();
  cuda::ForwardGraphs graphs(4);
  const cuda::ForwardGraphKey key{.tokens = 2, .num_seqs = 1, .max_seqlen = 2};
  // The "layers" copy the batch's input (a fixed buffer, refilled for each
  // batch, as the backend's are) to the word; "the rest" copies the word to
  // the host. A graph replays the copy it captured, of whatever the input
  // holds then.
  absl::StatusOr<cuda::DeviceBuffer> input = cuda::DeviceBuffer::Allocate(sizeof(int32_t));
  ASSERT_TRUE(input.ok()) << input.status();
  std::vector<std::string> calls;
  const std::vector<std::vector<std::string>> want_calls = {
      {"forward", "rest"}, {"forward", "rest", "forward"}, {"rest"}};
  const std::vector<cuda::GraphLaunch> want_launch = {cuda::GraphLaunch::kDirect, cuda::GraphLaunch::kCaptured,
                                                      cuda::GraphLaunch::kReplayed};
  for (int batch = 0; batch < 3; ++batch) {
    const int32_t value = 100 * (batch + 1) + 7;
    ASSERT_EQ(cudaMemcpy(input->data(), &value, sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
    calls.clear();
    // One 4-byte copy on the stream, logged as `call`.
    const auto copy = [&](const char* call, void* dst, const void* src, cudaMemcpyKind kind) -> absl::Status {
      calls.push_back(call);
      if (cudaMemcpyAsync(dst, src, sizeof(int32_t), kind, stream->get()) != cudaSuccess) {
        return absl::InternalError("cudaMemcpyAsync failed");
      }
      return absl::OkStatus();
    };
    const auto forward = [&] { return copy("forward", word->data(), input->data(), cudaMemcpyDeviceToDevice); };
    const auto rest = [&] { return copy("rest", host->data(), word->data(), cudaMemcpyDeviceToHost); };
    absl::StatusOr<cuda::GraphLaunch> launch = graphs.Run(key, stream->get(), forward, rest);
    ASSERT_TRUE(launch.ok()) << "batch " << batch << ": " << launch.status();
    EXPECT_EQ(*launch, want_launch[batch]) << "batch " << batch;
    EXPECT_EQ(calls, want_calls[batch]) << "batch " << batch;
    ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
    int32_t got = 0;
    std::memcpy(&got, host->data(), sizeof(got));
    EXPECT_EQ(got, value) << "batch " << batch << ": its layers did not run on its input";
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A capture that fails (here: the recorded work queries its stream, which a
// thread-local capture forbids) costs the batch nothing: its work runs
// directly, and the stream launches directly from then on.
TEST(ForwardGraphsTest, AFailedCaptureFallsBackToDirectLaunches) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  absl::StatusOr<cuda::CudaStream> stream = cuda::CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<cuda::DeviceBuffer> word = cuda::DeviceBuffer::Allocate(sizeof(int32_t));
  ASSERT_TRUE(word.ok()) << word.status();
  cuda::ForwardGraphs graphs(4);
  const cuda::ForwardGraphKey key{.tokens = 1, .num_seqs = 1, .max_seqlen = 1};
  for (int batch = 1; batch <= 3; ++batch) {
    // The batch's "work": fill the word with its number's byte.
    const auto forward = [&]() -> absl::Status {
      if (cudaMemsetAsync(word->data(), batch, sizeof(int32_t), stream->get()) != cudaSuccess) {
        return absl::InternalError("cudaMemsetAsync failed");
      }
      static_cast<void>(cudaStreamQuery(stream->get()));  // legal unless capturing
      return absl::OkStatus();
    };
    absl::StatusOr<cuda::GraphLaunch> launch = graphs.Run(key, stream->get(), forward, [] { return absl::OkStatus(); });
    ASSERT_TRUE(launch.ok()) << "batch " << batch << ": " << launch.status();
    EXPECT_EQ(*launch, cuda::GraphLaunch::kDirect) << "batch " << batch;
    ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
    int32_t got = 0;
    ASSERT_EQ(cudaMemcpy(&got, word->data(), sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
    const int32_t byte = batch;
    EXPECT_EQ(got, byte | byte << 8 | byte << 16 | byte << 24) << "batch " << batch << "'s work did not run";
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace layerserve
