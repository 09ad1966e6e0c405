// The layer executor: runs a span of decoder layers over a packed activation
// already on the device, on one stream, through the kernel library and the
// GEMM router (kernels/include/layerserve/kernels/gemm.h). The backend calls
// it per batch; bench/layer times it directly. An FP8 checkpoint's linears
// run on the FP8 GEMM with their inputs quantized first (RunLinear), the
// experts' on its grouped form.
//
// Per layer, with x [tokens, hidden] the residual stream, updated in place:
//   n  = RMSNorm(x)                    norm (and n quantized for an FP8 linear)
//   qkv = n · Wqkvᵀ (+ bqkv)           gemm_qkv   (bias through the GEMM epilogue)
//   RoPE on the q and k parts of qkv   rope       (with sessions: and the KV-cache write)
//   a  = FlashAttention(qkv)           attention  (varlen, causal, GQA, the layer's window)
//     or, in a batch with cached keys, PagedAttention (see below)
//   x  = a · Woᵀ + x                   gemm_o     (residual fused: beta = 1)
//   n  = RMSNorm(x)                    norm
//   m  = silu(n · Wgᵀ) * (n · Wuᵀ)     gemm_gate_up (the SiLU gate in the GEMM epilogue)
//   x  = m · Wdᵀ + x                   gemm_down  (residual fused: beta = 1)
// A mixture-of-experts layer (Mixtral) replaces the last two steps:
//   logits = n · routerᵀ, route, gather n   moe_route  (a GEMM, then moe.h's
//     into expert order p                               routing and gather)
//   m  = silu(p · W_g,eᵀ) * (p · W_u,eᵀ)    gemm_gate_up (one grouped GEMM, gated epilogue)
//   y  = m · W_down,eᵀ per expert           gemm_down  (one grouped GEMM)
//   x += Σ_j weight_j y[row of choice j]    moe_combine
// and Qwen2-MoE's shared expert, a dense SiLU-gated MLP of its own width:
//   s  = silu(n · W_sgᵀ) * (n · W_suᵀ)      shared_expert (gated epilogue)
//   s *= sigmoid(n · gate)                   (per token; moe.h's MoeSharedGate)
//   x  = s · W_sdᵀ + x                       (residual fused)
// Qwen3 normalises every q and k head before RoPE, in the same kernel.
// Because both residual adds happen inside the GEMMs, x always holds the full
// residual stream and RMSNorm never needs its separate residual input.
//
// Sessions (server/core/sessions.h): a batch that continues sessions carries
// the KV pool and each sequence's start position and block table. RoPE then
// rotates at absolute positions (the batch's positions array holds
// start + i) and stores the new rotated K/V rows in the pool in the same
// launch (LaunchRopeKvAppend, timed as "rope"); attention (paged_attention.h)
// attends over the cached keys and the new ones, through the layer's sliding
// window, along the batch's split plan, with one more launch to merge the
// splits where there are any. A batch whose sequences all start at 0 (first
// prefills, stateless rows) runs flash attention over its own rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "layerserve/kernels/common.h"
#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/layer_ops.h"
#include "layerserve/kernels/paged_attention.h"
#include "server/cuda/kernel_timing.h"
#include "server/model/model.h"

namespace layerserve::cuda {

// The sizes of one decoder layer and the activation dtype it computes in.
struct LayerShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float rms_norm_eps = 1e-6f;
  kernels::DType dtype = kernels::DType::kBF16;
  // A mixture of experts: `experts` MLPs of `intermediate`, top_k per token.
  // 0 experts: one dense MLP.
  int experts = 0;
  int top_k = 0;
  bool normalize_top_k = true;  // MoeRouteParams::normalize
  // Qwen2-MoE's shared expert: one more SiLU-gated MLP of this width (0: none).
  int64_t shared_intermediate = 0;
  bool qk_norm = false;  // Qwen3's RMSNorm over each q and k head
  // Some linear runs in FP8 (LayerDeviceWeights' Fp8Linear): the arena then
  // holds the quantized activations.
  bool fp8 = false;

  static LayerShape FromConfig(const LlamaConfig& config, kernels::DType dtype);
  int64_t q_width() const { return int64_t{num_heads} * head_dim; }
  int64_t qkv_width() const { return int64_t{num_heads + 2 * num_kv_heads} * head_dim; }
  // Elements of each fused weight.
  int64_t qkv_weight_elements() const { return qkv_width() * hidden; }
  int64_t o_weight_elements() const { return hidden * q_width(); }
  // MLPs per layer: one, or one per expert.
  int64_t mlps() const { return experts > 0 ? experts : 1; }
  // The dense MLP's weights, or all experts' stacked.
  int64_t gate_up_weight_elements() const { return mlps() * 2 * intermediate * hidden; }
  int64_t down_weight_elements() const { return mlps() * hidden * intermediate; }
  // The router's rows padded to a multiple of 8 (zeros), as the GEMM that
  // computes the logits takes them; its logits row has this width.
  int64_t router_rows() const { return (int64_t{experts} + 7) / 8 * 8; }
  int64_t router_weight_elements() const { return experts > 0 ? router_rows() * hidden : 0; }
  int64_t head_norm_elements() const { return qk_norm ? 2 * int64_t{head_dim} : 0; }
  // Activation rows each token takes in the MLP: one, or one per chosen expert.
  int64_t mlp_rows_per_token() const { return experts > 0 ? top_k : 1; }
};

// How one linear's weight is stored: in the activation dtype (scaling kNone),
// or as e4m3 codes that the FP8 GEMM multiplies with its input quantized
// per the scaling (block-128: per token and 128 channels; per row: per
// token, or at the static input_scale).
struct Fp8Linear {
  kernels::Fp8Scaling scaling = kernels::Fp8Scaling::kNone;
  const float* w_scale = nullptr;  // device, GemmParams::w_scale's layout
  float input_scale = 0;           // > 0: a static activation scale (per row scaling only)
  // Block scaling: the scales as cuBLASLt's FP8 reads them
  // (GemmParams::w_scale_128), or null where it cannot take this weight.
  const float* w_scale_128 = nullptr;
  bool fp8() const { return scaling != kernels::Fp8Scaling::kNone; }
  // How its input is quantized (QuantizeFp8Params' and RmsNormParams' group
  // and static scale): per token and 128 channels with block-128 scaling,
  // else per token or at the static input_scale.
  int64_t activation_group() const {
    return scaling == kernels::Fp8Scaling::kBlock ? kernels::kFp8BlockK : 0;
  }
  float static_scale() const { return scaling == kernels::Fp8Scaling::kBlock ? 0.f : input_scale; }
};

// Device pointers to one layer's weights, in the activation dtype or, for a
// linear whose Fp8Linear says so, FP8 codes (not owned).
struct LayerDeviceWeights {
  const void* input_norm = nullptr;  // [hidden]
  const void* w_qkv = nullptr;       // [qkv_width, hidden]: q rows, then k, then v
  const void* b_qkv = nullptr;       // [qkv_width] or null
  const void* w_o = nullptr;         // [hidden, q_width]
  const void* post_norm = nullptr;   // [hidden]
  const void* w_gate_up =
      nullptr;  // [2 intermediate, hidden]: gate and up rows interleaved (GateUpRow)
  const void* w_down = nullptr;  // [hidden, intermediate]
  // A mixture of experts: the router, and w_gate_up / w_down hold every
  // expert's weights stacked ([experts, 2 intermediate, hidden] and
  // [experts, hidden, intermediate]).
  const void* router = nullptr;  // [router_rows, hidden]: rows past `experts` zero
  // The shared expert (LayerShape::shared_intermediate > 0; null otherwise):
  // its gate/up rows interleaved as w_gate_up's, its down, its gate's row.
  const void* w_shared_gate_up = nullptr;  // [2 shared_intermediate, hidden]
  const void* w_shared_down = nullptr;     // [hidden, shared_intermediate]
  const void* shared_gate = nullptr;       // [hidden]; float32 with shared_gate_fp8
  // Qwen3's per-head norms (LayerShape::qk_norm; null otherwise).
  const void* q_norm = nullptr;  // [head_dim]
  const void* k_norm = nullptr;  // [head_dim]
  // FP8 checkpoints: how w_qkv, w_o, w_gate_up (then interleaved by
  // kernels::kFp8GateUpBlock, not GateUpRow, per expert in a mixture of
  // experts, whose scales stack as the experts do) and w_down are stored,
  // and the shared expert's two.
  Fp8Linear qkv_fp8, o_fp8, gate_up_fp8, down_fp8;
  Fp8Linear shared_gate_up_fp8, shared_down_fp8;
  // An FP8 shared_expert_gate: shared_gate is its row dequantized, float32,
  // and reads the input the shared gate/up's FP8 GEMM read (the loader
  // makes the three agree on quantization).
  bool shared_gate_fp8 = false;
};

// One stream's activations for up to max_tokens tokens, in one allocation.
// Buffers whose live ranges never overlap share memory: qkv and gate_up
// (qkv is dead once attention ran), attention output and the SiLU product.
// gate_up holds the plain gate/up product only where that GEMM runs on
// cuBLASLt (our kernels apply the gate in their epilogue).
// A mixture-of-experts layer has top_k rows per token from the permutation
// on, so both shared buffers grow by that factor; the experts' gated
// product goes to gate_up (their input, in the other buffer, is still being
// read), their outputs over their input. A shared expert runs after the
// combine, as the dense MLP does (its activation in mlp, its cuBLASLt
// scratch in gate_up), so both buffers also fit its width.
class ActivationArena {
 public:
  // `layers`: of the span, for the per-layer expert counts.
  static absl::StatusOr<ActivationArena> Create(const LayerShape& shape, int64_t max_tokens,
                                                int layers = 1);

  int64_t max_tokens() const { return max_tokens_; }
  size_t bytes() const { return buffer_.bytes(); }

  void* x = nullptr;        // [tokens, hidden]: the residual stream, input and output
  void* normed = nullptr;   // [tokens, hidden]
  void* qkv = nullptr;      // [tokens, qkv_width]
  void* gate_up = nullptr;  // [tokens, 2 intermediate] (aliases qkv)
  void* attn = nullptr;     // [tokens, q_width]
  void* mlp = nullptr;      // [tokens, intermediate] (aliases attn)
  // Per-batch int32 metadata: positions [tokens] then cu_seqlens [num_seqs+1].
  int32_t* meta = nullptr;  // capacity 2 max_tokens + 1
  // Mixture-of-experts layers only (null otherwise), R = tokens top_k rows:
  void* moe_input = nullptr;          // [R, hidden]: the normed rows in expert order (aliases attn)
  void* moe_output = nullptr;         // [R, hidden]: the experts' outputs (aliases attn)
  void* router_logits = nullptr;      // [tokens, router_rows]
  int32_t* expert_ids = nullptr;      // [tokens, top_k]
  float* expert_weights = nullptr;    // [tokens, top_k]
  int32_t* expert_ranks = nullptr;    // [tokens, top_k]: each choice's place in its expert
  int32_t* expert_offsets = nullptr;  // [experts + 1]
  int32_t* expert_scratch = nullptr;  // [experts + 1] (MoeRouteParams::scratch)
  // Each layer's tokens per expert in the last batch, [layer * experts +
  // expert] (MoeRouteParams::counts_out; Batch::expert_tokens).
  int32_t* expert_tokens = nullptr;
  // FP8 spans only (LayerShape::fp8; null otherwise): the input of the FP8
  // linear running now, quantized (LaunchQuantizeFp8, or by the RMSNorm
  // before it), and its scales.
  void* fp8_codes = nullptr;    // [tokens, widest linear input] e4m3
  float* fp8_scales = nullptr;  // [tokens, ceil(widest input / 128)]
  // And an FP8 mixture of experts' own (null otherwise), R = tokens top_k:
  // its gate/up's input (the normed rows' codes in expert order, MoeGather)
  // and then its down's, so fp8_codes keeps the normed rows' codes for the
  // shared expert.
  void* fp8_expert_codes = nullptr;    // [R, max(hidden, intermediate)] e4m3
  float* fp8_expert_scales = nullptr;  // [R, ceil(max(hidden, intermediate) / 128)]

 private:
  DeviceBuffer buffer_;
  int64_t max_tokens_ = 0;
};

class KvPool;  // kv_pool.h

// The packing of one batch; the pointers are device memory (usually
// ActivationArena::meta).
struct BatchGeometry {
  int64_t tokens = 0;
  int num_seqs = 0;
  int max_seqlen = 0;
  // [tokens]: each token's position, start + i within its sequence (start 0
  // for stateless sequences).
  const int32_t* positions = nullptr;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  // Batches with sessions only (null otherwise): the pool, and where each
  // sequence sits in it (KvPool::Upload; kv_pool.h).
  const KvPool* kv_pool = nullptr;
  const int32_t* kv_start = nullptr;      // [num_seqs]
  const int32_t* kv_cu_blocks = nullptr;  // [num_seqs + 1]
  const int32_t* kv_block_tables = nullptr;
  // Whether some sequence starts past 0, so has keys in the cache to attend
  // over; without any, the batch's attention is over its own rows (flash
  // attention) and it has no plan.
  bool kv_history = false;
  // The batch's attention plan and the stream's split workspace (see
  // PagedAttentionParams).
  const kernels::PagedWorkItem* paged_items = nullptr;
  int num_paged_items = 0;
  const kernels::PagedCombineTask* paged_combines = nullptr;
  int num_paged_combines = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
};

class LayerExecutor {
 public:
  // `layers` and `inv_freq` (head_dim / 2 floats, device) must outlive the
  // executor, as must `gemm`. `device`: the GPU the attention kernels choose
  // their launches for. `windows`: each layer's sliding attention window (0:
  // none), applied by flash attention and by the paged attention of batches
  // with sessions alike; empty: no layer has one.
  LayerExecutor(LayerShape shape, std::vector<LayerDeviceWeights> layers, const float* inv_freq,
                kernels::GemmRouter* gemm, kernels::DeviceInfo device,
                std::vector<int> windows = {});

  // Enqueues every layer over arena.x[0, tokens) on `stream`; nothing
  // synchronizes. With a timer, records an event after each op.
  absl::Status Forward(const ActivationArena& arena, const BatchGeometry& batch,
                       const kernels::GemmWorkspace& workspace, cudaStream_t stream,
                       OpTimer* timer) const;

  const LayerShape& shape() const { return shape_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }

 private:
  absl::Status ForwardLayer(int layer, const ActivationArena& arena, const BatchGeometry& batch,
                            const kernels::GemmWorkspace& workspace, cudaStream_t stream,
                            OpTimer* timer) const;
  // Attention over the batch's own rows only (a batch without sessions, or
  // one whose sequences all start at 0): flash attention, through layer
  // `layer`'s window.
  absl::Status FlashAttend(int layer, const ActivationArena& arena, const BatchGeometry& batch,
                           cudaStream_t stream) const;
  // Attention of a batch with sessions over their cached keys and the new
  // ones: PagedAttention.
  absl::Status PagedAttend(int layer, const ActivationArena& arena, const BatchGeometry& batch,
                           cudaStream_t stream) const;
  // Layer `layer`'s cache and where the batch's sequences sit in it.
  kernels::PagedKv CacheOf(int layer, const BatchGeometry& batch) const;
  // The SwiGLU MLP of `w_gate_up` and `w_down` (width `intermediate`) over
  // `rows` rows of `input`: silu(gate) * up into `activation` (one GEMM;
  // `scratch` [rows, 2 intermediate] for its cuBLASLt route), each row
  // scaled by sigmoid(input row · sigmoid_gate) where that is set (the
  // shared expert), down into `output` (onto it with accumulate, the
  // residual add). With group_offsets, each projection is one grouped GEMM
  // over the experts (GemmParams::group_offsets). `activation` must not
  // overlap `input`: the GEMM writes it while other tiles still read input.
  // Where an FP8 linear's input goes quantized (ActivationArena's FP8
  // buffers: the main ones, or an FP8 mixture of experts' own).
  struct Fp8Input {
    void* codes = nullptr;
    float* scales = nullptr;
  };
  static Fp8Input MainFp8(const ActivationArena& arena) {
    return {arena.fp8_codes, arena.fp8_scales};
  }
  struct MlpRun {
    const void* w_gate_up = nullptr;
    const void* w_down = nullptr;
    Fp8Linear gate_up_fp8;
    Fp8Linear down_fp8;
    int64_t intermediate = 0;
    const void* sigmoid_gate = nullptr;
    bool sigmoid_gate_fp8 = false;  // LayerDeviceWeights::shared_gate_fp8
    const void* input = nullptr;
    int64_t rows = 0;
    void* activation = nullptr;
    void* scratch = nullptr;
    void* output = nullptr;
    bool accumulate = false;
    const int32_t* group_offsets = nullptr;
    int groups = 0;
    int64_t max_group_rows = 0;
    Fp8Input fp8_input;            // where gate/up's and down's inputs go quantized
    bool input_quantized = false;  // RunLinear's `quantized`, for gate/up
  };
  // A dense MLP over the batch's normed rows whose output adds onto the
  // residual stream: the dense layer's, and the shared expert.
  static MlpRun OntoResidual(const ActivationArena& arena, int64_t tokens, const void* w_gate_up,
                             const void* w_down, int64_t intermediate,
                             const void* sigmoid_gate = nullptr);
  // Runs the product `p` (dense, reading its input at p.a) through the GEMM
  // router: as is for a weight in the activation dtype; for an FP8 one,
  // after quantizing p.a into `input` as `linear` says. `quantized`: p.a's
  // quantization is in `input` already (the RMSNorm before wrote it,
  // QuantizeInNorm, or MoeGather moved it there).
  absl::Status RunLinear(kernels::GemmParams p, const Fp8Linear& linear, Fp8Input input,
                         const kernels::GemmWorkspace& workspace, cudaStream_t stream,
                         bool quantized = false) const;
  // Makes `norm` also write its output quantized for `linear` into the
  // arena's FP8 buffers, where `linear` is FP8 and the norm kernel takes its
  // scaling (block-128 needs hidden % 128 == 0); returns whether it did.
  bool QuantizeInNorm(const Fp8Linear& linear, const ActivationArena& arena,
                      kernels::RmsNormParams* norm) const;
  // Marks the gate/up and down GEMMs as their ops, or the whole run as
  // `op` where that is given.
  absl::Status RunMlp(const MlpRun& run, const kernels::GemmWorkspace& workspace,
                      cudaStream_t stream, OpTimer* timer, std::string_view op = {}) const;
  // `layer`'s experts (and shared expert); its tokens per expert go to
  // arena.expert_tokens. `normed_quantized`: the RMSNorm also wrote the
  // normed rows quantized for the experts' gate/up into the main FP8
  // buffers (QuantizeInNorm), so the gather moves codes, not rows.
  absl::Status ExpertMlps(int layer, const ActivationArena& arena, int64_t tokens,
                          bool normed_quantized, const kernels::GemmWorkspace& workspace,
                          cudaStream_t stream, OpTimer* timer) const;

  const LayerShape shape_;
  const std::vector<LayerDeviceWeights> layers_;
  const std::vector<int> windows_;  // one per layer
  const float* const inv_freq_;
  kernels::GemmRouter* const gemm_;
  const kernels::DeviceInfo device_;
};

}  // namespace layerserve::cuda
