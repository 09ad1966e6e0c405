// The test model zoo: every small decoder-layer configuration the backend
// tests build random checkpoints from (random_model.h), written once here
// instead of in each test file. A test takes one by name, and may change a
// field it is about (a window, a dtype); a new shape goes here, with a line
// on what it exercises.
//
// All are tiny (hidden 192 or 256) so that a CPU reference runs in
// milliseconds; each family's distinguishing feature is what it is for.
#pragma once

#include "server/model/model.h"

namespace layerserve::test_support {

// ---- dense ----------------------------------------------------------------

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

// qwen2-style with 2 query heads per KV head and an intermediate size (688)
// that is not a multiple of the GEMM tiles: the CUDA backend tests' model.
inline LlamaConfig Qwen2Gqa2Config() {
  LlamaConfig c = Qwen2StyleConfig();
  c.intermediate_size = 688;
  c.num_key_value_heads = 2;
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

// The above with 4 query heads per KV head, 2 layers: the CUDA session tests'
// paged decode with grouped queries.
inline LlamaConfig Llama3GqaConfig() {
  LlamaConfig c = Llama3StyleConfig();
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.num_hidden_layers = 2;
  return c;
}

// A Llama-style span the FP8 GEMMs take: every width a multiple of 128,
// GQA 2:1, one layer.
inline LlamaConfig LlamaFp8Config() {
  LlamaConfig c;
  c.model_type = "llama";
  c.hidden_size = 256;
  c.intermediate_size = 768;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_hidden_layers = 1;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
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

// ---- mixtures of experts ----------------------------------------------------

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

// Mixtral-style on Qwen2Gqa2Config's attention shapes (without its biases) and
// no window: 8 experts of intermediate 384, 2 per token (the CUDA grouped
// GEMM's tests).
inline LlamaConfig MixtralGqa2Config() {
  LlamaConfig c = Qwen2Gqa2Config();
  c.model_type = "mixtral";
  c.attention_bias = false;
  c.intermediate_size = 384;
  c.num_experts = 8;
  c.experts_per_token = 2;
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

// Qwen3-MoE-style: Qwen3StyleConfig with 8 experts of intermediate 64, 3 per
// token, weights renormalised (Qwen3-30B-A3B's norm_topk_prob), no shared
// expert.
inline LlamaConfig Qwen3MoeStyleConfig() {
  LlamaConfig c = Qwen3StyleConfig();
  c.model_type = "qwen3_moe";
  c.intermediate_size = 64;
  c.num_experts = 8;
  c.experts_per_token = 3;
  return c;
}

}  // namespace layerserve::test_support
