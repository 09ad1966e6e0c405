// Times one Llama-3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV
// heads, head_dim 128, intermediate 14336, rope_theta 500000, bf16) through
// the CUDA backend's layer executor, the code path every served batch takes.
// Weights are random bf16 generated on the device, so no checkpoint is needed.
//
// For each case (tokens, packed sequences) it restores the input, then times
// Forward between two CUDA events; warm-up first (heuristics, module load),
// then the median of many runs. A second pass with the executor's op timer
// gives the per-op split. Prints a table and, with --csv, writes
// "tokens,seqs,ms" rows that bench/layer/hf_layer.py puts beside HF's times.
//
//   layer_bench [--csv PATH] [--iters N] [--gemm MODE] [--no-autotune]
//               [--compare cublaslt|untuned]
// --gemm auto|cublaslt|custom routes the GEMMs as the server's flag does;
// --no-autotune keeps auto's built-in table. --compare times a second
// executor on the same weights, with every GEMM on cuBLASLt or with auto's
// untuned table, alternating run by run with the first, and adds its median
// and the ratio: an A/B that the machine's drift between runs (10-25% here at
// times) cannot fake.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_resources.h"
#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"
#include "bench/layer/random_fill.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/kernel_timing.h"
#include "server/cuda/layer_executor.h"
#include "server/model/model.h"

namespace layerserve::bench {
namespace {

using cuda::ActivationArena;
using cuda::DeviceBuffer;

constexpr int64_t kMaxTokens = 8192;
constexpr double kHbmBytesPerSecond = 3.0e12;   // measured device-to-device copy, H100 SXM
constexpr double kBf16FlopsPerSecond = 8.0e14;  // measured 8192^3 bf16 GEMM, H100 SXM

struct Case {
  int64_t tokens;
  int seqs;
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

// Collects op times of the timed pass.
class CollectingSink final : public KernelTimingSink {
 public:
  void OnKernelTime(std::string_view op, double seconds) override { times_[std::string(op)].push_back(seconds); }
  std::map<std::string, std::vector<double>>& times() { return times_; }

 private:
  std::map<std::string, std::vector<double>> times_;
};

absl::Status Run(const std::string& csv_path, int iters, kernels::GemmMode gemm_mode, bool autotune,
                 const std::string& compare) {
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  cudaDeviceProp props{};
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, 0));
  const LlamaConfig config = Llama3_8BConfig();
  const cuda::LayerShape shape = cuda::LayerShape::FromConfig(config, kernels::DType::kBF16);
  LS_ASSIGN_OR_RETURN(cuda::CudaStream stream, cuda::CreateStream());

  // Weights: one allocation carved like the backend's, filled on the device.
  struct Piece {
    void* ptr;
    int64_t elements;
    float center;
    float half_width;
  };
  const auto uniform = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  std::vector<Piece> pieces = {
      {nullptr, shape.hidden, 1.0f, 0.1f},
      {nullptr, shape.qkv_weight_elements(), 0.0f, uniform(shape.hidden)},
      {nullptr, shape.o_weight_elements(), 0.0f, uniform(shape.q_width())},
      {nullptr, shape.hidden, 1.0f, 0.1f},
      {nullptr, shape.gate_up_weight_elements(), 0.0f, uniform(shape.hidden)},
      {nullptr, shape.down_weight_elements(), 0.0f, uniform(shape.intermediate)},
  };
  cuda::BumpLayout sizing(nullptr);
  for (const Piece& p : pieces) sizing.Take(static_cast<size_t>(p.elements) * 2);
  LS_ASSIGN_OR_RETURN(DeviceBuffer weights, DeviceBuffer::Allocate(sizing.bytes()));
  cuda::BumpLayout layout(weights.data());
  int64_t weight_elements = 0;
  uint64_t seed = 1;
  for (Piece& p : pieces) {
    p.ptr = layout.Take(static_cast<size_t>(p.elements) * 2);
    LS_RETURN_IF_ERROR(FillUniformBf16(p.ptr, p.elements, seed++, p.center, p.half_width, stream.get()));
    weight_elements += p.elements;
  }
  const double weight_bytes = 2.0 * static_cast<double>(weight_elements);
  const cuda::LayerDeviceWeights layer{pieces[0].ptr, pieces[1].ptr, nullptr,      pieces[2].ptr,
                                       pieces[3].ptr, pieces[4].ptr, pieces[5].ptr};

  const std::vector<float> inv_freq = RopeInvFreq(config);
  LS_ASSIGN_OR_RETURN(DeviceBuffer inv_freq_dev, DeviceBuffer::Allocate(inv_freq.size() * sizeof(float)));
  LS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_freq_dev.data(), inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  // The server's GEMM routing: auto mode, tuned at "load" for this layer's
  // shapes (the table goes to stderr).
  const std::vector<std::pair<int64_t, int64_t>> gemm_shapes = {{shape.qkv_width(), shape.hidden},
                                                                {shape.hidden, shape.q_width()},
                                                                {2 * shape.intermediate, shape.hidden},
                                                                {shape.hidden, shape.intermediate}};
  cuda::GemmTuningOptions tuning;
  tuning.autotune = autotune;
  LS_ASSIGN_OR_RETURN(std::unique_ptr<kernels::GemmRouter> gemm,
                      cuda::MakeGemmRouter(gemm_mode, gemm_shapes, kMaxTokens, tuning, std::cerr));
  LS_ASSIGN_OR_RETURN(DeviceBuffer workspace_buffer, DeviceBuffer::Allocate(gemm->workspace_bytes()));
  const kernels::GemmWorkspace workspace{workspace_buffer.data(), workspace_buffer.bytes()};
  LS_ASSIGN_OR_RETURN(ActivationArena arena, ActivationArena::Create(shape, kMaxTokens));
  const size_t x_bytes = static_cast<size_t>(kMaxTokens * shape.hidden) * 2;
  LS_ASSIGN_OR_RETURN(DeviceBuffer x0, DeviceBuffer::Allocate(x_bytes));
  LS_RETURN_IF_ERROR(FillUniformBf16(x0.data(), kMaxTokens * shape.hidden, 99, 0.0f, 1.7f, stream.get()));
  const cuda::LayerExecutor executor(shape, {layer}, static_cast<const float*>(inv_freq_dev.data()), gemm.get());
  std::unique_ptr<kernels::GemmRouter> gemm_b;
  std::unique_ptr<cuda::LayerExecutor> executor_b;
  if (!compare.empty()) {
    cuda::GemmTuningOptions untuned = tuning;
    untuned.autotune = false;
    LS_ASSIGN_OR_RETURN(
        gemm_b, cuda::MakeGemmRouter(compare == "cublaslt" ? kernels::GemmMode::kCublasLt : kernels::GemmMode::kAuto,
                                     gemm_shapes, kMaxTokens, untuned, std::cerr));
    executor_b = std::make_unique<cuda::LayerExecutor>(shape, std::vector<cuda::LayerDeviceWeights>{layer},
                                                       static_cast<const float*>(inv_freq_dev.data()), gemm_b.get());
  }
  LS_ASSIGN_OR_RETURN(cuda::OpTimer timer, cuda::OpTimer::Create(cuda::kOpsPerLayer));
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent start, cuda::CreateEvent(cudaEventDefault));
  LS_ASSIGN_OR_RETURN(cuda::CudaEvent stop, cuda::CreateEvent(cudaEventDefault));

  std::printf("device: %s, %d SMs; layer weights %.1f MB (bf16); %d timed runs per case\n", props.name,
              props.multiProcessorCount, weight_bytes / 1e6, iters);
  std::printf("%7s %5s %10s %10s %10s %10s %9s %9s  %s\n", "tokens", "seqs", "median_ms", "min_ms", "floor_ms",
              "floor/med", "TFLOP/s", "GB/s_w", "per-op medians (us)");
  std::ofstream csv;
  if (!csv_path.empty()) {
    csv.open(csv_path);
    csv << "tokens,seqs,ms\n";
  }

  std::vector<Case> cases;
  for (const int64_t t : {1, 16, 128, 1024, 4096, 8192}) {
    cases.push_back({t, 1});
    if (t >= 128) cases.push_back({t, 8});
  }
  std::vector<int32_t> meta(2 * kMaxTokens + 1);
  for (const Case& c : cases) {
    const int64_t len = c.tokens / c.seqs;
    for (int64_t t = 0; t < c.tokens; ++t) meta[static_cast<size_t>(t)] = static_cast<int32_t>(t % len);
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

    const auto forward = [&](cuda::OpTimer* op_timer, double* ms,
                             const cuda::LayerExecutor* which = nullptr) -> absl::Status {
      LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena.x, x0.data(), static_cast<size_t>(c.tokens * shape.hidden) * 2,
                                              cudaMemcpyDeviceToDevice, stream.get()));
      LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream.get()));
      LS_RETURN_IF_ERROR(
          (which != nullptr ? *which : executor).Forward(arena, geometry, workspace, stream.get(), op_timer));
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
    if (executor_b != nullptr) {
      for (int i = 0; i < 5; ++i) LS_RETURN_IF_ERROR(forward(nullptr, &ms, executor_b.get()));
    }
    for (int i = 0; i < iters; ++i) {
      LS_RETURN_IF_ERROR(forward(nullptr, &ms));
      times.push_back(ms);
      if (executor_b != nullptr) {
        LS_RETURN_IF_ERROR(forward(nullptr, &ms, executor_b.get()));
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
    const double gemm_flops = 2.0 * static_cast<double>(c.tokens) * static_cast<double>(weight_elements);
    const double attn_flops = 2.0 * shape.num_heads * shape.head_dim * static_cast<double>(c.seqs) *
                              static_cast<double>(len) * static_cast<double>(len + 1);
    const double floor_ms =
        1e3 * std::max(weight_bytes / kHbmBytesPerSecond, (gemm_flops + attn_flops) / kBf16FlopsPerSecond);
    std::string ops;
    for (const std::string_view op : {cuda::kOpNorm, cuda::kOpGemmQkv, cuda::kOpRope, cuda::kOpAttention,
                                      cuda::kOpGemmO, cuda::kOpGemmGateUp, cuda::kOpSiluMul, cuda::kOpGemmDown}) {
      const auto& v = sink.times()[std::string(op)];
      // "norm" runs twice per layer: report the per-layer total.
      const double per_layer = Median(v) * (op == cuda::kOpNorm ? 2 : 1);
      absl::StrAppend(&ops, std::string(op), "=", static_cast<int64_t>(per_layer * 1e6 + 0.5), " ");
    }
    std::printf("%7ld %5d %10.4f %10.4f %10.4f %10.2f %9.1f %9.0f  %s\n", static_cast<long>(c.tokens), c.seqs,
                median_ms, min_ms, floor_ms, floor_ms / median_ms,
                (gemm_flops + attn_flops) / (median_ms * 1e-3) / 1e12, weight_bytes / (median_ms * 1e-3) / 1e9,
                ops.c_str());
    if (!times_b.empty()) {
      std::printf("%7s %5s %10.4f  (%s, alternating with the row above: %.3fx its time)\n", "", "", Median(times_b),
                  compare.c_str(), Median(times_b) / median_ms);
    }
    if (csv.is_open()) csv << c.tokens << "," << c.seqs << "," << median_ms << "\n";
  }
  std::printf("gemm plans cached: %zu\n", gemm->CachedPlans());
  return absl::OkStatus();
}

}  // namespace
}  // namespace layerserve::bench

int main(int argc, char** argv) {
  std::string csv_path;
  int iters = 50;
  layerserve::kernels::GemmMode gemm_mode = layerserve::kernels::GemmMode::kAuto;
  bool autotune = true;
  std::string compare;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--csv" && i + 1 < argc) {
      csv_path = argv[++i];
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--gemm" && i + 1 < argc) {
      const absl::StatusOr<layerserve::kernels::GemmMode> mode = layerserve::kernels::ParseGemmMode(argv[++i]);
      if (!mode.ok()) {
        std::cerr << mode.status().message() << "\n";
        return 2;
      }
      gemm_mode = *mode;
    } else if (arg == "--no-autotune") {
      autotune = false;
    } else if (arg == "--compare" && i + 1 < argc &&
               (std::string_view(argv[i + 1]) == "cublaslt" || std::string_view(argv[i + 1]) == "untuned")) {
      compare = argv[++i];
    } else {
      std::cerr << "usage: layer_bench [--csv PATH] [--iters N] [--gemm auto|cublaslt|custom] [--no-autotune] "
                   "[--compare cublaslt|untuned]\n";
      return 2;
    }
  }
  const absl::Status status = layerserve::bench::Run(csv_path, iters, gemm_mode, autotune, compare);
  if (!status.ok()) {
    std::cerr << "layer_bench: " << status << "\n";
    return 1;
  }
  return 0;
}
