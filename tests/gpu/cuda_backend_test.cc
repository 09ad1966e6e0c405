// The CUDA backend against the CPU backend (the float32 reference) on the demo
// model and on small random qwen2-style models with q/k/v biases (bf16 and
// fp16 checkpoints): mixed batches of (B, T) from T=1 to T=1000 in FP32, FP16
// and BF16, poisoned outputs, sliding-window models far past their window,
// concurrent batches over the stream pool, failed batches that leave the
// backend healthy, kernel timings and memory reports; Mixtral-, Qwen2-MoE-
// and Qwen3-MoE-style mixtures of experts against the float64 reference, and
// Qwen3's head norms against the CPU backend.
//
// Outputs are compared at the backend's precision (backend_test_util.h).
// Without a GPU every device test skips visibly. Sessions are tested in
// cuda_sessions_test.cc.
#include "server/cuda/cuda_backend.h"

#include <future>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/cuda/cuda_status.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/cpu/cpu_backend.h"
#include "server/model/model.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/reference/llama_reference.h"
#include "tests/support/random_model.h"
#include "tests/support/reference_model.h"

namespace layerserve {
namespace {

using cuda_test::ExpectCloseValues;
using cuda_test::MakeQwenModel;
using cuda_test::OutputFloats;
using cuda_test::RunSync;
using cuda_test::Start;
using cuda_test::Wait;

struct RequestSpec {
  int64_t batch;
  int64_t seq_len;
  DType dtype;
};

// Request inputs, kept alive while any batch built from them runs.
struct Inputs {
  std::vector<RequestSpec> specs;
  std::vector<std::string> data;
};

Inputs RandomInputs(const std::vector<RequestSpec>& specs, int64_t hidden, std::mt19937& rng) {
  Inputs in;
  in.specs = specs;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const RequestSpec& s : specs) {
    std::vector<float> values(static_cast<size_t>(s.batch * s.seq_len * hidden));
    for (float& v : values) v = dist(rng);
    std::string bytes(values.size() * DTypeSize(s.dtype), '\0');
    ConvertFromFloat(values.data(), values.size(), s.dtype, bytes.data());
    in.data.push_back(std::move(bytes));
  }
  return in;
}

// A batch over `in` whose outputs are poisoned with 0xff bytes (NaN in every
// dtype), so an element the backend never writes fails the comparison.
std::shared_ptr<Batch> MakeBatch(const Inputs& in, int64_t hidden) {
  auto batch = std::make_shared<Batch>();
  for (size_t i = 0; i < in.specs.size(); ++i) {
    auto r = std::make_unique<InferRequest>();
    r->id = "r" + std::to_string(i);
    r->dtype = in.specs[i].dtype;
    r->batch = in.specs[i].batch;
    r->seq_len = in.specs[i].seq_len;
    r->hidden = hidden;
    r->input = in.data[i];
    r->output.assign(in.data[i].size(), '\xff');
    batch->requests.push_back(std::move(r));
  }
  batch->Pack();
  return batch;
}

// Compares every request's output; reports the worst element.
void ExpectClose(const Batch& actual, const Batch& expected, const std::string& what) {
  ASSERT_EQ(actual.requests.size(), expected.requests.size());
  for (size_t i = 0; i < actual.requests.size(); ++i) {
    const InferRequest& a = *actual.requests[i];
    const InferRequest& e = *expected.requests[i];
    ASSERT_EQ(a.output.size(), e.output.size()) << what << " request " << i;
    ExpectCloseValues(OutputFloats(a), OutputFloats(e), e.hidden,
                      what + " request " + std::to_string(i) + " (B=" + std::to_string(e.batch) + " T=" +
                          std::to_string(e.seq_len) + " " + std::string(DTypeProtocolName(e.dtype)) + "), cuda vs cpu");
    if (::testing::Test::HasFailure()) return;
  }
}

const std::vector<std::vector<RequestSpec>>& MixedBatches() {
  static const auto* batches = new std::vector<std::vector<RequestSpec>>{
      {{1, 1, DType::kF32}},
      {{1, 1, DType::kBF16}, {2, 7, DType::kF16}, {1, 33, DType::kF32}, {3, 1, DType::kBF16}},
      {{1, 1000, DType::kF32}},
      {{1, 1000, DType::kBF16}, {4, 16, DType::kF16}},
      {{2, 130, DType::kF16}, {1, 64, DType::kF32}},
      // Over 1 MiB in four requests: the stream's copy pool packs and
      // unpacks them in parallel.
      {{4, 200, DType::kF32}, {1, 300, DType::kBF16}, {3, 50, DType::kF16}, {2, 128, DType::kF32}},
  };
  return *batches;
}

void CompareOnModel(const ModelSpan& model, int num_streams) {
  CudaBackendOptions options;
  options.num_streams = num_streams;
  options.max_batch_tokens = 2048;
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = MakeCpuBackend(model, CpuBackendOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::mt19937 rng(1234);
  int index = 0;
  for (const auto& specs : MixedBatches()) {
    const Inputs in = RandomInputs(specs, model.config.hidden_size, rng);
    auto on_cuda = MakeBatch(in, model.config.hidden_size);
    auto on_cpu = MakeBatch(in, model.config.hidden_size);
    const absl::Status cuda_status = RunSync(**cuda, on_cuda);
    ASSERT_TRUE(cuda_status.ok()) << cuda_status;
    const absl::Status cpu_status = RunSync(**cpu, on_cpu);
    ASSERT_TRUE(cpu_status.ok()) << cpu_status;
    ExpectClose(*on_cuda, *on_cpu, model.name + " batch " + std::to_string(index++));
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_TRUE((*cuda)->Health().ok());
}

TEST(CudaBackendTest, MatchesCpuOnDemoModel) {
  SKIP_WITHOUT_GPU();
  CompareOnModel(MakeDemoModel(LayerRange{}), 2);
}

TEST(CudaBackendTest, MatchesCpuOnQwen2StyleBf16ModelWithBiases) {
  SKIP_WITHOUT_GPU();
  CompareOnModel(MakeQwenModel(DType::kBF16, 7), 1);
}

TEST(CudaBackendTest, MatchesCpuOnQwen2StyleFp16ModelWithBiases) {
  SKIP_WITHOUT_GPU();
  CompareOnModel(MakeQwenModel(DType::kF16, 11), 2);
}

// More batches than streams, all submitted at once: they queue, overlap on
// the pool and each completes exactly once with its own results.
TEST(CudaBackendTest, ConcurrentBatchesOverTheStreamPool) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeDemoModel(LayerRange{0, 2});
  CudaBackendOptions options;
  options.num_streams = 3;
  options.max_batch_tokens = 1024;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ((*cuda)->MaxInflightBatches(), 3);
  auto cpu = MakeCpuBackend(model, CpuBackendOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  std::mt19937 rng(99);
  constexpr int kBatches = 12;
  std::vector<Inputs> inputs;
  std::vector<std::shared_ptr<Batch>> batches;
  std::vector<std::future<absl::Status>> futures;
  for (int i = 0; i < kBatches; ++i) {
    const DType dtype = i % 3 == 0 ? DType::kF32 : i % 3 == 1 ? DType::kBF16 : DType::kF16;
    inputs.push_back(
        RandomInputs({{1 + i % 2, 1 + 37 * i, dtype}, {1, 5, DType::kF32}}, model.config.hidden_size, rng));
  }
  for (int i = 0; i < kBatches; ++i) {
    batches.push_back(MakeBatch(inputs[i], model.config.hidden_size));
    futures.push_back(Start(**cuda, batches.back()));
  }
  for (int i = 0; i < kBatches; ++i) {
    const absl::Status status = Wait(futures[i]);
    ASSERT_TRUE(status.ok()) << "batch " << i << ": " << status;
    auto reference = MakeBatch(inputs[i], model.config.hidden_size);
    ASSERT_TRUE(RunSync(**cpu, reference).ok());
    ExpectClose(*batches[i], *reference, "concurrent batch " + std::to_string(i));
  }
}

TEST(CudaBackendTest, FailedBatchFailsAloneAndBackendStaysHealthy) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeDemoModel(LayerRange{0, 1});
  CudaBackendOptions options;
  options.max_batch_tokens = 64;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::mt19937 rng(5);
  const int64_t hidden = model.config.hidden_size;

  const Inputs too_long = RandomInputs({{1, 65, DType::kF32}}, hidden, rng);
  EXPECT_EQ(RunSync(**cuda, MakeBatch(too_long, hidden)).code(), absl::StatusCode::kInvalidArgument);

  const Inputs wrong_hidden = RandomInputs({{1, 4, DType::kF32}}, hidden / 2, rng);
  EXPECT_EQ(RunSync(**cuda, MakeBatch(wrong_hidden, hidden / 2)).code(), absl::StatusCode::kInvalidArgument);

  const Inputs good = RandomInputs({{2, 32, DType::kBF16}}, hidden, rng);
  auto batch = MakeBatch(good, hidden);
  const absl::Status status = RunSync(**cuda, batch);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE((*cuda)->Health().ok());
  auto cpu = MakeCpuBackend(model, CpuBackendOptions{});
  ASSERT_TRUE(cpu.ok());
  auto reference = MakeBatch(good, hidden);
  ASSERT_TRUE(RunSync(**cpu, reference).ok());
  ExpectClose(*batch, *reference, "after failures");
}

// Sliding windows: flash attention applies each layer's window, so the
// backend serves a windowed model at any length and matches the CPU backend
// (which cpu_backend_test checks against a float64 reference) far past the
// window: sequences shorter than, as long as and longer than it in one batch.
void CompareWindowedModel(const ModelSpan& model, const std::vector<std::vector<RequestSpec>>& batches) {
  CudaBackendOptions options;
  options.max_batch_tokens = 2048;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  auto cpu = MakeCpuBackend(model, CpuBackendOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::mt19937 rng(17);
  const int64_t hidden = model.config.hidden_size;
  int index = 0;
  for (const auto& specs : batches) {
    const Inputs in = RandomInputs(specs, hidden, rng);
    auto batch = MakeBatch(in, hidden);
    const absl::Status status = RunSync(**cuda, batch);
    ASSERT_TRUE(status.ok()) << status;
    auto reference = MakeBatch(in, hidden);
    ASSERT_TRUE(RunSync(**cpu, reference).ok());
    ExpectClose(*batch, *reference, model.name + " windowed batch " + std::to_string(index++));
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_TRUE((*cuda)->Health().ok());
}

// Mistral's layout: every layer windowed (48 tokens), head_dim 64.
TEST(CudaBackendTest, SlidingWindowModelMatchesCpuPastTheWindow) {
  SKIP_WITHOUT_GPU();
  ModelSpan model = MakeQwenModel(DType::kBF16, 13);
  model.config.sliding_window = 48;
  CompareWindowedModel(model,
                       {
                           {{2, 48, DType::kBF16}, {1, 5, DType::kF32}, {1, 49, DType::kF16}},
                           {{1, 1000, DType::kBF16}},
                           {{1, 300, DType::kF32}, {2, 47, DType::kBF16}, {3, 1, DType::kF16}, {1, 130, DType::kF32}},
                       });
}

// Qwen2's layout: a window in some layers only (here layer 1 of 2, 100
// tokens), fp16, so each layer's own window reaches its kernel.
TEST(CudaBackendTest, WindowInSomeLayersMatchesCpuPastTheWindow) {
  SKIP_WITHOUT_GPU();
  ModelSpan model = MakeQwenModel(DType::kF16, 19);
  model.config.sliding_window = 100;
  model.config.sliding_layers = {false, true};
  CompareWindowedModel(model, {
                                  {{1, 700, DType::kF16}, {2, 100, DType::kF32}, {1, 101, DType::kBF16}},
                                  {{1, 1500, DType::kF32}},
                              });
}

// A one-layer mixture-of-experts span (8 experts of intermediate 384, bf16
// weights) against the float64 reference, over the mixed batches: from one
// token (top_k experts busy, the grouped GEMM's small-M path) to 1000 (every
// expert busy, the persistent path). bf16 moves a token's router logits a
// little, so a token whose top-k the reference finds nearly tied
// (probability gap between its k-th and next expert under 2e-2) may
// legitimately use another expert: such a token is excused when it differs,
// and at most 2% of the tokens may be. A token with a clear routing must
// match. One layer, so that every token's margin is known; deeper spans run
// the same code.
void ExpertsMatchReference(const LlamaConfig& c, uint64_t seed) {
  ASSERT_EQ(c.num_hidden_layers, 1);
  const ModelSpan model = test_support::RandomModel(c, 0, 1, DType::kBF16, seed);
  CudaBackendOptions options;
  options.max_batch_tokens = 2048;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const test_support::ReferenceModel ref = test_support::ToReference(model);
  const int64_t hidden = c.hidden_size;
  std::mt19937 rng(4321);
  int64_t tokens = 0, excused = 0, nearly_tied = 0;
  for (const auto& specs : MixedBatches()) {
    const Inputs in = RandomInputs(specs, hidden, rng);
    auto batch = MakeBatch(in, hidden);
    const absl::Status st = RunSync(**cuda, batch);
    ASSERT_TRUE(st.ok()) << st;
    // The inputs as the backend received them, packed as the batch is.
    std::vector<double> x;
    std::vector<float> got;
    for (const auto& r : batch->requests) {
      std::vector<float> values(r->num_elements());
      ConvertToFloat(r->dtype, r->input.data(), values.size(), values.data());
      x.insert(x.end(), values.begin(), values.end());
      const std::vector<float> out = OutputFloats(*r);
      got.insert(got.end(), out.begin(), out.end());
    }
    const std::vector<double> want = test_support::ReferenceForward(ref, x, batch->cu_seqlens);
    const std::vector<double> margins = reference::RoutingMargins(x, batch->cu_seqlens, ref.config, ref.layers[0]);
    double sum_sq = 0;
    for (const double w : want) sum_sq += w * w;
    const double rms = std::sqrt(sum_sq / static_cast<double>(want.size()));
    std::vector<float> expected(want.begin(), want.end());
    for (size_t t = 0; t < margins.size(); ++t) {
      if (margins[t] >= 2e-2) continue;
      ++nearly_tied;
      double worst = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        const double w = want[t * hidden + i];
        worst = std::max(worst, std::abs(got[t * hidden + i] - w) / (rms + std::abs(w)));
      }
      if (!(worst > cuda_test::kTol)) continue;
      ++excused;  // compared as equal below
      std::copy_n(got.begin() + t * hidden, hidden, expected.begin() + t * hidden);
    }
    tokens += static_cast<int64_t>(margins.size());
    // The routing's counts come back with the outputs, every choice once.
    ASSERT_EQ(batch->expert_tokens.size(), static_cast<size_t>(c.num_experts));
    EXPECT_EQ(std::accumulate(batch->expert_tokens.begin(), batch->expert_tokens.end(), int64_t{0}),
              c.experts_per_token * static_cast<int64_t>(margins.size()));
    ExpectCloseValues(got, expected, hidden, c.model_type + " batch of " + std::to_string(margins.size()) + " tokens");
    if (::testing::Test::HasFailure()) return;
  }
  std::printf("%s: %lld of %lld tokens nearly tied, %lld of them routed otherwise and excused\n", c.model_type.c_str(),
              static_cast<long long>(nearly_tied), static_cast<long long>(tokens), static_cast<long long>(excused));
  EXPECT_LE(excused * 50, tokens) << excused << " of " << tokens << " tokens routed otherwise";
  EXPECT_TRUE((*cuda)->Health().ok());
}

TEST(CudaBackendTest, MixtralExpertsMatchReference) {
  SKIP_WITHOUT_GPU();
  LlamaConfig c = cuda_test::MixtralTestConfig();
  c.num_hidden_layers = 1;
  ExpertsMatchReference(c, 29);
}

// Qwen2-MoE: 4 of 8 experts per token with their raw softmax weights
// (norm_topk_prob false), q/k/v biases, and the shared expert (its own width,
// scaled per token by the sigmoid of its gate) added on top.
TEST(CudaBackendTest, Qwen2MoeSharedExpertMatchesReference) {
  SKIP_WITHOUT_GPU();
  LlamaConfig c = cuda_test::MixtralTestConfig();
  c.model_type = "qwen2_moe";
  c.num_hidden_layers = 1;
  c.experts_per_token = 4;
  c.normalize_top_k = false;
  c.attention_bias = true;
  c.shared_expert_intermediate_size = 520;
  ExpertsMatchReference(c, 31);
}

// Qwen3-MoE: each q and k head RMS-normalised before RoPE, 4 of 8 experts
// with renormalised weights, no shared expert.
TEST(CudaBackendTest, Qwen3MoeHeadNormsMatchReference) {
  SKIP_WITHOUT_GPU();
  LlamaConfig c = cuda_test::MixtralTestConfig();
  c.model_type = "qwen3_moe";
  c.num_hidden_layers = 1;
  c.experts_per_token = 4;
  c.qk_norm = true;
  ExpertsMatchReference(c, 33);
}

// Dense Qwen3 (the head norms alone) against the CPU backend, at head_dim 64
// here and 128 in cuda_sessions_test.
TEST(CudaBackendTest, MatchesCpuOnQwen3StyleModelWithHeadNorms) {
  SKIP_WITHOUT_GPU();
  LlamaConfig c = MakeQwenModel(DType::kBF16, 1).config;
  c.model_type = "qwen3";
  c.attention_bias = false;
  c.qk_norm = true;
  ModelSpan model = test_support::RandomModel(c, 0, c.num_hidden_layers, DType::kBF16, 35);
  model.name = "qwen3-test";
  CompareOnModel(model, 2);
}

class RecordingSink final : public KernelTimingSink {
 public:
  void OnKernelTime(std::string_view op, double seconds) override {
    MutexLock lock(&mu_);
    ++counts_[std::string(op)];
    if (!(seconds > 0 && seconds < 1)) ++bad_;
  }
  std::map<std::string, int> counts() {
    MutexLock lock(&mu_);
    return counts_;
  }
  int bad() {
    MutexLock lock(&mu_);
    return bad_;
  }

 private:
  Mutex mu_;
  std::map<std::string, int> counts_ ABSL_GUARDED_BY(mu_);
  int bad_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(CudaBackendTest, ReportsKernelTimesOfSampledBatches) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeDemoModel(LayerRange{0, 3});
  RecordingSink sink;
  CudaBackendOptions options;
  options.max_batch_tokens = 256;
  options.timing_sink = &sink;
  options.timing_sample_every = 2;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::mt19937 rng(3);
  const Inputs in = RandomInputs({{2, 100, DType::kBF16}}, model.config.hidden_size, rng);
  for (int i = 0; i < 3; ++i) {  // batches 0 and 2 are sampled
    const absl::Status status = RunSync(**cuda, MakeBatch(in, model.config.hidden_size));
    ASSERT_TRUE(status.ok()) << status;
  }
  const std::map<std::string, int> expected = {{"norm", 2 * 3 * 2},  {"gemm_qkv", 3 * 2}, {"rope", 3 * 2},
                                               {"attention", 3 * 2}, {"gemm_o", 3 * 2},   {"gemm_gate_up", 3 * 2},
                                               {"gemm_down", 3 * 2}};
  EXPECT_EQ(sink.counts(), expected);
  EXPECT_EQ(sink.bad(), 0) << "durations outside (0, 1) s";
}

TEST(CudaBackendTest, ReportsMemory) {
  SKIP_WITHOUT_GPU();
  const ModelSpan model = MakeQwenModel(DType::kBF16, 3);
  CudaBackendOptions options;
  options.max_batch_tokens = 512;
  auto cuda = MakeCudaBackend(model, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const LlamaConfig& c = model.config;
  const int64_t qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
  const int64_t per_layer = 2 * c.hidden_size + qkv * c.hidden_size + qkv +
                            c.hidden_size * c.num_attention_heads * c.head_dim +
                            3 * c.intermediate_size * c.hidden_size;
  EXPECT_EQ((*cuda)->WeightBytes(), static_cast<size_t>(2 * per_layer * c.num_hidden_layers));
  EXPECT_GT((*cuda)->ActivationBytes(), 0u);
  absl::StatusOr<int64_t> used = (*cuda)->DeviceMemoryUsedBytes();
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_GE(*used, static_cast<int64_t>((*cuda)->WeightBytes() + (*cuda)->ActivationBytes()));
}

// Validation happens before the device is touched, so these run anywhere.
TEST(CudaBackendTest, RejectsBadOptionsAndShapes) {
  const ModelSpan model = MakeDemoModel(LayerRange{0, 1});
  CudaBackendOptions options;
  options.num_streams = 0;
  EXPECT_EQ(MakeCudaBackend(model, options).status().code(), absl::StatusCode::kInvalidArgument);
  options = CudaBackendOptions{};
  options.max_batch_tokens = 0;
  EXPECT_EQ(MakeCudaBackend(model, options).status().code(), absl::StatusCode::kInvalidArgument);
  ModelSpan odd = MakeDemoModel(LayerRange{0, 1});
  odd.config.head_dim = 96;
  EXPECT_EQ(MakeCudaBackend(odd, CudaBackendOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
  ModelSpan empty = MakeDemoModel(LayerRange{0, 1});
  empty.layers.clear();
  EXPECT_EQ(MakeCudaBackend(empty, CudaBackendOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaCheckTest, ClassifiesStickyErrors) {
  EXPECT_TRUE(IsStickyCudaError(cudaErrorIllegalAddress));
  EXPECT_TRUE(IsStickyCudaError(cudaErrorAssert));
  EXPECT_TRUE(IsStickyCudaError(cudaErrorLaunchFailure));
  EXPECT_FALSE(IsStickyCudaError(cudaSuccess));
  EXPECT_FALSE(IsStickyCudaError(cudaErrorInvalidValue));
  EXPECT_FALSE(IsStickyCudaError(cudaErrorMemoryAllocation));
}

}  // namespace
}  // namespace layerserve
