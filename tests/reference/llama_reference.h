// A float64 reference of one Llama-family decoder layer, in plain standard C++.
//
// Tests compare every backend against these functions. The file uses nothing
// from layerserve (no shared headers, no absl, no BLAS), so a bug in the
// server's config handling, RoPE frequencies or kernels cannot hide by being
// shared with the reference. Everything is written for clarity, not speed:
// straight loops in double, matrices row-major in std::vector<double>.
//
// Semantics follow Hugging Face's LlamaDecoderLayer (and Qwen2's q/k/v biases,
// Qwen3's RMSNorm of each q and k head before RoPE):
//   n = RMSNorm(x);  q, k, v = n Wq^T + bq, n Wk^T + bk, n Wv^T + bv
//   q, k = rope(q), rope(k);  a = causal GQA softmax(q k^T / sqrt(d)) v
//   h = x + a Wo^T;  m = RMSNorm(h);  out = h + (silu(m Wg^T) * (m Wu^T)) Wd^T
// or, in a mixture-of-experts layer (Mixtral's sparse MoE block), out = h +
// the router's top-k experts' MLPs of m, weighted by their renormalised
// softmax probabilities (Qwen2-MoE's: renormalised or not, plus a shared
// expert's MLP of m scaled by sigmoid(m Wsg^T)). In an FP8 checkpoint every
// projection but the routers reads its input quantized (InputQuant).
#pragma once

#include <cstdint>
#include <vector>

namespace reference {

struct Config {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // Llama 3 frequency scaling; off when llama3 is false.
  bool llama3 = false;
  double llama3_factor = 8.0;
  double llama3_low_freq_factor = 1.0;
  double llama3_high_freq_factor = 4.0;
  double llama3_original_max_positions = 8192.0;
  // Sliding-window attention: query i sees key j iff 0 <= i - j < window.
  // 0: full causal attention.
  int64_t sliding_window = 0;
  // Mixture of experts: `experts` MLPs of `intermediate` each, `top_k` per
  // token. 0 experts: one dense MLP.
  int64_t experts = 0;
  int64_t top_k = 0;
  // Qwen2-MoE: the chosen experts' probabilities are divided by their sum
  // only when normalize_top_k; a shared expert of shared_intermediate (0:
  // none) adds sigmoid(m shared_gate^T) * its SiLU-gated MLP of m.
  bool normalize_top_k = true;
  int64_t shared_intermediate = 0;
  // Qwen3: RMSNorm (weights q_norm / k_norm, eps rms_norm_eps) over each q
  // and k head, before RoPE.
  bool qk_norm = false;
  // An FP8 KV cache (server/core/kv_cache_dtype.h): attention reads every
  // key and value row of each KV head as e4m3(x / s) * s with s = amax / 448
  // over that head's row (InputQuant per token, over head_dim values).
  bool kv_cache_fp8 = false;
};

// An FP8 checkpoint's activation quantization in front of one projection
// (W8A8): each input element x becomes e4m3(x / s) * s, rounded to nearest
// even and saturated at 448, with s = amax / 448 over the element's token
// and group of `group` channels (0: the whole token; s rounded to float32,
// as the formats compute it), or s = static_scale when that is set. A group whose amax is 0 stays
// 0. Disabled (the default, and every BF16 projection): the input as it is.
struct InputQuant {
  bool enabled = false;
  int64_t group = 0;
  double static_scale = 0;
};

// The nearest float8_e4m3fn value to v (ties to even, saturating at 448).
double RoundToE4M3(double v);
// x [rows, cols] as quantized by `q`.
std::vector<double> QuantizeInput(const std::vector<double>& x, int64_t rows, int64_t cols,
                                  const InputQuant& q);

// One layer's weights, row-major; linear weights are [out, in] (y = x W^T).
// Biases are empty when the model has none. An FP8 checkpoint's weights are
// given dequantized; its activation quantization is the *_input fields.
struct Layer {
  std::vector<double> input_norm;      // [hidden]
  std::vector<double> wq, wk, wv;      // [heads*head_dim, hidden], [kv_heads*head_dim, hidden] x2
  std::vector<double> bq, bk, bv;      // [heads*head_dim], [kv_heads*head_dim] x2, or empty
  std::vector<double> q_norm, k_norm;  // [head_dim] each (config.qk_norm)
  std::vector<double> wo;              // [hidden, heads*head_dim]
  std::vector<double> post_norm;       // [hidden]
  std::vector<double> wgate, wup;      // [intermediate, hidden] (dense layers)
  std::vector<double> wdown;           // [hidden, intermediate]
  // Mixture-of-experts layers instead:
  std::vector<double> router;           // [experts, hidden]
  std::vector<double> experts_gate_up;  // [experts, 2 intermediate, hidden]: gate rows, then up
  std::vector<double> experts_down;     // [experts, hidden, intermediate]
  // and a shared expert (config.shared_intermediate > 0):
  std::vector<double> shared_wgate, shared_wup;  // [shared_intermediate, hidden]
  std::vector<double> shared_wdown;              // [hidden, shared_intermediate]
  std::vector<double> shared_gate;               // [1, hidden]
  // FP8 (W8A8): the quantization of each projection's input.
  InputQuant qkv_input, o_input, gate_up_input, down_input;
  InputQuant experts_gate_up_input, experts_down_input;
  InputQuant shared_gate_up_input, shared_down_input, shared_gate_input;
};

// head_dim/2 inverse frequencies theta^(-2i/d), with llama3 scaling if set.
std::vector<double> RopeInvFreq(const Config& config);

// x: [rows, cols]; each row scaled by 1/sqrt(mean(x^2) + eps), times weight.
std::vector<double> RmsNorm(const std::vector<double>& x, int64_t rows, int64_t cols,
                            const std::vector<double>& weight, double eps);

// x: [rows, in], w: [out, in], bias: [out] or empty. Returns [rows, out].
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<double>& w, int64_t out,
                           const std::vector<double>& bias);

// Rotate-half RoPE, in place. x: [tokens, heads*head_dim], tokens packed as
// sequences [cu_seqlens[s], cu_seqlens[s+1]) with positions 0..len-1.
void Rope(std::vector<double>& x, int64_t heads, int64_t head_dim,
          const std::vector<int32_t>& cu_seqlens, const std::vector<double>& inv_freq);

// Causal grouped-query attention per sequence. q: [tokens, heads*head_dim],
// k, v: [tokens, kv_heads*head_dim]; query head h reads KV head
// h / (heads / kv_heads). With window > 0 query i reads only keys j with
// i - j < window. Returns [tokens, heads*head_dim].
std::vector<double> Attention(const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, const std::vector<int32_t>& cu_seqlens,
                              int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t window = 0);

// silu(gate) * up, element-wise.
std::vector<double> SiluMul(const std::vector<double>& gate, const std::vector<double>& up);

// A token's routing: the experts it uses (highest probability first; of
// equal ones the lower index), their weights (softmax probabilities, divided
// by the sum of the chosen ones when `normalize`), and the gap between the last chosen
// probability and the best unchosen one (infinity when every expert is
// chosen). A test whose inputs leave a tiny gap could see a lower-precision
// backend choose differently; tests assert a margin.
struct Routing {
  std::vector<int64_t> experts;
  std::vector<double> weights;
  double margin = 0;
};
// logits: [rows, experts]. One Routing per row.
std::vector<Routing> RouteTopK(const std::vector<double>& logits, int64_t rows, int64_t experts,
                               int64_t top_k, bool normalize = true);

// The mixture-of-experts MLP of a layer (config.experts > 0) over m [rows,
// hidden]: the sum over each row's routing of weight * (silu(m G_e^T) *
// (m U_e^T)) D_e^T. Returns [rows, hidden].
std::vector<double> ExpertMlps(const std::vector<double>& m, int64_t rows, const Config& config,
                               const Layer& layer);

// Each token's routing margin (Routing::margin) in a mixture-of-experts
// layer over x [tokens, hidden]: where a lower-precision backend may choose
// other experts than this reference.
std::vector<double> RoutingMargins(const std::vector<double>& x,
                                   const std::vector<int32_t>& cu_seqlens, const Config& config,
                                   const Layer& layer);

// One decoder layer over packed sequences. x: [tokens, hidden].
std::vector<double> DecoderLayer(const std::vector<double>& x,
                                 const std::vector<int32_t>& cu_seqlens, const Config& config,
                                 const Layer& layer);

}  // namespace reference
