// A span of Llama-family decoder layers: configuration and host weights.
//
// Loaded once at start-up (from a Hugging Face checkpoint directory or the
// built-in demo model) and then read-only; backends copy or convert what they
// need when they are constructed. Nothing here knows about a backend.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace layerserve {

// `rope_scaling` of type "llama3" (Llama 3.1+): frequency-dependent scaling.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// An FP8 checkpoint's linear layers (config.json's quantization_config),
// in the two formats the server reads: transformers' fine-grained FP8
// (quant_method "fp8") and compressed-tensors' float-quantized FP8. Each
// linear whose weight the checkpoint stores as float8_e4m3fn computes
// y = Q(x) W^T with W the weight dequantized by its scales (HostTensor::scale)
// and Q the activation quantization below (W8A8); a linear the checkpoint
// leaves in BF16 (ignore, modules_to_not_convert) computes as in any other
// checkpoint. docs/fp8.md has the numerics.
struct Fp8Quantization {
  enum class Format { kFineGrained, kCompressedTensors };
  // How each token's activations are quantized to e4m3 before an FP8 linear:
  // per 128-channel group of each token (fine-grained; the group is the
  // weight block's width), per token, with one static scale per linear
  // (input_scale), or not at all (weight-only FP8, W8A16). A dynamic scale is
  // amax / 448 over its group.
  enum class Activations { kPerTokenGroup, kPerToken, kStaticPerTensor, kNone };

  Format format = Format::kFineGrained;
  Activations activations = Activations::kPerTokenGroup;
  int64_t activation_group = 0;  // kPerTokenGroup: channels per group
  // The weight scales' layout, as checkpoints store it: one scale per block
  // of weight_block rows x cols ({128, 128} fine-grained), per output row
  // ({1, 0}: 0 is the whole dimension) or per tensor ({0, 0}).
  int64_t weight_block_rows = 0;
  int64_t weight_block_cols = 0;

  // "fp8 (transformers fine-grained: 128x128 weight blocks, activations per
  // token and 128 channels, dynamic)" and the like, for the start-up log.
  std::string Describe() const;
};

// The subset of a Hugging Face config.json that defines one decoder layer.
struct LlamaConfig {
  // "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe" or "qwen3_moe"
  std::string model_type;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t num_hidden_layers = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;
  bool attention_bias = false;  // q/k/v biases (qwen2 always; llama if set)
  // Qwen3: each q and k head is RMS-normalised (weights [head_dim], eps
  // rms_norm_eps) before RoPE.
  bool qk_norm = false;
  std::string torch_dtype;  // informational

  // Sliding-window attention, with Hugging Face's semantics: in a windowed
  // layer query i sees key j iff 0 <= i - j < sliding_window. 0: no layer is
  // windowed. Which layers are: `sliding_layers[layer]` (one entry per model
  // layer), or every layer when sliding_layers is empty.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;

  // Mixture of experts (mixtral's num_local_experts, num_experts_per_tok):
  // the MLP is `num_experts` SiLU-gated MLPs of intermediate_size each, and a
  // router picks `experts_per_token` of them per token, weighting their
  // outputs by its softmax probabilities renormalised over the chosen ones.
  // 0 experts: one dense MLP.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  bool IsMixtureOfExperts() const { return num_experts > 0; }
  // Qwen's variations (qwen2_moe and qwen3_moe, where intermediate_size holds
  // their moe_intermediate_size): the chosen experts' probabilities are
  // divided by their sum only with normalize_top_k (norm_topk_prob; mixtral
  // always does); and, in qwen2_moe, a shared expert, a SiLU-gated MLP of
  // shared_expert_intermediate_size that every token passes through, scaled
  // by sigmoid(m shared_expert_gate^T), is added to the experts' sum (0: none).
  bool normalize_top_k = true;
  int64_t shared_expert_intermediate_size = 0;
  bool HasSharedExpert() const { return shared_expert_intermediate_size > 0; }

  // Set for an FP8 checkpoint (quantization_config); unset: every weight is
  // BF16, FP16 or FP32.
  std::optional<Fp8Quantization> fp8;

  // The attention window of model layer `layer` (an index into the whole
  // model, not the span), or 0 for full causal attention.
  int64_t AttentionWindow(int64_t layer) const;
  // The smallest window among model layers [first, first + count), or 0 when
  // none of them is windowed.
  int64_t SmallestAttentionWindow(int64_t first, int64_t count) const;
};

// Parses config.json text. `source` names the file in error messages.
// Unsupported model types, missing required fields and inconsistent sizes are
// INVALID_ARGUMENT (or UNIMPLEMENTED for a rope_scaling type or layer type we
// do not know). Sliding windows follow transformers: mistral's
// `sliding_window` (4096 when absent, null for none) applies to every layer,
// as does mixtral's (none when absent);
// qwen2's applies only with `use_sliding_window`, to layers >=
// `max_window_layers` (qwen2_moe's, qwen3's and qwen3_moe's likewise); an
// explicit `layer_types` list
// ("full_attention"/"sliding_attention") overrides both. llama has none.
absl::StatusOr<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source);

// RoPE inverse frequencies (head_dim / 2 values) in float32, computed as the
// Hugging Face implementation does, including llama3 scaling.
std::vector<float> RopeInvFreq(const LlamaConfig& config);

// The RoPE settings in words, for the start-up log: "rope theta 500000, no
// scaling", or with llama3 scaling "rope theta 500000, llama3 scaling (factor
// 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings
// 8192)".
std::string DescribeRope(const LlamaConfig& config);

// A dense host tensor, row-major, in its checkpoint dtype.
struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;  // shape product * DTypeSize(dtype) bytes

  // An FP8 weight (dtype kF8E4M3, shape [..., rows, cols]) also holds its
  // dequantization scales: element [.., r, c] stands for data[.., r, c] x
  // scale[.., r / scale_block_rows, c / scale_block_cols], the scales
  // row-major over ceil(rows / block rows) x ceil(cols / block cols) blocks
  // per leading index (a stacked experts tensor has one grid per expert).
  // Per-channel scales are blocks of 1 x cols, a per-tensor scale one block
  // of rows x cols. Empty for other dtypes.
  std::vector<float> scale;
  int64_t scale_block_rows = 0;
  int64_t scale_block_cols = 0;
  // The static activation scale of its linear (Fp8Quantization's
  // kStaticPerTensor); 0 otherwise.
  float input_scale = 0;

  int64_t NumElements() const;
  // The grid `scale` covers: `lead` leading indices (the product of the
  // dimensions before the last two) of rows x cols blocks each. For a tensor
  // of rank >= 2 whose scale blocks are set (positive).
  struct ScaleGrid {
    int64_t lead = 0;
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t Blocks() const { return lead * rows * cols; }
  };
  ScaleGrid Fp8ScaleGrid() const;
  // Element-wise float32 copy of the data; an FP8 weight dequantized by its
  // scales (each element's product rounded once to float32).
  std::vector<float> ToFloat() const;
  // Bytes of data and scales.
  size_t Bytes() const { return data.size() + scale.size() * sizeof(float); }
};

// Weights of one decoder layer, named as in Hugging Face's LlamaDecoderLayer.
// Linear weights are [out_features, in_features] (y = x W^T).
struct LayerWeights {
  HostTensor input_layernorm;           // [hidden]
  HostTensor q_proj, k_proj, v_proj;    // [heads*head_dim, hidden], [kv_heads*head_dim, hidden] x2
  HostTensor q_bias, k_bias, v_bias;    // empty unless config.attention_bias
  HostTensor q_norm, k_norm;            // [head_dim] each; empty unless config.qk_norm
  HostTensor o_proj;                    // [hidden, heads*head_dim]
  HostTensor post_attention_layernorm;  // [hidden]
  // A dense MLP (empty in a mixture-of-experts layer):
  HostTensor gate_proj, up_proj;  // [intermediate, hidden]
  HostTensor down_proj;           // [hidden, intermediate]
  // A mixture of experts instead (empty in a dense layer), the experts
  // stacked as transformers 5 holds them (MixtralExperts), whichever layout
  // the checkpoint stored them in:
  HostTensor router;           // [experts, hidden]: the gate's logits are n router^T
  HostTensor experts_gate_up;  // [experts, 2 intermediate, hidden]: each expert's w1 rows, then w3
  HostTensor experts_down;     // [experts, hidden, intermediate]: each expert's w2
  // Its shared expert, when config.HasSharedExpert() (empty otherwise):
  HostTensor shared_gate_proj, shared_up_proj;  // [shared intermediate, hidden]
  HostTensor shared_down_proj;                  // [hidden, shared intermediate]
  HostTensor shared_expert_gate;                // [1, hidden]

  // Every tensor, absent ones included (for byte counts and dtype lists).
  std::vector<const HostTensor*> All() const;
};

// OK when every tensor of `w` has the element count `config` implies (biases
// empty unless config.attention_bias); else INVALID_ARGUMENT naming layer
// `layer` and the tensor. Backends call it before converting weights.
absl::Status CheckLayerWeights(const LayerWeights& w, const LlamaConfig& config, int64_t layer);

// The layers [first_layer, first_layer + layers.size()) of a model.
struct ModelSpan {
  std::string name;
  LlamaConfig config;
  int64_t first_layer = 0;
  std::vector<LayerWeights> layers;

  // Bytes of weight data held (for logging and the memory gauge).
  size_t WeightBytes() const;
  // The dtypes of the weights held, lowercase, in order of first appearance
  // and joined by '+' when they differ ("bf16", "bf16+fp32"); empty without
  // weights.
  std::string WeightDTypes() const;
  // The start-up log's model line, after "model ": name, architecture, head
  // layout, experts (", 8 experts, top 2" in a mixture of experts), weight
  // dtypes, an FP8 checkpoint's format (Fp8Quantization::Describe), RoPE,
  // the layers held and their bytes (an FP8 weight's scales included). E.g. "demo
  // (llama, hidden 512, 8 heads, 4 kv heads, head_dim 64, fp32 weights, rope
  // theta 500000, no scaling) layers 0:4, 14680064 weight bytes".
  std::string Summary() const;
};

// Half-open layer range [begin, end); parsed from "A:B" (either side may be
// empty: ":4", "2:").
struct LayerRange {
  std::optional<int64_t> begin;
  std::optional<int64_t> end;
};
absl::StatusOr<LayerRange> ParseLayerRange(std::string_view text);

// dir/config.json, parsed, with `range` checked against its layer count
// (INVALID_ARGUMENT naming the file); what LoadModelSpan reads first, and
// what the server checks before it binds a port or loads a weight.
absl::StatusOr<LlamaConfig> ReadModelConfig(const std::filesystem::path& dir,
                                            const LayerRange& range);

// Loads config.json and the layers in `range` from `dir` (model.safetensors,
// or shards listed in model.safetensors.index.json). Tensor names are
// "model.layers.{i}.<module>.weight". A mixtral layer's experts are read in
// either layout: the published one (block_sparse_moe.gate.weight and
// block_sparse_moe.experts.{e}.w1/w2/w3.weight) or the one transformers 5
// holds in memory (mlp.gate.weight, mlp.experts.gate_up_proj [experts,
// 2 intermediate, hidden] and mlp.experts.down_proj). A qwen2_moe layer's
// router is mlp.gate.weight and its experts are either that fused pair or
// mlp.experts.{e}.gate_proj/up_proj/down_proj.weight; its shared expert is
// mlp.shared_expert.gate_proj/up_proj/down_proj.weight and
// mlp.shared_expert_gate.weight (qwen3_moe: the same without a shared
// expert). Errors name the file and the tensor.
absl::StatusOr<ModelSpan> LoadModelSpan(const std::filesystem::path& dir, const LayerRange& range,
                                        std::string model_name);

// The built-in demo model: a small Llama configuration with grouped-query
// attention (hidden 512, 8 heads, 4 KV heads, head_dim 64, intermediate 1408,
// 4 layers, rope_theta 500000) and weights from a fixed seed, so every run and
// every machine serves identical numbers. Stored as float32.
LlamaConfig DemoConfig();
ModelSpan MakeDemoModel(const LayerRange& range, std::string model_name = "demo");

}  // namespace layerserve
