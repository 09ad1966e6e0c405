// The layer executor (see layer_executor.h): one decoder layer as eight
// launches on one stream (with sessions too: RoPE and the KV-cache write are
// one kernel, and the attention is flash attention unless some sequence has
// cached keys; one more where the paged attention combines split keys or the
// gate/up projection runs on cuBLASLt; a mixture-of-experts layer adds its
// routing, permutation and combine).
#include "server/cuda/layer_executor.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "layerserve/kernels/attention.h"
#include "layerserve/kernels/layer_ops.h"
#include "layerserve/kernels/moe.h"
#include "layerserve/kernels/paged_attention.h"
#include "server/cuda/kv_pool.h"

namespace layerserve::cuda {
namespace {

// Records the end of `op` when the batch is sampled.
absl::Status MarkOp(OpTimer* timer, std::string_view op, cudaStream_t stream) {
  return timer == nullptr ? absl::OkStatus() : timer->Mark(op, stream);
}

// out [tokens, n] = normed [tokens, hidden] · wᵀ, densely packed: the QKV
// projection and the router's logits.
kernels::GemmParams FromNormed(const ActivationArena& arena, const LayerShape& s, int64_t tokens,
                               const void* w, void* out, int64_t n) {
  kernels::GemmParams p;
  p.a = arena.normed;
  p.lda = s.hidden;
  p.w = w;
  p.ldw = s.hidden;
  p.d = out;
  p.ldd = n;
  p.m = tokens;
  p.n = n;
  p.k = s.hidden;
  p.dtype = s.dtype;
  return p;
}

}  // namespace

LayerShape LayerShape::FromConfig(const LlamaConfig& config, kernels::DType dtype) {
  LayerShape s;
  s.hidden = config.hidden_size;
  s.intermediate = config.intermediate_size;
  s.num_heads = static_cast<int>(config.num_attention_heads);
  s.num_kv_heads = static_cast<int>(config.num_key_value_heads);
  s.head_dim = static_cast<int>(config.head_dim);
  s.rms_norm_eps = static_cast<float>(config.rms_norm_eps);
  s.dtype = dtype;
  s.experts = static_cast<int>(config.num_experts);
  s.top_k = static_cast<int>(config.experts_per_token);
  s.normalize_top_k = config.normalize_top_k;
  s.shared_intermediate = config.shared_expert_intermediate_size;
  s.qk_norm = config.qk_norm;
  s.fp8 = config.fp8.has_value();
  return s;
}

absl::StatusOr<ActivationArena> ActivationArena::Create(const LayerShape& shape, int64_t max_tokens,
                                                        int layers) {
  if (max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation arena: max_tokens must be positive, got ", max_tokens));
  }
  const size_t t = static_cast<size_t>(max_tokens);
  const size_t e = static_cast<size_t>(kernels::DTypeBytes(shape.dtype));
  // Elements per token of the two shared buffers (see the class comment).
  const int64_t rows = shape.mlp_rows_per_token();
  const size_t big =
      static_cast<size_t>(std::max({shape.qkv_width(), rows * 2 * shape.intermediate,
                                    rows * shape.hidden, 2 * shape.shared_intermediate}));
  const size_t mid =
      static_cast<size_t>(std::max({shape.q_width(), rows * shape.intermediate, rows * shape.hidden,
                                    shape.shared_intermediate}));
  const size_t hidden = static_cast<size_t>(shape.hidden);
  const bool moe = shape.experts > 0;
  // Per token, the most an FP8 linear's quantized input takes: its K codes
  // (and K / 128 scales, rounded up); the experts' inputs, top_k rows a
  // token, have buffers of their own.
  const auto groups_of = [](int64_t width) {
    return (width + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
  };
  const int64_t dense_intermediate = moe ? 0 : shape.intermediate;
  const size_t fp8_width =
      shape.fp8 ? static_cast<size_t>(std::max({shape.hidden, shape.q_width(), dense_intermediate,
                                                shape.shared_intermediate}))
                : 0;
  const size_t fp8_groups =
      shape.fp8 ? static_cast<size_t>(groups_of(static_cast<int64_t>(fp8_width))) : 0;
  const size_t expert_width =
      shape.fp8 && moe ? static_cast<size_t>(rows * std::max(shape.hidden, shape.intermediate)) : 0;
  const size_t expert_groups =
      shape.fp8 && moe
          ? static_cast<size_t>(rows * groups_of(std::max(shape.hidden, shape.intermediate)))
          : 0;
  const size_t choices = moe ? t * static_cast<size_t>(shape.top_k) : 0;
  const size_t experts = moe ? static_cast<size_t>(shape.experts) : 0;
  // The same sequence of Takes sizes the allocation and then carves it.
  const auto carve = [&](BumpLayout& layout, ActivationArena* arena) {
    void* x = layout.Take(t * hidden * e);
    void* normed = layout.Take(t * hidden * e);
    void* big_buffer = layout.Take(t * big * e);
    void* mid_buffer = layout.Take(t * mid * e);
    void* meta = layout.Take((2 * t + 1) * sizeof(int32_t));
    void* logits = moe ? layout.Take(t * static_cast<size_t>(shape.router_rows()) * e) : nullptr;
    void* ids = moe ? layout.Take(choices * sizeof(int32_t)) : nullptr;
    void* weights = moe ? layout.Take(choices * sizeof(float)) : nullptr;
    void* ranks = moe ? layout.Take(choices * sizeof(int32_t)) : nullptr;
    void* offsets = moe ? layout.Take((experts + 1) * sizeof(int32_t)) : nullptr;
    void* scratch = moe ? layout.Take((experts + 1) * sizeof(int32_t)) : nullptr;
    void* expert_tokens =
        moe ? layout.Take(static_cast<size_t>(std::max(layers, 1)) * experts * sizeof(int32_t))
            : nullptr;
    void* fp8_codes = shape.fp8 ? layout.Take(t * fp8_width) : nullptr;
    void* fp8_scales = shape.fp8 ? layout.Take(t * fp8_groups * sizeof(float)) : nullptr;
    void* fp8_expert_codes = expert_width > 0 ? layout.Take(t * expert_width) : nullptr;
    void* fp8_expert_scales =
        expert_width > 0 ? layout.Take(t * expert_groups * sizeof(float)) : nullptr;
    if (arena != nullptr) {
      arena->fp8_codes = fp8_codes;
      arena->fp8_scales = static_cast<float*>(fp8_scales);
      arena->fp8_expert_codes = fp8_expert_codes;
      arena->fp8_expert_scales = static_cast<float*>(fp8_expert_scales);
      arena->x = x;
      arena->normed = normed;
      arena->qkv = arena->gate_up = big_buffer;
      arena->attn = arena->mlp = mid_buffer;
      arena->meta = static_cast<int32_t*>(meta);
      if (moe) {
        arena->moe_input = mid_buffer;
        arena->moe_output = mid_buffer;
        arena->router_logits = logits;
        arena->expert_ids = static_cast<int32_t*>(ids);
        arena->expert_weights = static_cast<float*>(weights);
        arena->expert_ranks = static_cast<int32_t*>(ranks);
        arena->expert_offsets = static_cast<int32_t*>(offsets);
        arena->expert_scratch = static_cast<int32_t*>(scratch);
        arena->expert_tokens = static_cast<int32_t*>(expert_tokens);
      }
    }
  };
  BumpLayout sizing(nullptr);
  carve(sizing, nullptr);
  ActivationArena arena;
  LS_ASSIGN_OR_RETURN(arena.buffer_, DeviceBuffer::Allocate(sizing.bytes()));
  BumpLayout layout(arena.buffer_.data());
  carve(layout, &arena);
  arena.max_tokens_ = max_tokens;
  return arena;
}

LayerExecutor::LayerExecutor(LayerShape shape, std::vector<LayerDeviceWeights> layers,
                             const float* inv_freq, kernels::GemmRouter* gemm,
                             kernels::DeviceInfo device, std::vector<int> windows)
    : shape_(shape),
      layers_(std::move(layers)),
      windows_(windows.empty() ? std::vector<int>(layers_.size(), 0) : std::move(windows)),
      inv_freq_(inv_freq),
      gemm_(gemm),
      device_(device) {}

absl::Status LayerExecutor::Forward(const ActivationArena& arena, const BatchGeometry& batch,
                                    const kernels::GemmWorkspace& workspace, cudaStream_t stream,
                                    OpTimer* timer) const {
  if (batch.tokens <= 0 || batch.tokens > arena.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer executor: ", batch.tokens, " tokens, the arena holds ", arena.max_tokens()));
  }
  if (windows_.size() != layers_.size()) {
    return absl::InternalError(absl::StrCat("layer executor: ", windows_.size(),
                                            " attention windows for ", layers_.size(), " layers"));
  }
  if (timer != nullptr) LS_RETURN_IF_ERROR(timer->Start(stream));
  for (int l = 0; l < num_layers(); ++l) {
    LS_RETURN_IF_ERROR(ForwardLayer(l, arena, batch, workspace, stream, timer));
  }
  return absl::OkStatus();
}

absl::Status LayerExecutor::FlashAttend(int layer, const ActivationArena& arena,
                                        const BatchGeometry& batch, cudaStream_t stream) const {
  const LayerShape& s = shape_;
  const int64_t element_bytes = kernels::DTypeBytes(s.dtype);
  const auto* qkv_bytes = static_cast<const unsigned char*>(arena.qkv);
  kernels::FlashAttentionParams attention;
  attention.q = qkv_bytes;
  attention.k = qkv_bytes + s.q_width() * element_bytes;
  attention.v = qkv_bytes + (s.q_width() + int64_t{s.num_kv_heads} * s.head_dim) * element_bytes;
  attention.out = arena.attn;
  attention.q_row_stride = s.qkv_width();
  attention.k_row_stride = s.qkv_width();
  attention.v_row_stride = s.qkv_width();
  attention.out_row_stride = s.q_width();
  attention.cu_seqlens = batch.cu_seqlens;
  attention.num_seqs = batch.num_seqs;
  attention.max_seqlen = batch.max_seqlen;
  attention.num_heads = s.num_heads;
  attention.num_kv_heads = s.num_kv_heads;
  attention.head_dim = s.head_dim;
  attention.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  attention.window = windows_[static_cast<size_t>(layer)];
  attention.dtype = s.dtype;
  return kernels::LaunchFlashAttention(attention, device_, stream);
}

kernels::PagedKv LayerExecutor::CacheOf(int layer, const BatchGeometry& batch) const {
  kernels::PagedKv cache;
  cache.k = batch.kv_pool->k(layer);
  cache.v = batch.kv_pool->v(layer);
  cache.fp8 = batch.kv_pool->fp8();
  cache.num_blocks = batch.kv_pool->shape().num_blocks;
  cache.block_tokens = static_cast<int>(batch.kv_pool->shape().block_tokens);
  cache.start = batch.kv_start;
  cache.cu_blocks = batch.kv_cu_blocks;
  cache.block_tables = batch.kv_block_tables;
  return cache;
}

absl::Status LayerExecutor::PagedAttend(int layer, const ActivationArena& arena,
                                        const BatchGeometry& batch, cudaStream_t stream) const {
  const LayerShape& s = shape_;
  const int64_t element_bytes = kernels::DTypeBytes(s.dtype);
  const auto* qkv_bytes = static_cast<const unsigned char*>(arena.qkv);
  const void* k = qkv_bytes + s.q_width() * element_bytes;
  const void* v = qkv_bytes + (s.q_width() + int64_t{s.num_kv_heads} * s.head_dim) * element_bytes;
  kernels::PagedAttentionParams attention;
  attention.q = arena.qkv;
  attention.k = k;
  attention.v = v;
  attention.out = arena.attn;
  attention.q_row_stride = attention.k_row_stride = attention.v_row_stride = s.qkv_width();
  attention.out_row_stride = s.q_width();
  attention.cu_seqlens = batch.cu_seqlens;
  attention.num_seqs = batch.num_seqs;
  attention.tokens = batch.tokens;
  attention.cache = CacheOf(layer, batch);
  attention.num_heads = s.num_heads;
  attention.num_kv_heads = s.num_kv_heads;
  attention.head_dim = s.head_dim;
  attention.window = windows_[static_cast<size_t>(layer)];
  attention.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  attention.dtype = s.dtype;
  attention.items = batch.paged_items;
  attention.num_items = batch.num_paged_items;
  attention.combines = batch.paged_combines;
  attention.num_combines = batch.num_paged_combines;
  attention.partial_out = batch.partial_out;
  attention.partial_lse = batch.partial_lse;
  return kernels::LaunchPagedAttention(attention, stream);
}

absl::Status LayerExecutor::ForwardLayer(int layer, const ActivationArena& arena,
                                         const BatchGeometry& batch,
                                         const kernels::GemmWorkspace& workspace,
                                         cudaStream_t stream, OpTimer* timer) const {
  const LayerShape& s = shape_;
  const LayerDeviceWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t tokens = batch.tokens;

  kernels::RmsNormParams norm;
  norm.x = arena.x;
  norm.weight = w.input_norm;
  norm.y = arena.normed;
  norm.rows = tokens;
  norm.cols = s.hidden;
  norm.eps = s.rms_norm_eps;
  norm.dtype = s.dtype;
  const bool qkv_quantized = QuantizeInNorm(w.qkv_fp8, arena, &norm);
  LS_RETURN_IF_ERROR(kernels::LaunchRmsNorm(norm, stream));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpNorm, stream));

  kernels::GemmParams qkv = FromNormed(arena, s, tokens, w.w_qkv, arena.qkv, s.qkv_width());
  qkv.bias = w.b_qkv;
  LS_RETURN_IF_ERROR(RunLinear(qkv, w.qkv_fp8, MainFp8(arena), workspace, stream, qkv_quantized));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpGemmQkv, stream));

  kernels::RopeParams rope;
  rope.qkv = arena.qkv;
  rope.positions = batch.positions;
  rope.inv_freq = inv_freq_;
  rope.tokens = tokens;
  rope.num_heads = s.num_heads;
  rope.num_kv_heads = s.num_kv_heads;
  rope.head_dim = s.head_dim;
  rope.q_norm = w.q_norm;
  rope.k_norm = w.k_norm;
  rope.norm_eps = s.rms_norm_eps;
  rope.dtype = s.dtype;
  if (batch.kv_pool != nullptr) {
    // Sessions: RoPE and the cache write in one launch.
    const kernels::KvAppendParams append{
        .cu_seqlens = batch.cu_seqlens, .num_seqs = batch.num_seqs, .cache = CacheOf(layer, batch)};
    LS_RETURN_IF_ERROR(kernels::LaunchRopeKvAppend(rope, append, stream));
  } else {
    LS_RETURN_IF_ERROR(kernels::LaunchRope(rope, stream));
  }
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpRope, stream));
  // The paged kernel attends over the cache; a batch with nothing cached
  // (every sequence starts at 0: first prefills, stateless rows) attends
  // over its own rows only, which flash attention does reading K/V once per
  // 64-128 queries, where the paged kernel's decode-shaped tiles read them
  // once per 16 rows (4 tokens of a GQA group).
  if (batch.kv_pool != nullptr && batch.kv_history) {
    LS_RETURN_IF_ERROR(PagedAttend(layer, arena, batch, stream));
  } else {
    LS_RETURN_IF_ERROR(FlashAttend(layer, arena, batch, stream));
  }
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpAttention, stream));

  kernels::GemmParams o;
  o.a = arena.attn;
  o.lda = s.q_width();
  o.w = w.w_o;
  o.ldw = s.q_width();
  o.d = arena.x;
  o.ldd = s.hidden;
  o.accumulate = true;
  o.m = tokens;
  o.n = s.hidden;
  o.k = s.q_width();
  o.dtype = s.dtype;
  LS_RETURN_IF_ERROR(RunLinear(o, w.o_fp8, MainFp8(arena), workspace, stream));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpGemmO, stream));

  norm.weight = w.post_norm;
  norm.fp8_codes = nullptr;
  // (A mixture of experts': the experts' gate/up's quantization.)
  const bool gate_up_quantized = QuantizeInNorm(w.gate_up_fp8, arena, &norm);
  LS_RETURN_IF_ERROR(kernels::LaunchRmsNorm(norm, stream));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpNorm, stream));
  if (s.experts > 0) {
    return ExpertMlps(layer, arena, tokens, gate_up_quantized, workspace, stream, timer);
  }
  MlpRun mlp = OntoResidual(arena, tokens, w.w_gate_up, w.w_down, s.intermediate);
  mlp.gate_up_fp8 = w.gate_up_fp8;
  mlp.down_fp8 = w.down_fp8;
  mlp.input_quantized = gate_up_quantized;
  return RunMlp(mlp, workspace, stream, timer);
}

bool LayerExecutor::QuantizeInNorm(const Fp8Linear& linear, const ActivationArena& arena,
                                   kernels::RmsNormParams* norm) const {
  if (!linear.fp8() || arena.fp8_codes == nullptr ||
      (linear.activation_group() > 0 && shape_.hidden % linear.activation_group() != 0)) {
    return false;
  }
  norm->fp8_codes = arena.fp8_codes;
  norm->fp8_scales = arena.fp8_scales;
  norm->fp8_group = linear.activation_group();
  norm->fp8_static_scale = linear.static_scale();
  return true;
}

absl::Status LayerExecutor::RunLinear(kernels::GemmParams p, const Fp8Linear& linear,
                                      Fp8Input input, const kernels::GemmWorkspace& workspace,
                                      cudaStream_t stream, bool quantized) const {
  if (!linear.fp8()) return gemm_->Run(p, workspace, stream);
  if (input.codes == nullptr || input.scales == nullptr || p.lda != p.k) {
    return absl::InternalError("layer executor: an FP8 linear without the arena's FP8 buffers");
  }
  if (!quantized) {
    kernels::QuantizeFp8Params q;
    q.x = p.a;
    q.codes = input.codes;
    q.scales = input.scales;
    q.rows = p.m;
    q.cols = p.k;
    q.group = linear.activation_group();
    q.static_scale = linear.static_scale();
    LS_RETURN_IF_ERROR(kernels::LaunchQuantizeFp8(q, stream));
  }
  p.a = input.codes;
  p.fp8 = linear.scaling;
  p.a_scale = input.scales;
  p.w_scale = linear.w_scale;
  p.w_scale_128 = linear.w_scale_128;
  return gemm_->Run(p, workspace, stream);
}

LayerExecutor::MlpRun LayerExecutor::OntoResidual(const ActivationArena& arena, int64_t tokens,
                                                  const void* w_gate_up, const void* w_down,
                                                  int64_t intermediate, const void* sigmoid_gate) {
  return {.w_gate_up = w_gate_up,
          .w_down = w_down,
          .intermediate = intermediate,
          .sigmoid_gate = sigmoid_gate,
          .input = arena.normed,
          .rows = tokens,
          .activation = arena.mlp,
          .scratch = arena.gate_up,
          .output = arena.x,
          .accumulate = true,
          .fp8_input = MainFp8(arena)};
}

absl::Status LayerExecutor::RunMlp(const MlpRun& run, const kernels::GemmWorkspace& workspace,
                                   cudaStream_t stream, OpTimer* timer, std::string_view op) const {
  const LayerShape& s = shape_;
  // gate/up and the SiLU gate in one call: the weight's rows are interleaved
  // (DeviceWeights), so our kernels apply the activation in their epilogue
  // and the [rows, 2 intermediate] product stays in registers; on the
  // cuBLASLt route it passes through run.scratch.
  kernels::GemmParams gate_up;
  gate_up.a = run.input;
  gate_up.lda = s.hidden;
  gate_up.w = run.w_gate_up;
  gate_up.ldw = s.hidden;
  gate_up.d = run.activation;
  gate_up.ldd = run.intermediate;
  gate_up.silu_mul = true;
  gate_up.scratch = run.scratch;
  gate_up.m = run.rows;
  gate_up.n = 2 * run.intermediate;
  gate_up.k = s.hidden;
  gate_up.dtype = s.dtype;
  gate_up.group_offsets = run.group_offsets;
  gate_up.groups = run.groups;
  gate_up.max_group_rows = run.max_group_rows;
  LS_RETURN_IF_ERROR(
      RunLinear(gate_up, run.gate_up_fp8, run.fp8_input, workspace, stream, run.input_quantized));
  if (run.sigmoid_gate != nullptr) {
    kernels::MoeSharedGateParams gate{.x = run.input,
                                      .gate = run.sigmoid_gate,
                                      .activation = run.activation,
                                      .tokens = run.rows,
                                      .hidden = s.hidden,
                                      .width = run.intermediate,
                                      .dtype = s.dtype};
    if (run.sigmoid_gate_fp8) {
      // The codes the gate/up GEMM just read: its input, quantized.
      if (!run.gate_up_fp8.fp8()) {
        return absl::InternalError("layer executor: an FP8 sigmoid gate beside a BF16 gate/up");
      }
      gate.x_codes = run.fp8_input.codes;
      gate.x_scales = run.fp8_input.scales;
      gate.x_group = run.gate_up_fp8.activation_group();
    }
    LS_RETURN_IF_ERROR(kernels::LaunchMoeSharedGate(gate, stream));
  }
  if (op.empty()) LS_RETURN_IF_ERROR(MarkOp(timer, kOpGemmGateUp, stream));

  kernels::GemmParams down = gate_up;
  down.silu_mul = false;
  down.scratch = nullptr;
  down.a = run.activation;
  down.lda = run.intermediate;
  down.w = run.w_down;
  down.ldw = run.intermediate;
  down.d = run.output;
  down.ldd = s.hidden;
  down.accumulate = run.accumulate;
  down.n = s.hidden;
  down.k = run.intermediate;
  LS_RETURN_IF_ERROR(RunLinear(down, run.down_fp8, run.fp8_input, workspace, stream));
  return MarkOp(timer, op.empty() ? kOpGemmDown : op, stream);
}

absl::Status LayerExecutor::ExpertMlps(int layer, const ActivationArena& arena, int64_t tokens,
                                       bool normed_quantized,
                                       const kernels::GemmWorkspace& workspace, cudaStream_t stream,
                                       OpTimer* timer) const {
  const LayerShape& s = shape_;
  const LayerDeviceWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t rows = tokens * s.top_k;

  const kernels::GemmParams logits =
      FromNormed(arena, s, tokens, w.router, arena.router_logits, s.router_rows());
  LS_RETURN_IF_ERROR(gemm_->Run(logits, workspace, stream));
  kernels::MoeRouteParams route;
  route.logits = arena.router_logits;
  route.logits_stride = s.router_rows();
  route.tokens = tokens;
  route.experts = s.experts;
  route.top_k = s.top_k;
  route.normalize = s.normalize_top_k;
  route.dtype = s.dtype;
  route.expert_ids = arena.expert_ids;
  route.weights = arena.expert_weights;
  route.ranks = arena.expert_ranks;
  route.offsets = arena.expert_offsets;
  route.scratch = arena.expert_scratch;
  route.counts_out = arena.expert_tokens + int64_t{layer} * s.experts;
  LS_RETURN_IF_ERROR(kernels::LaunchMoeRoute(route, stream));
  kernels::MoeChoices choices;
  choices.expert_ids = arena.expert_ids;
  choices.ranks = arena.expert_ranks;
  choices.offsets = arena.expert_offsets;
  choices.tokens = tokens;
  choices.top_k = s.top_k;
  kernels::MoeGatherParams gather;
  gather.choices = choices;
  gather.hidden = s.hidden;
  gather.dtype = s.dtype;
  const Fp8Input expert_fp8{arena.fp8_expert_codes, arena.fp8_expert_scales};
  // FP8 experts whose input the RMSNorm quantized: their rows' codes and
  // scales, in expert order, are all their gate/up reads.
  const bool gather_codes = w.gate_up_fp8.fp8() && normed_quantized;
  if (gather_codes) {
    gather.fp8_codes = arena.fp8_codes;
    gather.fp8_scales = arena.fp8_scales;
    gather.fp8_group = w.gate_up_fp8.activation_group();
    gather.permuted_codes = expert_fp8.codes;
    gather.permuted_scales = expert_fp8.scales;
  } else {
    gather.x = arena.normed;
    gather.permuted = arena.moe_input;
  }
  LS_RETURN_IF_ERROR(kernels::LaunchMoeGather(gather, stream));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpMoeRoute, stream));

  // Both projections are one grouped GEMM each: expert e multiplies its rows
  // [offsets[e], offsets[e + 1]) by its own weights; a token picks an expert
  // at most once, so no expert has more rows than the batch has tokens.
  LS_RETURN_IF_ERROR(RunMlp({.w_gate_up = w.w_gate_up,
                             .w_down = w.w_down,
                             .gate_up_fp8 = w.gate_up_fp8,
                             .down_fp8 = w.down_fp8,
                             .intermediate = s.intermediate,
                             .input = arena.moe_input,
                             .rows = rows,
                             .activation = arena.gate_up,
                             .output = arena.moe_output,
                             .accumulate = false,
                             .group_offsets = arena.expert_offsets,
                             .groups = s.experts,
                             .max_group_rows = tokens,
                             .fp8_input = expert_fp8,
                             .input_quantized = gather_codes},
                            workspace, stream, timer));

  kernels::MoeCombineParams combine;
  combine.choices = choices;
  combine.y = arena.moe_output;
  combine.weights = arena.expert_weights;
  combine.x = arena.x;
  combine.hidden = s.hidden;
  combine.dtype = s.dtype;
  LS_RETURN_IF_ERROR(kernels::LaunchMoeCombine(combine, stream));
  LS_RETURN_IF_ERROR(MarkOp(timer, kOpMoeCombine, stream));
  if (s.shared_intermediate == 0) return absl::OkStatus();
  // The shared expert over every token, after the combine: the experts'
  // buffers are free again, and it adds onto x as the dense MLP does.
  MlpRun shared = OntoResidual(arena, tokens, w.w_shared_gate_up, w.w_shared_down,
                               s.shared_intermediate, w.shared_gate);
  shared.gate_up_fp8 = w.shared_gate_up_fp8;
  shared.sigmoid_gate_fp8 = w.shared_gate_fp8;
  shared.down_fp8 = w.shared_down_fp8;
  // The normed rows' codes are still in the main buffers (the experts used
  // their own): the shared expert's gate/up reads them where it quantizes
  // its input as the experts' does.
  shared.input_quantized =
      normed_quantized && w.shared_gate_up_fp8.fp8() &&
      w.shared_gate_up_fp8.activation_group() == w.gate_up_fp8.activation_group() &&
      w.shared_gate_up_fp8.static_scale() == w.gate_up_fp8.static_scale();
  return RunMlp(shared, workspace, stream, timer, kOpSharedExpert);
}

}  // namespace layerserve::cuda
