// The CPU backend (see cpu_backend.h): float32 weights with q/k/v and gate/up
// fused at construction, one worker thread that runs queued batches in order.
// All parallelism comes from the backend's thread pool (GEMMs split by output
// columns, attention by sequence, head and query block); OpenBLAS runs
// single-threaded inside each piece, so the two never oversubscribe the cores.
//
// Per layer, over the packed activation x [tokens, hidden]:
//   n = RMSNorm(x); qkv = n Wqkv^T (+ b); RoPE on q and k;
//   a = causal attention (through the layer's sliding window, if it has one);
//   x += a Wo^T; n = RMSNorm(x); gu = n Wgu^T; x += (silu(g) * u) Wd^T.
#include "server/cpu/cpu_backend.h"

#include <algorithm>
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
#include "server/cpu/cpu_ops.h"

namespace layerserve {
namespace {

struct CpuLayer {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> w_qkv;       // [(heads + 2 kv_heads) head_dim, hidden]: q, k, v rows
  std::vector<float> b_qkv;       // same order; empty without attention_bias
  std::vector<float> w_o;         // [hidden, heads head_dim]
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> w_gate_up;   // [2 intermediate, hidden]: gate rows, then up rows
  std::vector<float> w_down;      // [hidden, intermediate]
  int64_t window = 0;             // sliding attention window; 0: full causal
};

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
  out.w_o = w.o_proj.ToFloat();
  out.post_norm = w.post_attention_layernorm.ToFloat();
  Append(out.w_gate_up, w.gate_proj);
  Append(out.w_gate_up, w.up_proj);
  out.w_down = w.down_proj.ToFloat();
  out.window = c.AttentionWindow(layer);
  return out;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const LlamaConfig& config, std::vector<CpuLayer> layers, int num_threads)
      : config_(config),
        layers_(std::move(layers)),
        inv_freq_(RopeInvFreq(config)),
        pool_(num_threads),
        worker_([this] { WorkerLoop(); }) {}

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

 private:
  struct Job {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };

  // Runs queued jobs in order; on shutdown, finishes what was queued so every
  // `done` is called exactly once.
  void WorkerLoop() {
    while (true) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || !queue_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // stop_ and drained
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status status;
      try {
        status = Run(*job.batch);
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "cpu backend: out of memory for a batch of ", job.batch->total_tokens, " tokens"));
      }
      job.done(std::move(status));
    }
  }

  absl::Status Run(Batch& batch) {
    // The CPU backend has no arena: any batch size is computable.
    LS_RETURN_IF_ERROR(batch.Validate(config_.hidden_size, std::numeric_limits<int64_t>::max()));
    const int64_t tokens = batch.total_tokens;
    const int64_t hidden = config_.hidden_size;
    x_.resize(static_cast<size_t>(tokens * hidden));
    size_t offset = 0;
    for (const auto& request : batch.requests) {
      ConvertToFloat(request->dtype, request->input.data(), request->num_elements(),
                     x_.data() + offset);
      offset += request->num_elements();
    }
    for (const CpuLayer& layer : layers_) ForwardLayer(layer, tokens, batch.cu_seqlens);
    offset = 0;
    for (const auto& request : batch.requests) {
      request->output.resize(request->input.size());
      ConvertFromFloat(x_.data() + offset, request->num_elements(), request->dtype,
                       request->output.data());
      offset += request->num_elements();
    }
    return absl::OkStatus();
  }

  void ForwardLayer(const CpuLayer& layer, int64_t tokens, std::span<const int32_t> cu_seqlens) {
    const LlamaConfig& c = config_;
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
    gate_up_.resize(static_cast<size_t>(tokens * 2 * inter));
    act_.resize(static_cast<size_t>(tokens * inter));

    cpu::RmsNorm(x_.data(), tokens, hidden, layer.input_norm.data(), eps, normed_.data(), &pool_);
    cpu::Linear(normed_.data(), tokens, hidden, layer.w_qkv.data(), qkv_width,
                layer.b_qkv.empty() ? nullptr : layer.b_qkv.data(), qkv_.data(), &pool_);
    // q and k heads are adjacent in each qkv row, so one pass rotates both.
    cpu::ApplyRope(qkv_.data(), qkv_width, heads + kv_heads, d, cu_seqlens, {}, inv_freq_, &pool_);
    cpu::AttentionArgs args;
    args.q = qkv_.data();
    args.q_stride = qkv_width;
    args.k = qkv_.data() + heads * d;
    args.v = qkv_.data() + (heads + kv_heads) * d;
    args.kv_stride = qkv_width;
    args.out = attn_.data();
    args.out_stride = heads * d;
    args.num_heads = heads;
    args.num_kv_heads = kv_heads;
    args.head_dim = d;
    args.window = layer.window;
    cpu::CausalAttention(args, cu_seqlens, {}, &pool_);
    cpu::LinearAccumulate(attn_.data(), tokens, heads * d, layer.w_o.data(), hidden, x_.data(),
                          &pool_);

    cpu::RmsNorm(x_.data(), tokens, hidden, layer.post_norm.data(), eps, normed_.data(), &pool_);
    cpu::Linear(normed_.data(), tokens, hidden, layer.w_gate_up.data(), 2 * inter, nullptr,
                gate_up_.data(), &pool_);
    cpu::SiluMul(gate_up_.data(), tokens, inter, act_.data(), &pool_);
    cpu::LinearAccumulate(act_.data(), tokens, inter, layer.w_down.data(), hidden, x_.data(),
                          &pool_);
  }

  const LlamaConfig config_;
  const std::vector<CpuLayer> layers_;
  const std::vector<float> inv_freq_;
  cpu::ThreadPool pool_;

  // Scratch activations, touched only by the worker thread; kept between
  // batches so steady-state serving does not allocate.
  std::vector<float> x_, normed_, qkv_, attn_, gate_up_, act_;

  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
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
  return std::unique_ptr<Backend>(
      std::make_unique<CpuBackend>(model.config, std::move(layers), num_threads));
}

}  // namespace layerserve
