// The whole CPU backend (MakeCpuBackend + Execute) against a stack of float64
// reference decoder layers: the demo model, a random qwen2-style model with
// q/k/v biases and GQA ratio 4, and a random llama model with llama3 RoPE
// scaling and BF16 weights; FP32, FP16 and BF16 requests, several packed
// sequences per batch. Outputs are poisoned with NaN bytes first, so a row the
// backend forgot to write fails the comparison.
#include "server/cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <future>

#include "absl/synchronization/mutex.h"
#include "base/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/llama_reference.h"
#include "tests/support/random_model.h"
#include "tests/support/reference_model.h"
#include "tests/unit/cpu/backend_test_util.h"

namespace layerserve {
namespace {

using cpu_test::BuildBatch;
using cpu_test::BuiltBatch;
using cpu_test::ExpectOutputsMatch;
using cpu_test::Llama3StyleConfig;
using cpu_test::MistralStyleConfig;
using cpu_test::MixtralStyleConfig;
using cpu_test::Qwen2MoeStyleConfig;
using cpu_test::Qwen2StyleConfig;
using cpu_test::RepresentableInputs;
using cpu_test::RequestShape;
using cpu_test::Rng;
using cpu_test::RunSync;
using test_support::RandomModel;
using test_support::ReferenceForward;
using test_support::ReferenceModel;
using test_support::ToReference;
using ::testing::HasSubstr;

// ---- models -------------------------------------------------------------

// ---- tests --------------------------------------------------------------

// Runs `model` on FP32, FP16 and BF16 batches of the same activations and on a
// batch mixing all three, against the reference.
void CheckModel(const ModelSpan& model, int num_threads, double fp32_tol, uint64_t seed) {
  auto backend = MakeCpuBackend(model, CpuBackendOptions{num_threads});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Name(), "cpu");
  EXPECT_EQ((*backend)->MaxInflightBatches(), 1);
  const int64_t hidden = model.config.hidden_size;
  // Sequences of 1, 7, 7, 13 tokens (a request with B = 2 in the middle).
  const std::vector<std::pair<int64_t, int64_t>> layout = {{1, 1}, {2, 7}, {1, 13}};
  const std::vector<int32_t> cu_seqlens = {0, 1, 8, 15, 28};
  Rng rng(seed);
  const std::vector<float> x = RepresentableInputs(rng, static_cast<size_t>(28 * hidden));
  const std::vector<double> want =
      ReferenceForward(ToReference(model), cpu_test::ToDouble(x), cu_seqlens);

  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(std::string("batch dtype ") + std::string(DTypeProtocolName(dtype)));
    std::vector<RequestShape> shapes;
    for (const auto& [b, t] : layout) shapes.push_back({b, t, dtype});
    BuiltBatch built = BuildBatch(shapes, x, hidden);
    ASSERT_EQ(built.batch->cu_seqlens, cu_seqlens);
    ASSERT_TRUE(RunSync(**backend, built.batch).ok());
    ExpectOutputsMatch(*built.batch, want, fp32_tol);
  }
  BuiltBatch mixed =
      BuildBatch({{1, 1, DType::kBF16}, {2, 7, DType::kF32}, {1, 13, DType::kF16}}, x, hidden);
  ASSERT_TRUE(RunSync(**backend, mixed.batch).ok());
  ExpectOutputsMatch(*mixed.batch, want, fp32_tol);
}

TEST(CpuBackendTest, DemoModelMatchesReference) {
  CheckModel(MakeDemoModel(LayerRange{}), /*num_threads=*/2, 1e-5, 11);
}

TEST(CpuBackendTest, Qwen2StyleWithBiasesMatchesReference) {
  CheckModel(RandomModel(Qwen2StyleConfig(), 0, 2, DType::kF32, 12), /*num_threads=*/2, 1e-5, 13);
}

TEST(CpuBackendTest, Llama3ScaledBf16WeightsMatchReference) {
  // A span from the middle of the model, single-threaded.
  CheckModel(RandomModel(Llama3StyleConfig(), 5, 2, DType::kBF16, 14), /*num_threads=*/1, 1e-5, 15);
}

TEST(CpuBackendTest, MistralSlidingWindowMatchesReference) {
  CheckModel(RandomModel(MistralStyleConfig(), 1, 2, DType::kF32, 16), /*num_threads=*/2, 1e-5, 17);
}

TEST(CpuBackendTest, Qwen2WindowOnlyInLaterLayersMatchesReference) {
  // use_sliding_window with max_window_layers 2: of the span 1:3, layer 1
  // attends fully and layer 2 through a window of 5.
  LlamaConfig c = Qwen2StyleConfig();
  c.num_hidden_layers = 4;
  c.sliding_window = 5;
  c.sliding_layers = {false, false, true, true};
  CheckModel(RandomModel(c, 1, 2, DType::kF32, 18), /*num_threads=*/2, 1e-5, 19);
}

TEST(CpuBackendTest, MixtralExpertsMatchReference) {
  CheckModel(RandomModel(MixtralStyleConfig(), 0, 2, DType::kF32, 23), /*num_threads=*/2, 1e-5, 24);
}

TEST(CpuBackendTest, Qwen2MoeSharedExpertMatchesReference) {
  CheckModel(RandomModel(Qwen2MoeStyleConfig(), 0, 2, DType::kF32, 25), /*num_threads=*/2, 1e-5,
             26);
  // norm_topk_prob true, BF16 weights, a span from the middle.
  LlamaConfig c = Qwen2MoeStyleConfig();
  c.num_hidden_layers = 4;
  c.normalize_top_k = true;
  CheckModel(RandomModel(c, 1, 2, DType::kBF16, 27), /*num_threads=*/1, 1e-5, 28);
}

TEST(CpuBackendTest, Qwen3HeadNormsMatchReference) {
  CheckModel(RandomModel(cpu_test::Qwen3StyleConfig(), 0, 2, DType::kF32, 29), /*num_threads=*/2,
             1e-5, 30);
  CheckModel(RandomModel(cpu_test::Qwen3MoeStyleConfig(), 0, 2, DType::kBF16, 31),
             /*num_threads=*/2, 1e-5, 32);
}

// Batch::expert_tokens: per layer, every token counted once per choice.
TEST(CpuBackendTest, MixtralCountsTokensPerExpert) {
  const ModelSpan model = RandomModel(MixtralStyleConfig(), 0, 2, DType::kF32, 23);
  auto backend = MakeCpuBackend(model, CpuBackendOptions{2});
  ASSERT_TRUE(backend.ok()) << backend.status();
  Rng rng(27);
  const int64_t hidden = model.config.hidden_size;
  const std::vector<float> x = RepresentableInputs(rng, static_cast<size_t>(9 * hidden));
  BuiltBatch built = BuildBatch({{1, 4, DType::kF32}, {1, 5, DType::kBF16}}, x, hidden);
  ASSERT_TRUE(RunSync(**backend, built.batch).ok());
  const std::vector<int64_t>& counts = built.batch->expert_tokens;
  ASSERT_EQ(counts.size(), 2u * 8u);
  for (int layer = 0; layer < 2; ++layer) {
    int64_t sum = 0;
    for (int e = 0; e < 8; ++e) sum += counts[layer * 8 + e];
    EXPECT_EQ(sum, 9 * 2) << "layer " << layer;
  }
  // A dense span reports none.
  auto dense = MakeCpuBackend(MakeDemoModel(LayerRange{0, 1}), CpuBackendOptions{1});
  ASSERT_TRUE(dense.ok());
  const std::vector<float> y = RepresentableInputs(rng, 2 * 512);
  BuiltBatch dense_batch = BuildBatch({{1, 2, DType::kF32}}, y, 512);
  ASSERT_TRUE(RunSync(**dense, dense_batch.batch).ok());
  EXPECT_TRUE(dense_batch.batch->expert_tokens.empty());
}

TEST(CpuBackendTest, MixtralTopOneOfManyExpertsMatchesReference) {
  // 32 experts and one per token: most experts see no token of the batch's 28.
  LlamaConfig c = MixtralStyleConfig();
  c.num_experts = 32;
  c.experts_per_token = 1;
  CheckModel(RandomModel(c, 1, 2, DType::kBF16, 25), /*num_threads=*/1, 1e-5, 26);
}

// The window test above would pass vacuously if windowed and full attention
// agreed on its inputs: they must differ well beyond the tolerance.
TEST(CpuBackendTest, SlidingWindowChangesTheAnswer) {
  const ModelSpan model = RandomModel(MistralStyleConfig(), 1, 2, DType::kF32, 16);
  ReferenceModel windowed = ToReference(model);
  ReferenceModel full = windowed;
  for (int64_t& w : full.windows) w = 0;
  Rng rng(17);
  const int64_t hidden = model.config.hidden_size;
  const std::vector<float> x = RepresentableInputs(rng, static_cast<size_t>(13 * hidden));
  const std::vector<double> a = ReferenceForward(windowed, cpu_test::ToDouble(x), {0, 13});
  const std::vector<double> b = ReferenceForward(full, cpu_test::ToDouble(x), {0, 13});
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  EXPECT_GT(worst, 1e-2 * cpu_test::Rms(a));
}

TEST(CpuBackendTest, QueuedBatchesAllCompleteInOrder) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 1, DType::kF32, 21);
  auto backend = MakeCpuBackend(model, CpuBackendOptions{2});
  ASSERT_TRUE(backend.ok()) << backend.status();
  Rng rng(22);
  const int64_t hidden = model.config.hidden_size;
  const ReferenceModel ref = ToReference(model);
  std::vector<BuiltBatch> batches;
  std::vector<std::vector<double>> wants;
  for (int64_t t : {3, 1, 5}) {
    const std::vector<float> x = RepresentableInputs(rng, static_cast<size_t>(t * hidden));
    wants.push_back(ReferenceForward(ref, cpu_test::ToDouble(x), {0, static_cast<int32_t>(t)}));
    batches.push_back(BuildBatch({{1, t, DType::kF32}}, x, hidden));
  }
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::promise<absl::Status>> results(batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    (*backend)->Execute(batches[i].batch, [&, i](absl::Status s) {
      {
        absl::MutexLock lock(&mu);
        order.push_back(static_cast<int>(i));
      }
      results[i].set_value(std::move(s));
    });
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    ASSERT_TRUE(results[i].get_future().get().ok());
    ExpectOutputsMatch(*batches[i].batch, wants[i], 1e-5);
  }
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

TEST(CpuBackendTest, DestructionFinishesQueuedBatches) {
  const ModelSpan model = RandomModel(Qwen2StyleConfig(), 0, 1, DType::kF32, 31);
  Rng rng(32);
  const std::vector<float> x = RepresentableInputs(rng, 4 * 256);
  std::vector<BuiltBatch> batches;
  std::atomic<int> done_ok{0};
  {
    auto backend = MakeCpuBackend(model, CpuBackendOptions{1});
    ASSERT_TRUE(backend.ok()) << backend.status();
    for (int i = 0; i < 4; ++i) {
      batches.push_back(BuildBatch({{1, 4, DType::kBF16}}, x, 256));
      (*backend)->Execute(batches.back().batch, [&](absl::Status s) { done_ok += s.ok(); });
    }
  }
  EXPECT_EQ(done_ok.load(), 4);
}

TEST(CpuBackendTest, EmptyBatchIsOk) {
  auto backend = MakeCpuBackend(MakeDemoModel(LayerRange{0, 1}), CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto batch = std::make_shared<Batch>();
  batch->Pack();
  EXPECT_TRUE(RunSync(**backend, batch).ok());
}

TEST(CpuBackendTest, RejectsInconsistentBatches) {
  const ModelSpan model = MakeDemoModel(LayerRange{0, 1});
  auto backend = MakeCpuBackend(model, CpuBackendOptions{1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  Rng rng(41);
  const std::vector<float> x = RepresentableInputs(rng, 6 * 512);

  BuiltBatch wrong_cu = BuildBatch({{2, 3, DType::kF32}}, x, 512);
  wrong_cu.batch->cu_seqlens = {0, 6};  // one sequence of 6, not two of 3
  absl::Status s = RunSync(**backend, wrong_cu.batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;

  BuiltBatch wrong_hidden = BuildBatch({{1, 3, DType::kF32}}, x, 512);
  wrong_hidden.batch->requests[0]->hidden = 256;
  s = RunSync(**backend, wrong_hidden.batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("req0"));

  BuiltBatch short_input = BuildBatch({{1, 3, DType::kF32}}, x, 512);
  short_input.batch->requests[0]->input.remove_suffix(4);
  s = RunSync(**backend, short_input.batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // The backend still serves after rejecting batches.
  BuiltBatch good = BuildBatch({{1, 3, DType::kF32}}, x, 512);
  EXPECT_TRUE(RunSync(**backend, good.batch).ok());
}

TEST(CpuBackendTest, RejectsBadModels) {
  ModelSpan empty = MakeDemoModel(LayerRange{0, 1});
  empty.layers.clear();
  EXPECT_EQ(MakeCpuBackend(empty, {}).status().code(), absl::StatusCode::kInvalidArgument);

  ModelSpan wrong_shape = MakeDemoModel(LayerRange{2, 3});
  wrong_shape.layers[0].up_proj.shape = {10, 512};
  wrong_shape.layers[0].up_proj.data.resize(10 * 512 * 4);
  auto backend = MakeCpuBackend(wrong_shape, {});
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(), HasSubstr("layer 2 up_proj"));

  ModelSpan missing_bias = RandomModel(Qwen2StyleConfig(), 0, 1, DType::kF32, 51);
  missing_bias.layers[0].k_bias = HostTensor{};
  backend = MakeCpuBackend(missing_bias, {});
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(), HasSubstr("k_bias"));

  EXPECT_EQ(MakeCpuBackend(MakeDemoModel(LayerRange{}), CpuBackendOptions{-1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layerserve
