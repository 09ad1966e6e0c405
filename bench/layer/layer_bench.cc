// Times one Llama-3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV
// heads, head_dim 128, intermediate 14336, rope_theta 500000, bf16) through
// the CUDA backend's layer executor, the code path every served batch takes.
// Weights are random bf16 generated on the device, so no checkpoint is needed.
//
// For each case (tokens, packed sequences) it restores the input, then times
// Forward between two CUDA events; warm-up first (heuristics, module load),
// then the median of many runs. A second pass with the executor's op timer
// gives the per-op split. Prints a table and, with --csv, writes
// "tokens,seqs,ms,floor_ms" rows that bench/layer/hf_layer.py puts beside
// HF's times. A case's floor is the larger of its bytes read once at the
// device's copy bandwidth and its FLOPs at cuBLASLt's 8192^3 bf16 rate, both
// measured at the start of the run (device_rates.h).
//
// Decode steps (--decode, on by default): B sessions at context L, each
// adding one token, through the KV pool and paged attention exactly as a
// served session batch runs (block tables shuffled across a random-filled
// pool). The floor of a step counts the K/V bytes it reads beside the
// weights; the table gives the step against it. Two
// prefill pieces follow them: the last piece of an 8192-token prompt cut
// into 2048- and into 512-token pieces (--prefill-chunk-tokens), T new
// tokens over 8192 - T cached, through the same paged attention. With
// --decode-csv, "seqs,context,ms,min_ms,floor_ms" rows of the decode steps
// (plus "<compare>_ms", the --compare executor's or graph's median, when
// given) go there for bench/layer/torch_decode_step.py, which times a
// PyTorch step (eager and CUDA graph) on the same points beside them.
//
// --model times another layer instead: mixtral (Mixtral-8x7B: the same
// attention, then 8 experts of intermediate 14336, 2 per token, routed by
// random weights; --mixtral for short), qwen2-moe (Qwen1.5-MoE-A2.7B: 60
// experts of 1408, 4 per token, raw routing weights, q/k/v biases, and a
// shared expert of 5632) or qwen3-moe (Qwen3-30B-A3B: q/k head norms, 128
// experts of 768, 8 per token). A mixture of experts' floor counts the
// experts a batch is expected to read, E (1 - (1 - k/E)^T) of them under
// uniform routing (plus a shared expert, read whole), and its CSV rows add
// the experts' part (routing through combine, and the shared expert) and
// the grouped GEMMs (the SiLU gate in the gate/up epilogue) before the
// floor, for bench/layer/hf_moe.py.
//
//   layer_bench [--csv PATH] [--decode-csv PATH] [--iters N] [--gemm MODE]
//               [--no-autotune] [--compare cublaslt|untuned|bm64|bm128|graph|bf16]
//               [--model llama3|mixtral|qwen2-moe|qwen3-moe] [--mixtral] [--fp8 block|row] [--graphs]
//               [--kv-cache auto|fp8]
// --kv-cache fp8 keeps the decode steps' KV cache in FP8 (codes and scales,
// as --kv-cache-dtype=fp8 serves it).
// --fp8 runs the layer's four projections (a mixture of experts': its
// experts' two, grouped) on the FP8 GEMM (W8A8, each
// input quantized on the way as serving does), their weights the bf16 ones
// quantized at one static scale, with block-128 (transformers' fine-grained)
// or per-row (per-channel) scales; --compare bf16 then times the same layer
// with its bf16 weights beside it, run by run.
// --gemm auto|cublaslt|custom routes the GEMMs as the server's flag does;
// --no-autotune keeps auto's built-in table. --compare times a second
// executor on the same weights, with every GEMM on cuBLASLt or with auto's
// untuned table, alternating run by run with the first, and adds its median
// and the ratio: an A/B that the machine's drift between runs (10-25% here at
// times) cannot fake. bm64 / bm128 compare grouped products (--mixtral) run
// with that row tile everywhere against the per-call choice (with --fp8:
// version 6's decode kernel everywhere, or its prefill kernel). graph replays
// the same executor's launches captured once per case in a CUDA graph, with
// the paged plan padded as the server pads it for its graphs
// (server/cuda/forward_graphs.h): what the launches themselves and the gaps
// between kernels cost, against what the server's graphs save.
// --graphs times every executor (the layer, and the --compare one) as a CUDA
// graph replay, as the server runs a batch it captured: with --fp8 and
// --compare bf16, the ratio a served step sees, without the host's launch
// rate in either time. The per-op split is still taken from launches.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_resources.h"
#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"
#include "bench/layer/device_rates.h"
#include "bench/layer/random_fill.h"
#include "layerserve/kernels/layer_ops.h"
#include "server/core/backend.h"
#include "server/core/kv_cache_dtype.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/kernel_timing.h"
#include "server/cuda/kv_pool.h"
#include "server/cuda/layer_executor.h"
#include "server/model/model.h"

namespace layerserve::bench {
namespace {

using cuda::ActivationArena;
using cuda::DeviceBuffer;

constexpr int64_t kMaxTokens = 8192;

// A stateless batch of `tokens` tokens in `seqs` equal sequences, or (with
// context > 0) a session step: `seqs` sessions of tokens / seqs new tokens
// each (one: a decode step; more: a prefill piece), every one over `context`
// cached tokens.
struct Case {
  int64_t tokens;
  int seqs;
  int64_t context = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

LlamaConfig Llama3_8BConfig() {
  LlamaConfig c;
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.num_hidden_layers = 1;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  return c;
}

// Mixtral-8x7B: Llama-3-8B's attention shapes, rope_theta 1e6, and 8 experts
// of intermediate 14336 in place of the MLP, 2 per token.
LlamaConfig Mixtral8x7BConfig() {
  LlamaConfig c = Llama3_8BConfig();
  c.model_type = "mixtral";
  c.rope_theta = 1e6;
  c.num_experts = 8;
  c.experts_per_token = 2;
  return c;
}

// Qwen1.5-MoE-A2.7B (its config.json): 16 heads of 128 without GQA, q/k/v
// biases, 60 experts of 1408, 4 per token with their raw weights, and a
// shared expert of 5632.
LlamaConfig Qwen2MoeConfig() {
  LlamaConfig c = Llama3_8BConfig();
  c.model_type = "qwen2_moe";
  c.hidden_size = 2048;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 16;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.attention_bias = true;
  c.intermediate_size = 1408;
  c.num_experts = 60;
  c.experts_per_token = 4;
  c.normalize_top_k = false;
  c.shared_expert_intermediate_size = 5632;
  return c;
}

// Qwen3-30B-A3B (its config.json): 32 heads of 128 over 4 KV heads, each q and
// k head RMS-normalised, 128 experts of 768, 8 per token, renormalised.
LlamaConfig Qwen3MoeConfig() {
  LlamaConfig c = Llama3_8BConfig();
  c.model_type = "qwen3_moe";
  c.hidden_size = 2048;
  c.num_key_value_heads = 4;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.qk_norm = true;
  c.intermediate_size = 768;
  c.num_experts = 128;
  c.experts_per_token = 8;
  return c;
}

absl::StatusOr<LlamaConfig> BenchConfig(std::string_view model) {
  if (model == "llama3") return Llama3_8BConfig();
  if (model == "mixtral") return Mixtral8x7BConfig();
  if (model == "qwen2-moe") return Qwen2MoeConfig();
  if (model == "qwen3-moe") return Qwen3MoeConfig();
  return absl::InvalidArgumentError(
      absl::StrCat("--model ", std::string(model), ": one of llama3, mixtral, qwen2-moe, qwen3-moe"));
}

// Collects op times of the timed pass.
class CollectingSink final : public KernelTimingSink {
 public:
  void OnKernelTime(std::string_view op, double seconds) override { times_[std::string(op)].push_back(seconds); }
  std::map<std::string, std::vector<double>>& times() { return times_; }

 private:
  std::map<std::string, std::vector<double>> times_;
};

// The FP8 form of `layer`'s four projections (shape's sizes): each bf16
// weight quantized at one static scale (its values are uniform in
// +-half_width), the scales in `scaling`'s layout, all in `storage`.
absl::StatusOr<cuda::LayerDeviceWeights> Fp8Layer(const cuda::LayerDeviceWeights& layer, const cuda::LayerShape& shape,
                                                  kernels::Fp8Scaling scaling, std::vector<DeviceBuffer>& storage,
                                                  double* weight_bytes, cudaStream_t stream) {
  cuda::LayerDeviceWeights out = layer;
  struct Projection {
    const void* bf16;
    int64_t n, k;
    float half_width;
    const void** weight;
    cuda::Fp8Linear* linear;
    bool cublaslt_blocks;  // cuBLASLt's FP8 takes it block-scaled (serving's rule: not gated, not experts)
  };
  const auto uniform = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  const Projection projections[] = {
      {layer.w_qkv, shape.qkv_width(), shape.hidden, uniform(shape.hidden), &out.w_qkv, &out.qkv_fp8, true},
      {layer.w_o, shape.hidden, shape.q_width(), uniform(shape.q_width()), &out.w_o, &out.o_fp8, true},
      // (A mixture of experts': every expert's, stacked, scales likewise.)
      {layer.w_gate_up, shape.mlps() * 2 * shape.intermediate, shape.hidden, uniform(shape.hidden), &out.w_gate_up,
       &out.gate_up_fp8, false},
      {layer.w_down, shape.mlps() * shape.hidden, shape.intermediate, uniform(shape.intermediate), &out.w_down,
       &out.down_fp8, shape.experts == 0},
  };
  for (const Projection& p : projections) {
    const float scale = p.half_width / 448.0f;
    LS_ASSIGN_OR_RETURN(DeviceBuffer codes, DeviceBuffer::Allocate(static_cast<size_t>(p.n * p.k)));
    LS_ASSIGN_OR_RETURN(DeviceBuffer row_scales, DeviceBuffer::Allocate(static_cast<size_t>(p.n) * sizeof(float)));
    kernels::QuantizeFp8Params q;
    q.x = p.bf16;
    q.codes = codes.data();
    q.scales = static_cast<float*>(row_scales.data());  // every row: the static scale
    q.rows = p.n;
    q.cols = p.k;
    q.static_scale = scale;
    LS_RETURN_IF_ERROR(kernels::LaunchQuantizeFp8(q, stream));
    const int64_t kblocks = (p.k + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
    const std::vector<float> block_scales(
        static_cast<size_t>((p.n + kernels::kFp8WeightScaleRows - 1) / kernels::kFp8WeightScaleRows * kblocks), scale);
    LS_ASSIGN_OR_RETURN(DeviceBuffer blocks, DeviceBuffer::Allocate(block_scales.size() * sizeof(float)));
    LS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(blocks.data(), block_scales.data(), block_scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    const std::vector<float> cublaslt_scales(static_cast<size_t>((p.n + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK *
                                                                 kernels::kFp8CublasLtScaleCols(p.k)),
                                             scale);
    LS_ASSIGN_OR_RETURN(DeviceBuffer blocks_128, DeviceBuffer::Allocate(cublaslt_scales.size() * sizeof(float)));
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpy(blocks_128.data(), cublaslt_scales.data(),
                                       cublaslt_scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    const bool block = scaling == kernels::Fp8Scaling::kBlock;
    *p.weight = codes.data();
    *p.linear = cuda::Fp8Linear{scaling, static_cast<const float*>(block ? blocks.data() : row_scales.data()), 0.f,
                                block && p.cublaslt_blocks ? static_cast<const float*>(blocks_128.data()) : nullptr};
    *weight_bytes += static_cast<double>(p.n * p.k) * 1.0 - static_cast<double>(p.n * p.k) * 2.0 +
                     static_cast<double>(block ? block_scales.size() : static_cast<size_t>(p.n)) * sizeof(float);
    storage.push_back(std::move(codes));
    storage.push_back(std::move(row_scales));
    storage.push_back(std::move(blocks));
    storage.push_back(std::move(blocks_128));
  }
  LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return out;
}

absl::Status Run(const std::string& csv_path, const std::string& decode_csv_path, int iters,
                 kernels::GemmMode gemm_mode, bool autotune, const std::string& compare, const LlamaConfig& config,
                 kernels::Fp8Scaling fp8, bool graphs, KvCacheDType kv_dtype) {
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  cudaDeviceProp props{};
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, 0));
  const bool moe = config.IsMixtureOfExperts();
  if (compare == "bf16" && fp8 == kernels::Fp8Scaling::kNone) {
    return absl::InvalidArgumentError("--compare bf16 goes with --fp8");
  }
  if (graphs && compare == "graph") {
    return absl::InvalidArgumentError("--graphs already replays graphs: --compare graph has nothing to compare");
  }
  const cuda::LayerShape bf16_shape = cuda::LayerShape::FromConfig(config, kernels::DType::kBF16);
  cuda::LayerShape shape = bf16_shape;
  shape.fp8 = fp8 != kernels::Fp8Scaling::kNone;
  LS_ASSIGN_OR_RETURN(cuda::CudaStream stream, cuda::CreateStream());

  // Weights: one allocation carved like the backend's, filled on the device.
  struct Piece {
    void* ptr;
    int64_t elements;
    float center;
    float half_width;
  };
  const auto uniform = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  const int64_t shared = shape.shared_intermediate;
  const int64_t head_norm = shape.qk_norm ? shape.head_dim : 0;
  // The pieces a model does not have are empty.
  std::vector<Piece> pieces = {
      {nullptr, shape.hidden, 1.0f, 0.1f},
      {nullptr, shape.qkv_weight_elements(), 0.0f, uniform(shape.hidden)},
      {nullptr, config.attention_bias ? shape.qkv_width() : 0, 0.0f, 0.5f},
      {nullptr, shape.o_weight_elements(), 0.0f, uniform(shape.q_width())},
      {nullptr, shape.hidden, 1.0f, 0.1f},
      {nullptr, shape.gate_up_weight_elements(), 0.0f, uniform(shape.hidden)},
      {nullptr, shape.down_weight_elements(), 0.0f, uniform(shape.intermediate)},
      {nullptr, shape.router_weight_elements(), 0.0f, uniform(shape.hidden)},
      {nullptr, 2 * shared * shape.hidden, 0.0f, uniform(shape.hidden)},
      {nullptr, shape.hidden * shared, 0.0f, uniform(std::max<int64_t>(shared, 1))},
      {nullptr, shared > 0 ? shape.hidden : 0, 0.0f, uniform(shape.hidden)},
      {nullptr, head_norm, 1.0f, 0.1f},
      {nullptr, head_norm, 1.0f, 0.1f},
  };
  cuda::BumpLayout sizing(nullptr);
  for (const Piece& p : pieces) sizing.Take(static_cast<size_t>(p.elements) * 2);
  LS_ASSIGN_OR_RETURN(DeviceBuffer weights, DeviceBuffer::Allocate(sizing.bytes()));
  cuda::BumpLayout layout(weights.data());
  int64_t weight_elements = 0;
  uint64_t seed = 1;
  for (Piece& p : pieces) {
    if (p.elements == 0) continue;
    p.ptr = layout.Take(static_cast<size_t>(p.elements) * 2);
    LS_RETURN_IF_ERROR(FillUniformBf16(p.ptr, p.elements, seed++, p.center, p.half_width, stream.get()));
    weight_elements += p.elements;
  }
  double weight_bytes = 2.0 * static_cast<double>(weight_elements);
  const cuda::LayerDeviceWeights layer{.input_norm = pieces[0].ptr,
                                       .w_qkv = pieces[1].ptr,
                                       .b_qkv = pieces[2].ptr,
                                       .w_o = pieces[3].ptr,
                                       .post_norm = pieces[4].ptr,
                                       .w_gate_up = pieces[5].ptr,
                                       .w_down = pieces[6].ptr,
                                       .router = pieces[7].ptr,
                                       .w_shared_gate_up = pieces[8].ptr,
                                       .w_shared_down = pieces[9].ptr,
                                       .shared_gate = pieces[10].ptr,
                                       .q_norm = pieces[11].ptr,
                                       .k_norm = pieces[12].ptr};
  std::vector<DeviceBuffer> fp8_storage;
  cuda::LayerDeviceWeights served = layer;
  if (shape.fp8) {
    LS_ASSIGN_OR_RETURN(served, Fp8Layer(layer, shape, fp8, fp8_storage, &weight_bytes, stream.get()));
  }
  // Per expert, the bytes of its three projections (0 for a dense layer).
  const double expert_bytes =
      moe ? (shape.fp8 ? 1.0 : 2.0) *
                static_cast<double>(shape.gate_up_weight_elements() + shape.down_weight_elements()) / shape.experts
          : 0.0;

  const std::vector<float> inv_freq = RopeInvFreq(config);
  LS_ASSIGN_OR_RETURN(DeviceBuffer inv_freq_dev, DeviceBuffer::Allocate(inv_freq.size() * sizeof(float)));
  LS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_freq_dev.data(), inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  // The server's GEMM routing: auto mode, tuned at "load" for this layer's
  // shapes (the table goes to stderr).
  // (The bf16 shapes also with --fp8, for the bf16 layer of --compare bf16.)
  std::vector<cuda::TunedShape> gemm_shapes = cuda::TunedShapesFor(bf16_shape, layer);
  if (shape.fp8) {
    for (const cuda::TunedShape& s : cuda::TunedShapesFor(shape, served)) {
      if (s.fp8 != kernels::Fp8Scaling::kNone) gemm_shapes.push_back(s);
    }
  }
  cuda::GemmTuningOptions tuning;
  tuning.autotune = autotune;
  LS_ASSIGN_OR_RETURN(std::unique_ptr<kernels::GemmRouter> gemm,
                      cuda::MakeGemmRouter(gemm_mode, gemm_shapes, kMaxTokens, tuning, std::cerr));
  LS_ASSIGN_OR_RETURN(DeviceBuffer workspace_buffer, DeviceBuffer::Allocate(gemm->workspace_bytes()));
  const kernels::GemmWorkspace workspace{workspace_buffer.data(), workspace_buffer.bytes()};
  // The floors' denominators, measured here (device_rates.h).
  LS_ASSIGN_OR_RETURN(const DeviceRates rates, MeasureDeviceRates(*gemm, workspace, stream.get()));
  LS_ASSIGN_OR_RETURN(ActivationArena arena, ActivationArena::Create(shape, kMaxTokens));
  const size_t x_bytes = static_cast<size_t>(kMaxTokens * shape.hidden) * 2;
  LS_ASSIGN_OR_RETURN(DeviceBuffer x0, DeviceBuffer::Allocate(x_bytes));
  LS_RETURN_IF_ERROR(FillUniformBf16(x0.data(), kMaxTokens * shape.hidden, 99, 0.0f, 1.7f, stream.get()));
  const cuda::LayerExecutor executor(shape, {served}, static_cast<const float*>(inv_freq_dev.data()), gemm.get(),
                                     gemm->device());
  std::unique_ptr<kernels::GemmRouter> gemm_b;
  std::unique_ptr<cuda::LayerExecutor> executor_b;
  if (compare == "bf16") {
    executor_b = std::make_unique<cuda::LayerExecutor>(shape, std::vector<cuda::LayerDeviceWeights>{layer},
                                                       static_cast<const float*>(inv_freq_dev.data()), gemm.get(),
                                                       gemm->device());
  } else if (!compare.empty() && compare != "graph") {
    cuda::GemmTuningOptions untuned = tuning;
    untuned.autotune = false;
    const bool row_tile = compare == "bm64" || compare == "bm128";
    LS_ASSIGN_OR_RETURN(
        gemm_b, cuda::MakeGemmRouter(compare == "cublaslt" ? kernels::GemmMode::kCublasLt : kernels::GemmMode::kAuto,
                                     gemm_shapes, kMaxTokens, row_tile ? tuning : untuned, std::cerr));
    if (row_tile) gemm_b->SetGroupedBlockM(compare == "bm64" ? 64 : 128);
    executor_b = std::make_unique<cuda::LayerExecutor>(shape, std::vector<cuda::LayerDeviceWeights>{served},
                                                       static_cast<const float*>(inv_freq_dev.data()), gemm_b.get(),
                                                       gemm_b->device());
  }
  LS_ASSIGN_OR_RETURN(cuda::OpTimer timer, cuda::OpTimer::Create(cuda::kOpsPerLayer));
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent start, cuda::CreateEvent(cudaEventDefault));
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent stop, cuda::CreateEvent(cudaEventDefault));

  std::printf("device: %s, %d SMs; %s layer, weights %.1f MB (%s); %d timed runs per case%s\n", props.name,
              props.multiProcessorCount, config.model_type.c_str(), weight_bytes / 1e6,
              fp8 == kernels::Fp8Scaling::kBlock    ? "fp8, block-128 scales"
              : fp8 == kernels::Fp8Scaling::kPerRow ? "fp8, per-row scales"
                                                    : "bf16",
              iters, graphs ? ", each a CUDA graph replay" : "");
  std::printf("floors at this run's rates: copy %.2f TB/s (read + written), cuBLASLt bf16 8192^3 %.0f TFLOP/s\n",
              rates.copy_bytes_per_s / 1e12, rates.bf16_flops_per_s / 1e12);
  std::printf("%13s %10s %10s %10s %10s %9s %9s  %s\n", "tokens seqs", "median_ms", "min_ms", "floor_ms", "floor/med",
              "TFLOP/s", "GB/s_w", "per-op medians (us)");
  std::ofstream csv;
  if (!csv_path.empty()) {
    csv.open(csv_path);
    csv << (moe ? "tokens,seqs,ms,experts_ms,grouped_gemms_ms,floor_ms\n" : "tokens,seqs,ms,floor_ms\n");
  }
  std::ofstream decode_csv;
  if (!decode_csv_path.empty()) {
    decode_csv.open(decode_csv_path);
    if (!decode_csv) return absl::InvalidArgumentError(absl::StrCat("cannot write ", decode_csv_path));
    decode_csv << "seqs,context,ms,min_ms,floor_ms" << (compare.empty() ? "" : absl::StrCat(",", compare, "_ms"))
               << "\n";
  }

  std::vector<Case> cases;
  for (const int64_t t : {1, 16, 128, 1024, 4096, 8192}) {
    cases.push_back({t, 1});
    if (t >= 128) cases.push_back({t, 8});
  }
  // What a served batch of stateless 1-token requests is: t sequences of one
  // token each (64 clients make batches of ~30, of any size).
  for (const int t : {27, 32, 64}) cases.push_back({t, t});
  for (const int b : {1, 16, 64}) {
    for (const int64_t l : {1024, 4096}) cases.push_back({b, b, l});
  }
  for (const int64_t piece : {2048, 512}) cases.push_back({piece, 1, kMaxTokens - piece});
  // The KV pool for the decode steps: one layer, blocks for the largest,
  // filled with random bf16 (a step reads only rows of its own tables).
  constexpr int64_t kBlockTokens = 16;
  int64_t pool_blocks = 0;
  for (const Case& c : cases) {
    pool_blocks = std::max(pool_blocks, c.seqs * ((c.context + c.tokens / c.seqs + kBlockTokens - 1) / kBlockTokens));
  }
  LS_ASSIGN_OR_RETURN(
      std::unique_ptr<cuda::KvPool> kv_pool,
      cuda::KvPool::Create(shape, kv_dtype, 1, KvCacheShape{static_cast<int32_t>(pool_blocks), kBlockTokens}, 2,
                           kMaxTokens));
  if (kv_dtype == KvCacheDType::kFp8E4M3) {
    // Codes of 1.5 and scales of 0.0115 (bytes 0x3c): finite everywhere.
    LS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv_pool->k(0), 0x3c, kv_pool->bytes(), stream.get()));
  } else {
    const int64_t pool_elements = static_cast<int64_t>(kv_pool->bytes() / 4);  // of K (or V), bf16
    LS_RETURN_IF_ERROR(FillUniformBf16(kv_pool->k(0), pool_elements, 7, 0.0f, 1.0f, stream.get()));
    LS_RETURN_IF_ERROR(FillUniformBf16(kv_pool->v(0), pool_elements, 8, 0.0f, 1.0f, stream.get()));
  }
  std::vector<KvBlockId> block_ids(static_cast<size_t>(pool_blocks));
  std::iota(block_ids.begin(), block_ids.end(), 0);
  std::shuffle(block_ids.begin(), block_ids.end(), std::mt19937(3));

  bool printed_decode_header = false;
  std::vector<int32_t> meta(2 * kMaxTokens + 1);
  for (const Case& c : cases) {
    const int64_t len = c.tokens / c.seqs;
    const bool session = c.context > 0;  // a decode step or a prefill piece
    for (int64_t t = 0; t < c.tokens; ++t) {
      meta[static_cast<size_t>(t)] = static_cast<int32_t>(c.context + t % len);
    }
    for (int s = 0; s <= c.seqs; ++s) {
      meta[static_cast<size_t>(c.tokens + s)] = static_cast<int32_t>(s * len);
    }
    LS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(arena.meta, meta.data(), (c.tokens + c.seqs + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
    cuda::BatchGeometry geometry;
    geometry.tokens = c.tokens;
    geometry.num_seqs = c.seqs;
    geometry.max_seqlen = static_cast<int>(len);
    geometry.positions = arena.meta;
    geometry.cu_seqlens = arena.meta + c.tokens;
    // A session step's sessions: consecutive slices of the shuffled ids.
    // --compare graph replays what serving captures: the plan padded as the
    // backend pads it for a graph (its own staging, the pool's second).
    cuda::BatchGeometry graph_geometry = geometry;
    Batch batch;
    std::vector<std::vector<KvBlockId>> tables;
    double kv_bytes = 0;
    if (session) {
      const int64_t blocks = (c.context + len + kBlockTokens - 1) / kBlockTokens;
      for (int s = 0; s < c.seqs; ++s) {
        tables.emplace_back(block_ids.begin() + s * blocks, block_ids.begin() + (s + 1) * blocks);
      }
      batch.cu_seqlens.assign(meta.begin() + c.tokens, meta.begin() + c.tokens + c.seqs + 1);
      for (const std::vector<KvBlockId>& table : tables) batch.kv.push_back(SequenceKv{c.context, &table});
      LS_ASSIGN_OR_RETURN(const cuda::BatchKvMeta kv, kv_pool->Upload(batch, 0, stream.get(), /*pad_plan=*/false));
      cuda::AttachKv(kv_pool.get(), kv, &geometry);
      LS_ASSIGN_OR_RETURN(const cuda::BatchKvMeta padded, kv_pool->Upload(batch, 1, stream.get(), /*pad_plan=*/true));
      cuda::AttachKv(kv_pool.get(), padded, &graph_geometry);
      kv_bytes = 2.0 * static_cast<double>(c.seqs) * static_cast<double>(c.context + len) * shape.num_kv_heads *
                 (kv_dtype == KvCacheDType::kFp8E4M3 ? shape.head_dim + 4.0 : shape.head_dim * 2.0);
    }

    // `graph`: replay it instead of launching (--compare graph).
    const auto forward = [&](cuda::OpTimer* op_timer, double* ms, const cuda::LayerExecutor* which = nullptr,
                             cudaGraphExec_t graph = nullptr) -> absl::Status {
      LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena.x, x0.data(), static_cast<size_t>(c.tokens * shape.hidden) * 2,
                                              cudaMemcpyDeviceToDevice, stream.get()));
      LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream.get()));
      if (graph != nullptr) {
        LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph, stream.get()));
      } else {
        LS_RETURN_IF_ERROR(
            (which != nullptr ? *which : executor).Forward(arena, geometry, workspace, stream.get(), op_timer));
      }
      LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream.get()));
      LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
      float elapsed = 0;
      LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&elapsed, start.get(), stop.get()));
      *ms = elapsed;
      return absl::OkStatus();
    };
    double ms = 0;
    for (int i = 0; i < 5; ++i) LS_RETURN_IF_ERROR(forward(nullptr, &ms));

    // Validate before timing: the layer's output must be finite.
    std::vector<uint16_t> out(static_cast<size_t>(c.tokens * shape.hidden));
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), arena.x, out.size() * 2, cudaMemcpyDeviceToHost));
    for (const uint16_t bits : out) {
      if ((bits & 0x7f80) == 0x7f80) {
        return absl::InternalError(absl::StrCat("non-finite output at ", c.tokens, " tokens"));
      }
    }

    std::vector<double> times, times_b;
    const auto capture = [&](const cuda::LayerExecutor& which) {
      return cuda::CaptureGraph(stream.get(), cudaStreamCaptureModeThreadLocal,
                                [&] { return which.Forward(arena, graph_geometry, workspace, stream.get(), nullptr); });
    };
    // graph: what --compare graph replays; graph_a and graph_b: the two
    // executors under --graphs.
    cuda::CudaGraphExec graph, graph_a, graph_b;
    double capture_ms = 0;  // host time of the capture and instantiation, what a server pays once per key
    if (compare == "graph") {
      const auto capture_start = std::chrono::steady_clock::now();
      LS_ASSIGN_OR_RETURN(graph, capture(executor));
      capture_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - capture_start).count();
    }
    if (graphs) {
      LS_ASSIGN_OR_RETURN(graph_a, capture(executor));
      if (executor_b != nullptr) {
        LS_ASSIGN_OR_RETURN(graph_b, capture(*executor_b));
      }
      for (int i = 0; i < 5; ++i) LS_RETURN_IF_ERROR(forward(nullptr, &ms, nullptr, graph_a.get()));
    }
    cudaGraphExec_t replay_b = graphs ? graph_b.get() : graph.get();
    const bool alternate = executor_b != nullptr || graph.get() != nullptr;
    if (alternate) {
      for (int i = 0; i < 5; ++i) LS_RETURN_IF_ERROR(forward(nullptr, &ms, executor_b.get(), replay_b));
    }
    for (int i = 0; i < iters; ++i) {
      LS_RETURN_IF_ERROR(forward(nullptr, &ms, nullptr, graph_a.get()));
      times.push_back(ms);
      if (alternate) {
        LS_RETURN_IF_ERROR(forward(nullptr, &ms, executor_b.get(), replay_b));
        times_b.push_back(ms);
      }
    }
    CollectingSink sink;
    for (int i = 0; i < std::max(5, iters / 4); ++i) {
      LS_RETURN_IF_ERROR(forward(&timer, &ms));
      LS_RETURN_IF_ERROR(timer.Report(&sink));
    }

    const double median_ms = Median(times);
    const double min_ms = *std::min_element(times.begin(), times.end());
    // Bytes a batch must read and multiply: a dense layer all its weights;
    // a mixture of experts its attention, its router and the experts it is
    // expected to use, each token multiplying through k of them.
    double read_bytes = weight_bytes;
    double multiplied = static_cast<double>(weight_elements);
    if (moe) {
      const double e = shape.experts, k = shape.top_k;
      const double used = e * (1.0 - std::pow(1.0 - k / e, static_cast<double>(c.tokens)));
      read_bytes = weight_bytes - (e - used) * expert_bytes;
      multiplied = static_cast<double>(weight_elements) - (e - k) * expert_bytes / 2.0;
    }
    const double gemm_flops = 2.0 * static_cast<double>(c.tokens) * multiplied;
    // Each new token i (0-based) of a sequence attends over context + i + 1
    // keys: QK^T and PV, 2 flops per multiply-add each.
    const double keys_attended = static_cast<double>(len) * static_cast<double>(c.context) +
                                 0.5 * static_cast<double>(len) * static_cast<double>(len + 1);
    const double attn_flops = 4.0 * shape.num_heads * shape.head_dim * static_cast<double>(c.seqs) * keys_attended;
    const double floor_ms = 1e3 * std::max((read_bytes + kv_bytes) / rates.copy_bytes_per_s,
                                           (gemm_flops + attn_flops) / rates.bf16_flops_per_s);
    std::string ops;
    std::map<std::string_view, double> op_ms;
    for (const std::string_view op :
         {cuda::kOpNorm, cuda::kOpGemmQkv, cuda::kOpRope, cuda::kOpAttention, cuda::kOpGemmO, cuda::kOpMoeRoute,
          cuda::kOpGemmGateUp, cuda::kOpGemmDown, cuda::kOpMoeCombine, cuda::kOpSharedExpert}) {
      const auto& v = sink.times()[std::string(op)];
      if (v.empty()) continue;  // the MoE ops of a dense layer
      // "norm" runs twice per layer: report the per-layer total.
      const double per_layer = Median(v) * (op == cuda::kOpNorm ? 2 : 1);
      op_ms[op] = per_layer * 1e3;
      absl::StrAppend(&ops, std::string(op), "=", static_cast<int64_t>(per_layer * 1e6 + 0.5), " ");
    }
    if (session && !printed_decode_header) {
      std::printf(
          "session steps: tokens / seqs new tokens per session (1: decode; more: a prefill piece) over L cached "
          "tokens; the floor includes the K/V read\n");
      printed_decode_header = true;
    }
    const std::string label =
        session ? absl::StrCat(c.tokens, " ", c.seqs, " L=", c.context) : absl::StrCat(c.tokens, " ", c.seqs);
    std::printf("%13s %10.4f %10.4f %10.4f %10.2f %9.1f %9.0f  %s\n", label.c_str(), median_ms, min_ms, floor_ms,
                floor_ms / median_ms, (gemm_flops + attn_flops) / (median_ms * 1e-3) / 1e12,
                read_bytes / (median_ms * 1e-3) / 1e9, ops.c_str());
    if (!times_b.empty()) {
      std::printf("%13s %10.4f  (%s, alternating with the row above: %.3fx its time", "", Median(times_b),
                  compare.c_str(), Median(times_b) / median_ms);
      if (graph.get() != nullptr) std::printf("; captured in %.2f ms of host time", capture_ms);
      std::printf(")\n");
    }
    // hf_layer.py compares the stateless rows; decode rows go to --decode-csv
    // (torch_decode_step.py's PyTorch step is their twin).
    if (csv.is_open() && !session) {
      csv << c.tokens << "," << c.seqs << "," << median_ms;
      if (moe) {
        const double grouped = op_ms[cuda::kOpGemmGateUp] + op_ms[cuda::kOpGemmDown];
        csv << "," << grouped + op_ms[cuda::kOpMoeRoute] + op_ms[cuda::kOpMoeCombine] + op_ms[cuda::kOpSharedExpert]
            << "," << grouped;
      }
      csv << "," << floor_ms << "\n";
    }
    if (decode_csv.is_open() && session && len == 1) {
      decode_csv << c.seqs << "," << c.context << "," << median_ms << "," << min_ms << "," << floor_ms;
      if (!times_b.empty()) decode_csv << "," << Median(times_b);
      decode_csv << "\n";
    }
  }
  std::printf("gemm plans cached: %zu\n", gemm->CachedPlans());
  return absl::OkStatus();
}

}  // namespace
}  // namespace layerserve::bench

int main(int argc, char** argv) {
  std::string csv_path;
  std::string decode_csv_path;
  int iters = 50;
  layerserve::kernels::GemmMode gemm_mode = layerserve::kernels::GemmMode::kAuto;
  bool autotune = true;
  std::string compare;
  std::string model = "llama3";
  layerserve::kernels::Fp8Scaling fp8 = layerserve::kernels::Fp8Scaling::kNone;
  bool graphs = false;
  layerserve::KvCacheDType kv_dtype = layerserve::KvCacheDType::kActivation;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--csv" && i + 1 < argc) {
      csv_path = argv[++i];
    } else if (arg == "--decode-csv" && i + 1 < argc) {
      decode_csv_path = argv[++i];
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--gemm" && i + 1 < argc) {
      const absl::StatusOr<layerserve::kernels::GemmMode> mode = layerserve::kernels::ParseGemmMode(argv[++i]);
      if (!mode.ok()) {
        std::cerr << mode.status().message() << "\n";
        return 2;
      }
      gemm_mode = *mode;
    } else if (arg == "--graphs") {
      graphs = true;
    } else if (arg == "--kv-cache" && i + 1 < argc) {
      const absl::StatusOr<layerserve::KvCacheDType> dtype = layerserve::ParseKvCacheDType(argv[++i]);
      if (!dtype.ok()) {
        std::cerr << dtype.status().message() << "\n";
        return 2;
      }
      kv_dtype = *dtype;
    } else if (arg == "--no-autotune") {
      autotune = false;
    } else if (arg == "--mixtral") {
      model = "mixtral";
    } else if (arg == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else if (arg == "--compare" && i + 1 < argc &&
               (std::string_view(argv[i + 1]) == "cublaslt" || std::string_view(argv[i + 1]) == "untuned" ||
                std::string_view(argv[i + 1]) == "bm64" || std::string_view(argv[i + 1]) == "bm128" ||
                std::string_view(argv[i + 1]) == "graph" || std::string_view(argv[i + 1]) == "bf16")) {
      compare = argv[++i];
    } else if (arg == "--fp8" && i + 1 < argc &&
               (std::string_view(argv[i + 1]) == "block" || std::string_view(argv[i + 1]) == "row")) {
      fp8 = std::string_view(argv[++i]) == "block" ? layerserve::kernels::Fp8Scaling::kBlock
                                                   : layerserve::kernels::Fp8Scaling::kPerRow;
    } else {
      std::cerr << "usage: layer_bench [--csv PATH] [--decode-csv PATH] [--iters N] [--gemm auto|cublaslt|custom] "
                   "[--no-autotune] [--compare cublaslt|untuned|bm64|bm128|graph|bf16] "
                   "[--model llama3|mixtral|qwen2-moe|qwen3-moe] [--mixtral] [--fp8 block|row] [--graphs] "
                   "[--kv-cache auto|fp8]\n";
      return 2;
    }
  }
  const absl::StatusOr<layerserve::LlamaConfig> config = layerserve::bench::BenchConfig(model);
  const absl::Status status = config.ok() ? layerserve::bench::Run(csv_path, decode_csv_path, iters, gemm_mode,
                                                                   autotune, compare, *config, fp8, graphs, kv_dtype)
                                          : config.status();
  if (!status.ok()) {
    std::cerr << "layer_bench: " << status << "\n";
    return 1;
  }
  return 0;
}
