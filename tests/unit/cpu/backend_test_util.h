// Shared helpers for the CPU backend tests: the small model configurations
// they build random checkpoints from, and batches of requests built, run and
// compared against a reference rounded to each request's dtype.
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/model/model.h"
#include "tests/support/run_batch.h"
#include "tests/unit/cpu/test_util.h"

namespace layerserve::cpu_test {

using test_support::RunSync;

// ---- models -------------------------------------------------------------

// qwen2-style: q/k/v biases, 4 query heads per KV head.
inline LlamaConfig Qwen2StyleConfig() {
  LlamaConfig c;
  c.model_type = "qwen2";
  c.hidden_size = 256;
  c.intermediate_size = 320;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.head_dim = 64;
  c.num_hidden_layers = 2;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.attention_bias = true;
  return c;
}

// llama with llama3 RoPE scaling; original_max_position_embeddings is tiny so
// the scaled bands matter at the positions these tests use. head_dim 128, MHA.
inline LlamaConfig Llama3StyleConfig() {
  LlamaConfig c;
  c.model_type = "llama";
  c.hidden_size = 256;
  c.intermediate_size = 384;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 128;
  c.num_hidden_layers = 8;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.rope_scaling = Llama3RopeScaling{8.0, 1.0, 4.0, 64};
  return c;
}

// mistral-style: every layer attends through a window of 4 tokens, shorter
// than most test sequences. GQA ratio 2.
inline LlamaConfig MistralStyleConfig() {
  LlamaConfig c;
  c.model_type = "mistral";
  c.hidden_size = 256;
  c.intermediate_size = 320;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_hidden_layers = 4;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.sliding_window = 4;
  return c;
}

// Mixtral-shaped, small: 8 experts of intermediate 128, 2 per token, and a
// sliding window shorter than the longest test sequence.
inline LlamaConfig MixtralStyleConfig() {
  LlamaConfig c = MistralStyleConfig();
  c.model_type = "mixtral";
  c.intermediate_size = 128;
  c.num_experts = 8;
  c.experts_per_token = 2;
  c.sliding_window = 6;
  return c;
}

// Qwen2-MoE-shaped, small: 12 experts of intermediate 64, 4 per token whose
// weights are not renormalised (norm_topk_prob false, the default), a shared
// expert of intermediate 160, q/k/v biases.
inline LlamaConfig Qwen2MoeStyleConfig() {
  LlamaConfig c = Qwen2StyleConfig();
  c.model_type = "qwen2_moe";
  c.intermediate_size = 64;
  c.num_experts = 12;
  c.experts_per_token = 4;
  c.normalize_top_k = false;
  c.shared_expert_intermediate_size = 160;
  return c;
}

// Qwen3-style: RMSNorm over each q and k head before RoPE, head_dim 128
// (not hidden / heads), 2 query heads per KV head, no biases.
inline LlamaConfig Qwen3StyleConfig() {
  LlamaConfig c;
  c.model_type = "qwen3";
  c.hidden_size = 192;
  c.intermediate_size = 256;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 128;
  c.num_hidden_layers = 2;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.qk_norm = true;
  return c;
}

// Qwen3-MoE-style: the above with 8 experts of intermediate 64, 3 per token,
// weights renormalised (Qwen3-30B-A3B's norm_topk_prob), no shared expert.
inline LlamaConfig Qwen3MoeStyleConfig() {
  LlamaConfig c = Qwen3StyleConfig();
  c.model_type = "qwen3_moe";
  c.intermediate_size = 64;
  c.num_experts = 8;
  c.experts_per_token = 3;
  return c;
}

// ---- batches ------------------------------------------------------------

struct RequestShape {
  int64_t batch;
  int64_t seq_len;
  DType dtype;
};

// Activations exactly representable in BF16, FP16 and FP32 (bf16 values of
// magnitude >= 2^-14 or zero), so one reference run serves every dtype.
inline std::vector<float> RepresentableInputs(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (float& x : v) {
    x = Bf16ToFloat(FloatToBf16(static_cast<float>(rng.Uniform(-2, 2))));
    if (std::abs(x) < 0x1p-14f) x = 0.0f;
  }
  return v;
}

// A Batch over `shapes` whose inputs are consecutive slices of `activations`,
// packed by Batch::Pack, with outputs poisoned.
struct BuiltBatch {
  std::shared_ptr<Batch> batch;
  std::vector<std::unique_ptr<std::string>> inputs;  // owned storage for input views
};

inline BuiltBatch BuildBatch(const std::vector<RequestShape>& shapes,
                             const std::vector<float>& activations, int64_t hidden) {
  BuiltBatch built;
  built.batch = std::make_shared<Batch>();
  size_t offset = 0;
  for (size_t r = 0; r < shapes.size(); ++r) {
    const RequestShape& s = shapes[r];
    auto request = std::make_unique<InferRequest>();
    request->id = "req" + std::to_string(r);
    request->dtype = s.dtype;
    request->batch = s.batch;
    request->seq_len = s.seq_len;
    request->hidden = hidden;
    const size_t n = request->num_elements();
    auto input = std::make_unique<std::string>(n * DTypeSize(s.dtype), '\0');
    ConvertFromFloat(activations.data() + offset, n, s.dtype, input->data());
    offset += n;
    request->input = *input;
    // 0xff bytes are NaN in FP32, FP16 and BF16.
    request->output.assign(input->size(), '\xff');
    built.inputs.push_back(std::move(input));
    built.batch->requests.push_back(std::move(request));
  }
  built.batch->Pack();
  return built;
}

inline double DtypeRelativeUlp(DType t) {
  switch (t) {
    case DType::kF32:
      return 0.0;
    case DType::kF16:
      return 0x1p-10;
    case DType::kBF16:
      return 0x1p-7;
    case DType::kF8E4M3:
      return 0x1p-3;
  }
  return 0;
}

// Compares each request's output with the reference rounded to its dtype:
// |got - round(ref)| <= ulp(dtype) * |ref| + fp32_tol * (|ref| + rms(ref)).
// The dtype term covers results that straddle a rounding boundary.
inline void ExpectOutputsMatch(const Batch& batch, const std::vector<double>& want,
                               double fp32_tol) {
  const double rms = cpu_test::Rms(want);
  size_t offset = 0;
  for (const auto& request : batch.requests) {
    SCOPED_TRACE(std::string("request ") + request->id + " dtype " +
                 std::string(DTypeProtocolName(request->dtype)));
    const size_t n = request->num_elements();
    ASSERT_EQ(request->output.size(), request->input.size());
    std::vector<float> got(n);
    ConvertToFloat(request->dtype, request->output.data(), n, got.data());
    double worst = -1;
    size_t worst_i = 0;
    double worst_rounded = 0;
    for (size_t i = 0; i < n; ++i) {
      const double ref = want[offset + i];
      const float ref_f = static_cast<float>(ref);
      float rounded = ref_f;
      ConvertFromFloat(&ref_f, 1, request->dtype, &rounded);  // round-trip through the dtype
      ConvertToFloat(request->dtype, &rounded, 1, &rounded);
      const double tol = DtypeRelativeUlp(request->dtype) * std::abs(ref) +
                         fp32_tol * (std::abs(ref) + rms) + 0x1p-24;
      const double excess = std::abs(got[i] - rounded) / tol;
      if (!(excess <= worst)) {
        worst = excess;
        worst_i = i;
        worst_rounded = rounded;
        if (std::isnan(excess)) break;
      }
    }
    EXPECT_LE(worst, 1.0) << "worst element " << worst_i << " (token " << worst_i / request->hidden
                          << "): got " << got[worst_i] << ", reference " << want[offset + worst_i]
                          << " rounded " << worst_rounded << "; error / tolerance " << worst;
    offset += n;
  }
}

}  // namespace layerserve::cpu_test
