// The CPU backend (see cpu_backend.h): float32 weights with q/k/v and gate/up
// fused at construction, one worker thread that runs queued batches in order.
// All parallelism comes from the backend's thread pool (GEMMs split by output
// columns, attention by sequence, head and query block); OpenBLAS runs
// single-threaded inside each piece, so the two never oversubscribe the cores.
//
// Per layer, over the packed activation x [tokens, hidden]:
//   n = RMSNorm(x); qkv = n Wqkv^T (+ b); (Qwen3: RMSNorm per q and k head;)
//   RoPE on q and k;
//   a = causal attention (through the layer's sliding window, if it has one);
//   x += a Wo^T; n = RMSNorm(x); gu = n Wgu^T; x += (silu(g) * u) Wd^T.
// In a mixture-of-experts layer the last two steps are the router's top-k
// choice per token and x += the weighted sum of the chosen experts' MLPs
// (cpu::RouteTopK, cpu::ExpertMlps), plus, with a shared expert (Qwen2-MoE),
// x += sigmoid(n w_gate^T) * the shared expert's own SiLU-gated MLP of n.
//
// Sessions (server/core/sessions.h): a session step's tokens continue their
// sequences at `position`, so RoPE rotates them at position..position+T-1.
// After RoPE, each layer stores the step's new K and V rows in the KV cache
// (kv_cache.h) through the sequence's block table, then gathers the keys and
// values every sequence attends over into contiguous scratch: a session
// sequence's cached rows (as far back as the layer's window reaches) and its
// new rows, a stateless sequence's own rows. Attention then runs with more
// keys than queries, the queries aligned to the last keys. A batch without
// sessions skips all of it and attends straight over the qkv activation.
#include "server/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <new>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "base/thread_name.h"
#include "server/cpu/cpu_ops.h"
#include "server/cpu/kv_cache.h"

namespace layerserve {
namespace {

struct CpuLayer {
  std::vector<float> input_norm;      // [hidden]
  std::vector<float> w_qkv;           // [(heads + 2 kv_heads) head_dim, hidden]: q, k, v rows
  std::vector<float> b_qkv;           // same order; empty without attention_bias
  std::vector<float> q_norm, k_norm;  // [head_dim]; empty without config.qk_norm
  std::vector<float> w_o;             // [hidden, heads head_dim]
  std::vector<float> post_norm;       // [hidden]
  std::vector<float> w_gate_up;       // [2 intermediate, hidden]: gate rows, then up rows
  std::vector<float> w_down;          // [hidden, intermediate]
  // A mixture-of-experts layer instead of w_gate_up / w_down:
  std::vector<float> router;           // [experts, hidden]
  std::vector<float> experts_gate_up;  // [experts, 2 intermediate, hidden]
  std::vector<float> experts_down;     // [experts, hidden, intermediate]
  // Its shared expert (config.HasSharedExpert()):
  std::vector<float> shared_gate_up;  // [2 shared intermediate, hidden]: gate rows, then up rows
  std::vector<float> shared_down;     // [hidden, shared intermediate]
  std::vector<float> shared_gate;     // [1, hidden]
  int64_t window = 0;                 // sliding attention window; 0: full causal
  // FP8 projections (weights dequantized above): the quantization of their
  // inputs, W8A8 as the checkpoint's format defines it.
  cpu::Fp8InputQuant qkv_input, o_input, gate_up_input, down_input;
  cpu::Fp8InputQuant experts_gate_up_input, experts_down_input;
  cpu::Fp8InputQuant shared_gate_up_input, shared_down_input, shared_gate_input;
};

// The input quantization of a linear with weight `w` (disabled unless `w`
// is FP8 in a checkpoint whose format quantizes activations).
cpu::Fp8InputQuant InputQuant(const HostTensor& w, const LlamaConfig& c) {
  using Activations = Fp8Quantization::Activations;
  if (w.dtype != DType::kF8E4M3 || !c.fp8 || c.fp8->activations == Activations::kNone) return {};
  cpu::Fp8InputQuant q;
  q.enabled = true;
  if (c.fp8->activations == Activations::kPerTokenGroup) q.group = c.fp8->activation_group;
  if (c.fp8->activations == Activations::kStaticPerTensor) q.static_scale = w.input_scale;
  return q;
}

void Append(std::vector<float>& dst, const HostTensor& t) {
  const std::vector<float> values = t.ToFloat();
  dst.insert(dst.end(), values.begin(), values.end());
}

absl::StatusOr<CpuLayer> ConvertLayer(const LayerWeights& w, const LlamaConfig& c, int64_t layer) {
  LS_RETURN_IF_ERROR(CheckLayerWeights(w, c, layer));

  CpuLayer out;
  out.input_norm = w.input_layernorm.ToFloat();
  Append(out.w_qkv, w.q_proj);
  Append(out.w_qkv, w.k_proj);
  Append(out.w_qkv, w.v_proj);
  if (c.attention_bias) {
    Append(out.b_qkv, w.q_bias);
    Append(out.b_qkv, w.k_bias);
    Append(out.b_qkv, w.v_bias);
  }
  if (c.qk_norm) {
    out.q_norm = w.q_norm.ToFloat();
    out.k_norm = w.k_norm.ToFloat();
  }
  out.w_o = w.o_proj.ToFloat();
  out.post_norm = w.post_attention_layernorm.ToFloat();
  if (c.IsMixtureOfExperts()) {
    out.router = w.router.ToFloat();
    out.experts_gate_up = w.experts_gate_up.ToFloat();
    out.experts_down = w.experts_down.ToFloat();
    if (c.HasSharedExpert()) {
      Append(out.shared_gate_up, w.shared_gate_proj);
      Append(out.shared_gate_up, w.shared_up_proj);
      out.shared_down = w.shared_down_proj.ToFloat();
      out.shared_gate = w.shared_expert_gate.ToFloat();
    }
  } else {
    Append(out.w_gate_up, w.gate_proj);
    Append(out.w_gate_up, w.up_proj);
    out.w_down = w.down_proj.ToFloat();
  }
  out.window = c.AttentionWindow(layer);
  out.qkv_input = InputQuant(w.q_proj, c);  // CheckLayerWeights: k and v agree
  out.o_input = InputQuant(w.o_proj, c);
  out.gate_up_input = InputQuant(w.gate_proj, c);
  out.down_input = InputQuant(w.down_proj, c);
  out.experts_gate_up_input = InputQuant(w.experts_gate_up, c);
  out.experts_down_input = InputQuant(w.experts_down, c);
  out.shared_gate_up_input = InputQuant(w.shared_gate_proj, c);
  out.shared_down_input = InputQuant(w.shared_down_proj, c);
  out.shared_gate_input = InputQuant(w.shared_expert_gate, c);
  return out;
}

// Rows per gather task: a chunk of one sequence's cached or new K/V rows.
// Long contexts split into enough tasks for every thread; a task still
// copies a few hundred rows, well above the hand-off cost.
constexpr int64_t kGatherRows = 256;

class CpuBackend final : public Backend {
 public:
  CpuBackend(const LlamaConfig& config, std::vector<CpuLayer> layers, int num_threads,
             KvCacheDType kv_cache_dtype)
      : config_(config),
        layers_(std::move(layers)),
        kv_row_{config.num_key_value_heads, config.head_dim, kv_cache_dtype},
        inv_freq_(RopeInvFreq(config)),
        pool_(num_threads, "cpu-op"),
        worker_([this] {
          NameThisThread("cpu-batch");
          WorkerLoop();
        }) {}

  ~CpuBackend() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    worker_.join();
  }

  std::string_view Name() const override { return "cpu"; }
  int MaxInflightBatches() const override { return 1; }

  void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) override {
    absl::MutexLock lock(&mu_);
    queue_.push_back(Job{std::move(batch), std::move(done)});
  }

  // The cache holds K and V rows of kv_heads * head_dim per layer: float32,
  // or e4m3 codes and a scale per head (kv_cache.h).
  int64_t KvBlockBytes(int64_t block_tokens) const override {
    return cpu::KvCache::BlockBytes(static_cast<int64_t>(layers_.size()), kv_row_, block_tokens);
  }

  int64_t KvMemoryAvailable() const override { return cpu::AvailableMemoryBytes(); }

  // Allocates (and zeroes) outside the lock, so a concurrent Execute never
  // waits on it; the pool is installed once and never replaced, so the
  // worker may use it without the lock once it has read the pointer.
  absl::Status AllocateKvCache(const KvCacheShape& shape) override {
    const auto already = [] {
      return absl::FailedPreconditionError("cpu backend: the KV cache is already allocated");
    };
    {
      absl::MutexLock lock(&mu_);
      if (kv_cache_ != nullptr) return already();
    }
    // Backend declares a KvCacheShape of its own beside the namespace's (the
    // one Batch::Validate takes); the fields are the same.
    LS_ASSIGN_OR_RETURN(
        std::unique_ptr<cpu::KvCache> cache,
        cpu::KvCache::Create(static_cast<int64_t>(layers_.size()), kv_row_,
                             layerserve::KvCacheShape{shape.num_blocks, shape.block_tokens}));
    absl::MutexLock lock(&mu_);
    if (kv_cache_ != nullptr) return already();
    kv_cache_ = std::move(cache);
    return absl::OkStatus();
  }

 private:
  struct Job {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };

  // Positions [begin, end) of sequence `seq`, gathered to key row `key_row`.
  struct GatherTask {
    size_t seq;
    int64_t begin;
    int64_t end;
    int64_t key_row;
  };

  int64_t KvWidth() const { return config_.num_key_value_heads * config_.head_dim; }

  // Runs queued jobs in order; on shutdown, finishes what was queued so every
  // `done` is called exactly once.
  void WorkerLoop() {
    while (true) {
      Job job;
      cpu::KvCache* kv_cache;  // null until AllocateKvCache
      {
        absl::MutexLock lock(&mu_);
        const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || !queue_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // stop_ and drained
        job = std::move(queue_.front());
        queue_.pop_front();
        kv_cache = kv_cache_.get();
      }
      absl::Status status;
      try {
        status = Run(*job.batch, kv_cache);
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "cpu backend: out of memory for a batch of ", job.batch->total_tokens, " tokens"));
      }
      job.done(std::move(status));
    }
  }

  absl::Status Run(Batch& batch, cpu::KvCache* kv_cache) {
    // The CPU backend has no arena: any batch size is computable.
    LS_RETURN_IF_ERROR(
        batch.Validate(config_.hidden_size, std::numeric_limits<int64_t>::max(),
                       kv_cache != nullptr ? kv_cache->shape() : layerserve::KvCacheShape{}));
    const auto input_start = std::chrono::steady_clock::now();
    const int64_t tokens = batch.total_tokens;
    const int64_t hidden = config_.hidden_size;
    x_.resize(static_cast<size_t>(tokens * hidden));
    // Each sequence's piece (all of it unless the request is chunked) is one
    // run of rows of the request's tensor.
    size_t offset = 0;
    for (const auto& request : batch.requests) {
      const size_t piece = static_cast<size_t>(request->piece_tokens() * hidden);
      const size_t element = DTypeSize(request->dtype);
      for (int64_t b = 0; b < request->batch; ++b, offset += piece) {
        ConvertToFloat(request->dtype, request->input.data() + request->piece_offset(b) * element,
                       piece, x_.data() + offset);
      }
    }
    batch.timings.input_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - input_start).count();
    // Where each sequence starts, for RoPE; empty (all 0) without sessions.
    start_positions_.clear();
    if (batch.has_sessions) {
      for (const auto& seq : batch.kv) start_positions_.push_back(seq.position);
    }
    batch.expert_tokens.assign(layers_.size() * static_cast<size_t>(config_.num_experts), 0);
    for (size_t l = 0; l < layers_.size(); ++l) {
      ForwardLayer(static_cast<int64_t>(l), batch, kv_cache);
    }
    const auto output_start = std::chrono::steady_clock::now();
    offset = 0;
    for (const auto& request : batch.requests) {
      const size_t piece = static_cast<size_t>(request->piece_tokens() * hidden);
      const size_t element = DTypeSize(request->dtype);
      request->output.resize(request->input.size());  // once: later pieces keep earlier rows
      for (int64_t b = 0; b < request->batch; ++b, offset += piece) {
        ConvertFromFloat(x_.data() + offset, piece, request->dtype,
                         request->output.data() + request->piece_offset(b) * element);
      }
    }
    batch.timings.output_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - output_start).count();
    return absl::OkStatus();
  }

  void ForwardLayer(int64_t layer_index, Batch& batch, cpu::KvCache* kv_cache) {
    const CpuLayer& layer = layers_[static_cast<size_t>(layer_index)];
    const LlamaConfig& c = config_;
    const int64_t tokens = batch.total_tokens;
    const std::span<const int32_t> cu_seqlens = batch.cu_seqlens;
    const int64_t hidden = c.hidden_size;
    const int64_t heads = c.num_attention_heads;
    const int64_t kv_heads = c.num_key_value_heads;
    const int64_t d = c.head_dim;
    const int64_t qkv_width = (heads + 2 * kv_heads) * d;
    const int64_t inter = c.intermediate_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    normed_.resize(static_cast<size_t>(tokens * hidden));
    qkv_.resize(static_cast<size_t>(tokens * qkv_width));
    attn_.resize(static_cast<size_t>(tokens * heads * d));

    cpu::RmsNorm(x_.data(), tokens, hidden, layer.input_norm.data(), eps, normed_.data(), &pool_);
    cpu::Linear(Quantized(normed_, tokens, hidden, layer.qkv_input), tokens, hidden,
                layer.w_qkv.data(), qkv_width, layer.b_qkv.empty() ? nullptr : layer.b_qkv.data(),
                qkv_.data(), &pool_);
    // Qwen3 normalises each q and k head before rotating it.
    if (c.qk_norm) {
      cpu::HeadRmsNorm(qkv_.data(), tokens, qkv_width, heads, kv_heads, d, layer.q_norm.data(),
                       layer.k_norm.data(), eps, &pool_);
    }
    // q and k heads are adjacent in each qkv row, so one pass rotates both.
    cpu::ApplyRope(qkv_.data(), qkv_width, heads + kv_heads, d, cu_seqlens, start_positions_,
                   inv_freq_, &pool_);
    cpu::AttentionArgs args;
    args.q = qkv_.data();
    args.q_stride = qkv_width;
    args.out = attn_.data();
    args.out_stride = heads * d;
    args.num_heads = heads;
    args.num_kv_heads = kv_heads;
    args.head_dim = d;
    args.window = layer.window;
    if (batch.has_sessions) {
      GatherKv(layer_index, batch, kv_cache);
      args.k = keys_.data();
      args.v = values_.data();
      args.kv_stride = KvWidth();
      cpu::CausalAttention(args, cu_seqlens, cu_keys_, &pool_);
    } else {
      args.k = qkv_.data() + heads * d;
      args.v = qkv_.data() + (heads + kv_heads) * d;
      args.kv_stride = qkv_width;
      cpu::CausalAttention(args, cu_seqlens, {}, &pool_);
    }
    cpu::QuantizeDequantizeFp8(attn_.data(), tokens, heads * d, layer.o_input, &pool_);
    cpu::LinearAccumulate(attn_.data(), tokens, heads * d, layer.w_o.data(), hidden, x_.data(),
                          &pool_);

    cpu::RmsNorm(x_.data(), tokens, hidden, layer.post_norm.data(), eps, normed_.data(), &pool_);
    if (c.IsMixtureOfExperts()) {
      ExpertsForward(layer_index, layer, batch);
      return;
    }
    MlpOntoResidual(layer.w_gate_up.data(), layer.w_down.data(), inter, tokens, layer.gate_up_input,
                    layer.down_input);
  }

  // `x` ([rows, cols]) as the linear after it reads it: `x` itself, or its
  // FP8 quantization (W8A8) in quantized_, so that other readers of `x` (the
  // router, a sigmoid gate, a BF16 projection) still see it unquantized.
  const float* Quantized(const std::vector<float>& x, int64_t rows, int64_t cols,
                         const cpu::Fp8InputQuant& q) {
    if (!q.enabled) return x.data();
    quantized_.assign(x.begin(), x.begin() + rows * cols);
    cpu::QuantizeDequantizeFp8(quantized_.data(), rows, cols, q, &pool_);
    return quantized_.data();
  }

  // x_ += the SiLU-gated MLP (gate/up rows stacked, width `inter`) of
  // normed_; with `sigmoid_gate` (Qwen2-MoE's shared expert), each token's
  // activation row is first scaled by sigmoid(normed_ row · sigmoid_gate),
  // which scales its output the same since the down projection is linear
  // (an FP8 gate reads normed_ quantized as `sigmoid_gate_input` says).
  void MlpOntoResidual(const float* w_gate_up, const float* w_down, int64_t inter, int64_t tokens,
                       const cpu::Fp8InputQuant& gate_up_input,
                       const cpu::Fp8InputQuant& down_input, const float* sigmoid_gate = nullptr,
                       const cpu::Fp8InputQuant& sigmoid_gate_input = {}) {
    const int64_t hidden = config_.hidden_size;
    gate_up_.resize(static_cast<size_t>(tokens * 2 * inter));
    act_.resize(static_cast<size_t>(tokens * inter));
    cpu::Linear(Quantized(normed_, tokens, hidden, gate_up_input), tokens, hidden, w_gate_up,
                2 * inter, nullptr, gate_up_.data(), &pool_);
    cpu::SiluMul(gate_up_.data(), tokens, inter, act_.data(), &pool_);
    // Quantized before the sigmoid gate scales it: the gate scales the down
    // projection's output (transformers), which equals scaling its input.
    cpu::QuantizeDequantizeFp8(act_.data(), tokens, inter, down_input, &pool_);
    if (sigmoid_gate != nullptr) {
      shared_gate_.resize(static_cast<size_t>(tokens));
      cpu::Linear(Quantized(normed_, tokens, hidden, sigmoid_gate_input), tokens, hidden,
                  sigmoid_gate, 1, nullptr, shared_gate_.data(), &pool_);
      for (int64_t t = 0; t < tokens; ++t) {
        const float scale = 1.0f / (1.0f + std::exp(-shared_gate_[t]));
        for (int64_t i = 0; i < inter; ++i) act_[t * inter + i] *= scale;
      }
    }
    cpu::LinearAccumulate(act_.data(), tokens, inter, w_down, hidden, x_.data(), &pool_);
  }

  // x_ += the mixture of experts over normed_: router logits, each token's
  // top-k experts, and their weighted MLPs; the batch's expert_tokens count
  // the choices.
  void ExpertsForward(int64_t layer_index, const CpuLayer& layer, Batch& batch) {
    const LlamaConfig& c = config_;
    const int64_t tokens = batch.total_tokens;
    const int64_t experts = c.num_experts;
    const int64_t top_k = c.experts_per_token;
    router_logits_.resize(static_cast<size_t>(tokens * experts));
    expert_ids_.resize(static_cast<size_t>(tokens * top_k));
    expert_weights_.resize(static_cast<size_t>(tokens * top_k));
    cpu::Linear(normed_.data(), tokens, c.hidden_size, layer.router.data(), experts, nullptr,
                router_logits_.data(), &pool_);
    cpu::RouteTopK(router_logits_.data(), tokens, experts, top_k, c.normalize_top_k,
                   expert_ids_.data(), expert_weights_.data());
    for (const int32_t e : expert_ids_) ++batch.expert_tokens[layer_index * experts + e];
    const cpu::ExpertWeights weights{.gate_up = layer.experts_gate_up.data(),
                                     .down = layer.experts_down.data(),
                                     .experts = experts,
                                     .hidden = c.hidden_size,
                                     .intermediate = c.intermediate_size,
                                     .gate_up_input = layer.experts_gate_up_input,
                                     .down_input = layer.experts_down_input};
    cpu::ExpertMlps(normed_.data(), tokens, expert_ids_.data(), expert_weights_.data(), top_k,
                    weights, x_.data(), &pool_);
    if (c.HasSharedExpert()) {
      MlpOntoResidual(layer.shared_gate_up.data(), layer.shared_down.data(),
                      c.shared_expert_intermediate_size, tokens, layer.shared_gate_up_input,
                      layer.shared_down_input, layer.shared_gate.data(), layer.shared_gate_input);
    }
  }

  // Stores the session sequences' new K and V rows (already rotated) in the
  // cache, and gathers into keys_ / values_, packed by cu_keys_, the rows each
  // sequence attends over in this layer: positions [first, position + T),
  // where first = position - window + 1 (0 without a window, or when the
  // window reaches back past the start) is the oldest key the first new token
  // sees. Rows below `position` come from the cache; a session sequence's
  // new rows are stored there and read back, so it sees them as later steps
  // will (an FP8 cache's rounding included).
  // Worked example, block_tokens 4, window 0: a step of T = 2 at position 5
  // writes positions 5, 6 (block table entry 1, rows 1 and 2) and gathers 7
  // rows, 0..6, from the cache. A stateless sequence has position 0 and
  // gathers its T rows from qkv_. The tasks run in parallel:
  // they read and write disjoint rows, since the session table never gives
  // two sequences the same block and a step writes only past what it reads.
  void GatherKv(int64_t layer, const Batch& batch, cpu::KvCache* kv_cache) {
    const int64_t window = layers_[static_cast<size_t>(layer)].window;
    const int64_t heads = config_.num_attention_heads;
    const int64_t qkv_width = (heads + 2 * config_.num_key_value_heads) * config_.head_dim;
    const int64_t kv_width = KvWidth();
    cu_keys_.assign(1, 0);
    gather_tasks_.clear();
    for (size_t s = 0; s < batch.kv.size(); ++s) {
      const int64_t position = batch.kv[s].position;
      const int64_t end = position + batch.cu_seqlens[s + 1] - batch.cu_seqlens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      // Chunks of at most kGatherRows, none straddling `position`.
      for (int64_t p = first; p < end;) {
        const int64_t stop = std::min({end, p + kGatherRows, p < position ? position : end});
        gather_tasks_.push_back({s, p, stop, cu_keys_.back() + (p - first)});
        p = stop;
      }
      cu_keys_.push_back(static_cast<int32_t>(cu_keys_.back() + (end - first)));
    }
    keys_.resize(static_cast<size_t>(cu_keys_.back() * kv_width));
    values_.resize(keys_.size());
    pool_.ParallelFor(static_cast<int64_t>(gather_tasks_.size()), [&](int64_t i) {
      const GatherTask& task = gather_tasks_[static_cast<size_t>(i)];
      const auto& seq = batch.kv[task.seq];
      float* k_out = keys_.data() + task.key_row * kv_width;
      float* v_out = values_.data() + task.key_row * kv_width;
      if (task.begin < seq.position) {
        kv_cache->Read(layer, *seq.block_table, task.begin, task.end, k_out, v_out);
        return;
      }
      const int64_t row = batch.cu_seqlens[task.seq] + (task.begin - seq.position);
      const float* k = qkv_.data() + row * qkv_width + heads * config_.head_dim;
      const float* v = k + kv_width;
      if (seq.block_table != nullptr) {
        // A session attends over its new rows as the cache holds them (an
        // FP8 cache's rounding included), as it will in later steps.
        kv_cache->Write(layer, *seq.block_table, task.begin, task.end, k, v, qkv_width);
        kv_cache->Read(layer, *seq.block_table, task.begin, task.end, k_out, v_out);
        return;
      }
      for (int64_t r = 0; r < task.end - task.begin; ++r) {
        std::copy_n(k + r * qkv_width, kv_width, k_out + r * kv_width);
        std::copy_n(v + r * qkv_width, kv_width, v_out + r * kv_width);
      }
    });
  }

  const LlamaConfig config_;
  const std::vector<CpuLayer> layers_;
  const cpu::KvCache::RowShape kv_row_;
  const std::vector<float> inv_freq_;
  ThreadPool pool_;

  // Scratch activations, touched only by the worker thread; kept between
  // batches so steady-state serving does not allocate.
  std::vector<float> x_, normed_, qkv_, attn_, gate_up_, act_;
  std::vector<float> quantized_;  // an FP8 linear's quantized input (Quantized)
  // Mixture-of-experts layers only: router logits and each token's choices.
  std::vector<float> router_logits_, expert_weights_;
  std::vector<int32_t> expert_ids_;
  // And with a shared expert: its gate's logit per token.
  std::vector<float> shared_gate_;
  // Session batches only: per-sequence start positions, and the keys and
  // values attention reads (GatherKv).
  std::vector<int64_t> start_positions_;
  std::vector<int32_t> cu_keys_;
  std::vector<GatherTask> gather_tasks_;
  std::vector<float> keys_, values_;

  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Set once by AllocateKvCache, never replaced; its rows are read and
  // written by the worker thread (and its pool) only.
  std::unique_ptr<cpu::KvCache> kv_cache_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;  // last: starts once everything above is constructed
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const ModelSpan& model,
                                                        const CpuBackendOptions& options) {
  if (model.layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: model '", model.name, "' has no layers"));
  }
  const LlamaConfig& c = model.config;
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_attention_heads <= 0 ||
      c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0 ||
      c.head_dim <= 0 || c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: model '", model.name, "' has an inconsistent configuration"));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: num_threads must be >= 0, got ", options.num_threads));
  }
  std::vector<CpuLayer> layers;
  layers.reserve(model.layers.size());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    LS_ASSIGN_OR_RETURN(CpuLayer layer, ConvertLayer(model.layers[i], model.config,
                                                     model.first_layer + static_cast<int64_t>(i)));
    layers.push_back(std::move(layer));
  }
  const int num_threads = options.num_threads > 0
                              ? options.num_threads
                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::UseSingleThreadedBlas();
  return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(
      model.config, std::move(layers), num_threads, options.kv_cache_dtype));
}

}  // namespace layerserve
