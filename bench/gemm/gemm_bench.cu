// gemm_bench: times the numbered GEMM versions (0 = cuBLASLt) on the
// Llama-3-8B projection shapes over a sweep of token counts M.
//
// Each (version, shape) is first validated against cuBLASLt's output (which
// the GPU test suite checks against an fp64 reference), then timed with CUDA
// events after warm-up: a CUDA graph of 10 back-to-back launches is replayed
// --iters times in each of --rounds rounds that interleave the versions, and
// the median replay time / 10 is reported. Inputs are
// random and rotate among enough buffer sets that their total exceeds the L2
// cache three times over, so timings include the weight streaming from HBM
// that serving sees.
//
//   gemm_bench [--versions=0,3,4,5,auto,6row,6block,6rowp,0row,0block] [--shapes=6144x4096,...] [--ms=1,8,...]
//              [--iters=5] [--rounds=5] [--csv=PATH] [--gated] [--accumulate]
// A version may pin a configuration: 3b128 / 3b256 (v3 tile width), 4s2
// (v4 with 2 K splits); plain 3 and 4 use the launchers' own choice.
//
// FP8 rows (version 6, "6row" per-row scales, "6block" block-128 scales, "6s4row"
// with 4 K splits; "0row" and "0block" cuBLASLt's FP8 with the same scales,
// the route GemmRouter can take instead) time the FP8 GEMM on e4m3 codes of the same random weights
// and activations (weights quantized at one static scale, activations per
// token or per 128-column group, outside the timed graph, as the vendor's
// FP8 timings exclude it), rotating through their own L2-defeating sets;
// their "vs cuBLASLt" column is then FP8 over cuBLASLt's bf16 at that shape.
// They are validated against cuBLASLt's bf16 product within FP8's
// quantization error (tests/gpu/gemm_fp8_test.cc checks the exact numerics).
// With --gated, FP8 rows run only fused (their gate/up interleave is
// kFp8GateUpBlock). A trailing "p" ("6rowp", "6s4blockp") times the
// activations' quantization pass with each GEMM, as a served product whose
// input no producer quantized pays it.
// Every variant runs through one GemmRouter, the code serving runs: a
// numbered version through RunConfig, "auto" through Run after the router was
// autotuned for the shape (as at model load, up to the largest --ms); its row
// also gives its ratio to the fastest other variant at that M, which the
// issue bounds at 2% slower.
//
// --accumulate times each product as a layer's o and down projections run:
// added in place onto C, the residual stream (GemmParams::accumulate); the
// validation runs without it, and "auto" is tuned with it. Not with --gated.
//
// --gated times the MLP's gate/up projection with its SiLU gate instead
// (N = 2 x the intermediate width): each version twice, as "<v>+act" (the
// plain product, then the SiLU kernel) and "<v>:fused" (GemmParams::silu_mul,
// the gate in the epilogue; on cuBLASLt the same two launches), validated
// on the gated output and timed in the same interleaved rounds; "auto" is then
// tuned in the gated form, as serving tunes the gate/up shape.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

#define BENCH_CHECK_CUDA(expr)                                                                            \
  do {                                                                                                    \
    const cudaError_t bench_err_ = (expr);                                                                \
    if (bench_err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(bench_err_)); \
      return false;                                                                                       \
    }                                                                                                     \
  } while (0)

__global__ void FillKernel(__nv_bfloat16* dst, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (seed + 1) * 0xD1B54A32D192ED03ull + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    dst[i] = __float2bfloat16_rn(2.f * static_cast<float>(z >> 40) * (1.0f / 16777216.0f) - 1.f);
  }
}

// Counts elements of `out` that differ from `expected` by more than
// rel * |expected| + abs (or are not finite); also the largest such ratio.
__global__ void CompareKernel(const __nv_bfloat16* out, const __nv_bfloat16* expected, int64_t count, float rel,
                              float abs_tol, unsigned long long* bad, float* worst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float o = __bfloat162float(out[i]);
    const float e = __bfloat162float(expected[i]);
    const float ratio = isfinite(o) ? fabsf(o - e) / (rel * fabsf(e) + abs_tol) : 1e30f;
    if (ratio > 1.f) atomicAdd(bad, 1ull);
    atomicMax(reinterpret_cast<int*>(worst), __float_as_int(ratio));  // ratios are >= 0
  }
}

// out[m, j] = silu(gate) * up of a [m, n] product whose rows interleave gate
// and up by kFp8GateUpBlock (the FP8 kernel's layout), rounded as the fused
// epilogue rounds (gate, up, silu to bf16).
__global__ void Fp8GateReferenceKernel(const __nv_bfloat16* product, __nv_bfloat16* out, int64_t m, int64_t n) {
  const int64_t width = n / 2;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < m * width;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / width, j = i % width;
    const int64_t gate_row = (j / kFp8GateUpBlock) * 2 * kFp8GateUpBlock + j % kFp8GateUpBlock;
    const float g = __bfloat162float(product[row * n + gate_row]);
    const float u = __bfloat162float(product[row * n + gate_row + kFp8GateUpBlock]);
    const float silu = __bfloat162float(__float2bfloat16_rn(g / (1.f + expf(-g))));
    out[i] = __float2bfloat16_rn(silu * u);
  }
}

__global__ void FillFloatKernel(float* dst, int64_t count, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

// FP8 weights are quantized at this one static scale (inputs are uniform in
// [-1, 1)), so the per-row and the block scales of the same codes agree.
constexpr float kBenchWeightScale = 1.f / 448.f;

constexpr int kGraphLaunches = 10;

// One benchmarked configuration, e.g. "4s2" = version 4 with split_k 2.
struct Variant {
  std::string label;
  GemmConfig config;
  bool is_auto = false;                // the autotuned dispatcher; config unused
  bool fused = false;                  // --gated: the gate in the epilogue (else a second kernel)
  Fp8Scaling fp8 = Fp8Scaling::kNone;  // version 6's scaling
  // FP8 rows: LaunchQuantizeFp8 of A before each GEMM, inside the timed
  // graph (suffix "p": what a served product pays where no producer
  // quantized its input); else the GEMM alone, on codes made before.
  bool quantize_pass = false;
};

bool ParseVariant(const std::string& text, Variant* v) {
  if (text == "auto") {
    v->label = "auto";
    v->is_auto = true;
    return true;
  }
  std::string spec = text;
  const auto ends_with = [&](std::string_view suffix) {
    return spec.size() > suffix.size() && spec.compare(spec.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("rowp") || ends_with("blockp")) {
    v->quantize_pass = true;
    spec.pop_back();
  }
  for (const auto& [suffix, scaling] : {std::pair<std::string, Fp8Scaling>{"row", Fp8Scaling::kPerRow},
                                        std::pair<std::string, Fp8Scaling>{"block", Fp8Scaling::kBlock}}) {
    if (spec.size() > suffix.size() && spec.compare(spec.size() - suffix.size(), suffix.size(), suffix) == 0) {
      spec.resize(spec.size() - suffix.size());
      v->fp8 = scaling;
    }
  }
  const absl::StatusOr<GemmConfig> config = ParseGemmConfigSpec(spec);
  // FP8 rows: version 6, or 0 (cuBLASLt's FP8: "0row", "0block").
  if (!config.ok() || (config->version == GemmVersion::kFp8 && v->fp8 == Fp8Scaling::kNone) ||
      (v->fp8 != Fp8Scaling::kNone && config->version != GemmVersion::kFp8 &&
       config->version != GemmVersion::kCublasLt)) {
    return false;
  }
  if (v->quantize_pass && config->version != GemmVersion::kFp8) return false;
  v->label = GemmConfigSpec(*config) +
             (v->fp8 == Fp8Scaling::kPerRow  ? "row"
              : v->fp8 == Fp8Scaling::kBlock ? "block"
                                             : "") +
             (v->quantize_pass ? "p" : "");
  v->config = *config;
  return true;
}

struct Options {
  std::vector<Variant> versions = {{"v0", {GemmVersion::kCublasLt, 0, 0}},
                                   {"v3", {GemmVersion::kWarpSpecialized, 0, 0}},
                                   {"v4", {GemmVersion::kSmallMSplitK, 0, 0}},
                                   {"auto", {}, true}};
  std::vector<std::pair<int64_t, int64_t>> shapes = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  std::vector<int64_t> ms = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
  int iters = 5;   // timed graph replays per round
  int rounds = 5;  // interleaved rounds over the variants
  std::string csv;
  bool gated = false;
  bool accumulate = false;
};

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

bool ParseOptions(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    if (key == "--versions") {
      opt->versions.clear();
      for (const std::string& text : Split(value, ',')) {
        Variant v;
        if (!ParseVariant(text, &v)) return false;
        opt->versions.push_back(v);
      }
    } else if (key == "--shapes") {
      opt->shapes.clear();
      for (const std::string& s : Split(value, ',')) {
        const size_t x = s.find('x');
        if (x == std::string::npos) return false;
        opt->shapes.push_back({std::atoll(s.substr(0, x).c_str()), std::atoll(s.substr(x + 1).c_str())});
      }
    } else if (key == "--ms") {
      opt->ms.clear();
      for (const std::string& m : Split(value, ',')) opt->ms.push_back(std::atoll(m.c_str()));
    } else if (key == "--iters") {
      opt->iters = std::max(1, std::atoi(value.c_str()));
    } else if (key == "--rounds") {
      opt->rounds = std::max(1, std::atoi(value.c_str()));
    } else if (key == "--csv") {
      opt->csv = value;
    } else if (key == "--gated" && value.empty()) {
      opt->gated = true;
    } else if (key == "--accumulate" && value.empty()) {
      opt->accumulate = true;
    } else {
      return false;
    }
  }
  if (opt->gated && opt->accumulate) return false;
  if (opt->gated) {
    std::vector<Variant> both;
    for (Variant v : opt->versions) {
      const std::string label = v.label;
      v.label = label + "+act";
      if (v.fp8 == Fp8Scaling::kNone) both.push_back(v);
      v.label = label + ":fused";
      v.fused = true;
      both.push_back(v);
    }
    opt->versions = both;
  }
  return true;
}

struct Row {
  int64_t m, n, k;
  std::string label;
  std::string status;  // "ok", "INVALID", "n/a: ..."
  double median_us = 0, tflops = 0, gbps = 0, ratio = 0;
  // auto rows: the dispatcher's choice, and its time over the fastest other
  // variant's at this M (1.00 = as fast; the bound is 1.02).
  std::string chosen;
  double vs_best = 0;
};

class Bench {
 public:
  explicit Bench(Options opt) : opt_(std::move(opt)) {}
  ~Bench() {
    for (void* p : allocations_) cudaFree(p);
    if (workspace_.data != nullptr) cudaFree(workspace_.data);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  bool Run();

 private:
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    allocations_.push_back(p);
    return p;
  }
  // `act`: where --gated writes the gated output ([m, n / 2]).
  // a_bf16: the bf16 activations `p`'s codes come from ("p" rows).
  absl::Status Launch(const Variant& variant, const GemmParams& p, void* act, const void* a_bf16 = nullptr);
  bool RunShape(int64_t n, int64_t k);
  void Print(const Row& r) const;

  Options opt_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmRouter> router_;  // autotuned for each shape "auto" runs on
  GemmWorkspace workspace_;
  std::vector<void*> allocations_;
  std::vector<Row> rows_;
  size_t l2_bytes_ = 0;
};

// out[m, n / 2] = silu(gate) * up of an interleaved gate/up product [m, n].
absl::Status GateKernel(const void* gate_up, void* out, int64_t m, int64_t n, cudaStream_t stream) {
  SiluMulParams gate;
  gate.gate_up = gate_up;
  gate.out = out;
  gate.rows = m;
  gate.width = n / 2;
  return LaunchSiluMul(gate, stream);
}

absl::Status Bench::Launch(const Variant& variant, const GemmParams& plain, void* act, const void* a_bf16) {
  GemmParams p = plain;
  if (variant.quantize_pass) {
    QuantizeFp8Params q;
    q.x = a_bf16;
    q.codes = const_cast<void*>(p.a);
    q.scales = const_cast<float*>(p.a_scale);
    q.rows = p.m;
    q.cols = p.k;
    q.group = p.fp8 == Fp8Scaling::kBlock ? kFp8BlockK : 0;
    if (absl::Status st = LaunchQuantizeFp8(q, stream_); !st.ok()) return st;
  }
  if (variant.fused) {
    p.silu_mul = true;
    p.scratch = plain.d;  // the cuBLASLt route's plain product
    p.d = act;
    p.ldd = p.n / 2;
  }
  absl::Status st = variant.is_auto ? router_->Run(p, workspace_, stream_)
                                    : router_->RunConfig(p, variant.config, workspace_, stream_);
  if (!st.ok() || !opt_.gated || variant.fused) return st;
  return GateKernel(plain.d, act, p.m, p.n, stream_);
}

void Bench::Print(const Row& r) const {
  if (r.status == "ok") {
    std::printf("%6lld %6lld %6lld  %-9s %10.1f us  %7.1f TFLOP/s  %7.0f GB/s  %5.2fx v0", static_cast<long long>(r.m),
                static_cast<long long>(r.n), static_cast<long long>(r.k), r.label.c_str(), r.median_us, r.tflops,
                r.gbps, r.ratio);
    if (!r.chosen.empty()) std::printf("  [%s, %.3fx the fastest other]", r.chosen.c_str(), r.vs_best);
    std::printf("\n");
  } else {
    std::printf("%6lld %6lld %6lld  %-9s %s\n", static_cast<long long>(r.m), static_cast<long long>(r.n),
                static_cast<long long>(r.k), r.label.c_str(), r.status.c_str());
  }
  std::fflush(stdout);
}

bool Bench::RunShape(int64_t n, int64_t k) {
  const int64_t max_m = *std::max_element(opt_.ms.begin(), opt_.ms.end());
  const size_t w_bytes = n * k * 2;
  const size_t a_bytes = max_m * k * 2;
  const size_t c_bytes = max_m * n * 2;
  // Rotate through enough weight+activation sets to defeat the L2.
  const int sets = static_cast<int>(std::max<size_t>(2, (3 * l2_bytes_ + w_bytes - 1) / w_bytes));
  std::vector<void*> a(sets), w(sets), c(sets), act(sets);
  for (int s = 0; s < sets; ++s) {
    a[s] = Alloc(a_bytes);
    w[s] = Alloc(w_bytes);
    c[s] = Alloc(c_bytes);
    act[s] = Alloc(c_bytes / 2);
    if (a[s] == nullptr || w[s] == nullptr || c[s] == nullptr || act[s] == nullptr) {
      std::fprintf(stderr, "out of device memory for n=%lld k=%lld\n", static_cast<long long>(n),
                   static_cast<long long>(k));
      return false;
    }
    FillKernel<<<4096, 256, 0, stream_>>>(static_cast<__nv_bfloat16*>(a[s]), max_m * k, 2 * s);
    FillKernel<<<4096, 256, 0, stream_>>>(static_cast<__nv_bfloat16*>(w[s]), n * k, 2 * s + 1);
    BENCH_CHECK_CUDA(cudaPeekAtLastError());
  }
  // FP8 operands (version 6 rows): the same weights' e4m3 codes at one static
  // scale, and each set's activations quantized per token and per 128-column
  // group (at every M, below).
  const bool any_fp8 = std::any_of(opt_.versions.begin(), opt_.versions.end(),
                                   [](const Variant& v) { return v.fp8 != Fp8Scaling::kNone; });
  const int64_t kblocks = (k + kFp8BlockK - 1) / kFp8BlockK;
  std::vector<void*> w8(sets), a8_row(sets), a8_block(sets);
  std::vector<float*> a_scale_row(sets), a_scale_block(sets);
  float* w_scale_row = nullptr;
  float* w_scale_block = nullptr;
  float* w_scale_128 = nullptr;  // cuBLASLt's layout of the same block scales
  if (any_fp8) {
    const int64_t scales_128 = (n + kFp8BlockK - 1) / kFp8BlockK * kFp8CublasLtScaleCols(k);
    w_scale_row = static_cast<float*>(Alloc(n * 4));
    w_scale_block = static_cast<float*>(Alloc((n + kFp8WeightScaleRows - 1) / kFp8WeightScaleRows * kblocks * 4));
    w_scale_128 = static_cast<float*>(Alloc(scales_128 * 4));
    if (w_scale_row == nullptr || w_scale_block == nullptr || w_scale_128 == nullptr) return false;
    FillFloatKernel<<<256, 256, 0, stream_>>>(
        w_scale_block, (n + kFp8WeightScaleRows - 1) / kFp8WeightScaleRows * kblocks, kBenchWeightScale);
    FillFloatKernel<<<256, 256, 0, stream_>>>(w_scale_128, scales_128, kBenchWeightScale);
    for (int s = 0; s < sets; ++s) {
      w8[s] = Alloc(n * k);
      a8_row[s] = Alloc(max_m * k);
      a8_block[s] = Alloc(max_m * k);
      a_scale_row[s] = static_cast<float*>(Alloc(max_m * 4));
      a_scale_block[s] = static_cast<float*>(Alloc(max_m * kblocks * 4));
      if (w8[s] == nullptr || a8_row[s] == nullptr || a8_block[s] == nullptr || a_scale_row[s] == nullptr ||
          a_scale_block[s] == nullptr) {
        std::fprintf(stderr, "out of device memory for FP8 operands\n");
        return false;
      }
      QuantizeFp8Params q;
      q.x = w[s];
      q.codes = w8[s];
      q.scales = w_scale_row;  // every row gets the static scale
      q.rows = n;
      q.cols = k;
      q.static_scale = kBenchWeightScale;
      if (!LaunchQuantizeFp8(q, stream_).ok()) return false;
    }
  }
  void* expected = Alloc(c_bytes);
  void* expected_act = Alloc(c_bytes / 2);
  void* expected_act8 = Alloc(c_bytes / 2);
  unsigned long long* bad = static_cast<unsigned long long*>(Alloc(sizeof(unsigned long long) + sizeof(float)));
  float* worst = reinterpret_cast<float*>(bad + 1);
  if (expected == nullptr || expected_act == nullptr || expected_act8 == nullptr || bad == nullptr) return false;
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  if (std::any_of(opt_.versions.begin(), opt_.versions.end(), [](const Variant& v) { return v.is_auto; })) {
    const absl::StatusOr<std::vector<GemmTuneResult>> tuned =
        router_->Autotune(n, k, max_m, workspace_, stream_, opt_.gated, Fp8Scaling::kNone, opt_.accumulate);
    if (!tuned.ok()) {
      std::fprintf(stderr, "autotune: %s\n", std::string(tuned.status().message()).c_str());
      return false;
    }
  }

  for (int64_t m : opt_.ms) {
    auto params = [&](int s, void* out, Fp8Scaling fp8 = Fp8Scaling::kNone) {
      GemmParams p;
      p.a = a[s];
      p.lda = k;
      p.w = w[s];
      p.ldw = k;
      p.d = out;
      p.ldd = n;
      p.m = m;
      p.n = n;
      p.k = k;
      p.fp8 = fp8;
      if (fp8 != Fp8Scaling::kNone) {
        const bool block = fp8 == Fp8Scaling::kBlock;
        p.a = block ? a8_block[s] : a8_row[s];
        p.w = w8[s];
        p.a_scale = block ? a_scale_block[s] : a_scale_row[s];
        p.w_scale = block ? w_scale_block : w_scale_row;
        // (A gated block-scaled weight has no cuBLASLt scales in serving:
        // its 64-row interleave puts gate and up rows in one 128-row block.)
        p.w_scale_128 = block && !opt_.gated ? w_scale_128 : nullptr;
      }
      return p;
    };
    for (int s = 0; any_fp8 && s < sets; ++s) {
      QuantizeFp8Params q;
      q.x = a[s];
      q.rows = m;
      q.cols = k;
      q.codes = a8_row[s];
      q.scales = a_scale_row[s];
      if (!LaunchQuantizeFp8(q, stream_).ok()) return false;
      q.codes = a8_block[s];
      q.scales = a_scale_block[s];
      q.group = kFp8BlockK;
      if (!LaunchQuantizeFp8(q, stream_).ok()) return false;
    }
    const absl::Status ref_status =
        router_->RunConfig(params(0, expected), GemmConfig{GemmVersion::kCublasLt}, workspace_, stream_);
    if (!ref_status.ok()) {
      std::fprintf(stderr, "cuBLASLt reference failed: %s\n", std::string(ref_status.message()).c_str());
      return false;
    }
    if (opt_.gated && !GateKernel(expected, expected_act, m, n, stream_).ok()) return false;
    if (opt_.gated && any_fp8) {
      Fp8GateReferenceKernel<<<1024, 256, 0, stream_>>>(static_cast<const __nv_bfloat16*>(expected),
                                                        static_cast<__nv_bfloat16*>(expected_act8), m, n);
    }
    // Pass 1: validate each variant and capture its graph. Pass 2: time the
    // captured graphs in interleaved rounds, so clock and power drift over
    // the sweep hits every variant alike instead of whichever ran last.
    struct Timed {
      Row row;
      cudaGraphExec_t exec = nullptr;
      std::vector<float> times;
      bool fp8 = false;
    };
    std::vector<Timed> timed;
    for (const Variant& variant : opt_.versions) {
      const bool fp8 = variant.fp8 != Fp8Scaling::kNone;
      GemmParams probe = params(0, c[0], variant.fp8);
      if (variant.fused) {
        probe.silu_mul = true;
        probe.ldd = n / 2;
      }
      const GemmConfig config = variant.is_auto ? router_->Route(probe) : variant.config;
      Row row{m, n, k, variant.label, "ok"};
      if (variant.is_auto) row.chosen = GemmConfigSpec(config);
      if (!variant.is_auto && config.version == GemmVersion::kSmallMSplitK && m > 64) continue;  // small-M only
      const absl::Status supported =
          config.version == GemmVersion::kCublasLt ? absl::OkStatus() : GemmSupported(probe, config, router_->device());
      if (!supported.ok()) {
        row.status = "n/a: " + std::string(supported.message());
        timed.push_back({row});
        continue;
      }
      // Validate against cuBLASLt on poisoned output (--gated: the gated
      // output, whose operands carry the product's rounding: a looser bound).
      BENCH_CHECK_CUDA(cudaMemsetAsync(c[0], 0xFF, m * n * 2, stream_));
      BENCH_CHECK_CUDA(cudaMemsetAsync(act[0], 0xFF, m * n, stream_));
      BENCH_CHECK_CUDA(cudaMemsetAsync(bad, 0, sizeof(unsigned long long) + sizeof(float), stream_));
      const absl::Status st = Launch(variant, params(0, c[0], variant.fp8), act[0], a[0]);
      if (st.ok()) {
        const float scale = std::sqrt(static_cast<float>(k)) / 3.f;  // uniform [-1, 1) inputs
        // FP8 rows: within e4m3's quantization error of the bf16 product
        // (about a tenth of its scale), which wrong data or a lost scale is not.
        // Gated, both factors carry it: 0.3 scale^2 failed a few hundred of
        // 8192 x 14336 outputs (at most 1.7x over) for cuBLASLt's FP8 as
        // for ours, so the bound is 0.6 scale^2 there.
        const float rel = fp8 ? 0.1f : opt_.gated ? 6.06f / 256.f : 2.02f / 256.f;
        const float abs_tol = (fp8 ? (opt_.gated ? 0.6f : 0.3f) : 1e-3f) * (opt_.gated ? scale * scale : scale);
        CompareKernel<<<1024, 256, 0, stream_>>>(
            static_cast<const __nv_bfloat16*>(opt_.gated ? act[0] : c[0]),
            static_cast<const __nv_bfloat16*>(opt_.gated ? (fp8 ? expected_act8 : expected_act) : expected),
            opt_.gated ? m * n / 2 : m * n, rel, abs_tol, bad, worst);
        BENCH_CHECK_CUDA(cudaPeekAtLastError());
      }
      BENCH_CHECK_CUDA(cudaStreamSynchronize(stream_));
      unsigned long long bad_host = 0;
      float worst_host = 0;
      BENCH_CHECK_CUDA(cudaMemcpy(&bad_host, bad, sizeof(bad_host), cudaMemcpyDeviceToHost));
      BENCH_CHECK_CUDA(cudaMemcpy(&worst_host, worst, sizeof(worst_host), cudaMemcpyDeviceToHost));
      if (!st.ok() || bad_host != 0) {
        row.status = !st.ok() ? "FAILED: " + std::string(st.message())
                              : "INVALID: " + std::to_string(bad_host) + " bad elements, worst err/allowed " +
                                    std::to_string(worst_host);
        timed.push_back({row});
        continue;
      }
      // Launches go back to back, as in a layer, through a graph of
      // kGraphLaunches launches rotating over the buffer sets (host launch
      // cost stays out of the numbers).
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (opt_.accumulate) {
        for (int s = 0; s < sets; ++s) BENCH_CHECK_CUDA(cudaMemsetAsync(c[s], 0, m * n * 2, stream_));
      }
      BENCH_CHECK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
      bool captured = true;
      for (int i = 0; i < kGraphLaunches && captured; ++i) {
        GemmParams p = params(i % sets, c[i % sets], variant.fp8);
        p.accumulate = opt_.accumulate;
        captured = Launch(variant, p, act[i % sets], a[i % sets]).ok();
      }
      BENCH_CHECK_CUDA(cudaStreamEndCapture(stream_, &graph));
      if (!captured) {
        std::fprintf(stderr, "launch failed during graph capture\n");
        return false;
      }
      BENCH_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      cudaGraphDestroy(graph);
      BENCH_CHECK_CUDA(cudaGraphLaunch(exec, stream_));  // warm-up replay
      timed.push_back({row, exec, {}, fp8});
    }
    // Each round also starts at another variant, so none always runs right
    // after the same neighbour (a power-hungry predecessor can leave the
    // clocks lower for the next one).
    for (int round = 0; round < opt_.rounds; ++round) {
      for (size_t j = 0; j < timed.size(); ++j) {
        Timed& t = timed[(j + static_cast<size_t>(round)) % timed.size()];
        if (t.exec == nullptr) continue;
        for (int i = 0; i < opt_.iters; ++i) {
          BENCH_CHECK_CUDA(cudaEventRecord(start, stream_));
          BENCH_CHECK_CUDA(cudaGraphLaunch(t.exec, stream_));
          BENCH_CHECK_CUDA(cudaEventRecord(stop, stream_));
          BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
          float ms = 0;
          BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          t.times.push_back(ms / kGraphLaunches);
        }
      }
    }
    double v0_us = 0, best_other_us = 0;
    for (Timed& t : timed) {
      if (t.exec == nullptr) continue;
      cudaGraphExecDestroy(t.exec);
      std::sort(t.times.begin(), t.times.end());
      Row& row = t.row;
      row.median_us = 1e3 * t.times[t.times.size() / 2];
      row.tflops = 2.0 * m * n * k / (row.median_us * 1e-6) / 1e12;
      const double operand_bytes = t.fp8 ? 1.0 : 2.0;  // A and W
      row.gbps = (operand_bytes * (m * k + n * k) + 2.0 * m * n) / (row.median_us * 1e-6) / 1e9;
      if (row.label == "v0" || row.label == "v0+act") v0_us = row.median_us;
      if (row.chosen.empty() && (best_other_us == 0 || row.median_us < best_other_us)) best_other_us = row.median_us;
    }
    for (Timed& t : timed) {
      Row& row = t.row;
      if (row.status == "ok") {
        row.ratio = v0_us > 0 ? v0_us / row.median_us : 0;
        if (!row.chosen.empty()) row.vs_best = best_other_us > 0 ? row.median_us / best_other_us : 0;
      }
      rows_.push_back(row);
      Print(row);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  // Free this shape's buffers before the next shape (the router keeps its
  // table: entries of other shapes never match this one's).
  for (void* p : allocations_) cudaFree(p);
  allocations_.clear();
  return true;
}

bool Bench::Run() {
  int device = 0;
  BENCH_CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  l2_bytes_ = prop.l2CacheSize;
  std::printf("device: %s, %d SMs, L2 %zu MB\n", prop.name, prop.multiProcessorCount, l2_bytes_ >> 20);
  BENCH_CHECK_CUDA(cudaStreamCreate(&stream_));
  absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
  if (!router.ok()) {
    std::fprintf(stderr, "%s\n", std::string(router.status().message()).c_str());
    return false;
  }
  router_ = *std::move(router);
  BENCH_CHECK_CUDA(cudaMalloc(&workspace_.data, GemmRouter::kDefaultWorkspaceBytes));
  workspace_.bytes = GemmRouter::kDefaultWorkspaceBytes;
  std::printf("%6s %6s %6s  %-9s %13s  %15s  %11s  %s\n", "M", "N", "K", "ver", "median", "rate", "A+W+C",
              "vs cuBLASLt");
  for (const auto& [n, k] : opt_.shapes) {
    if (!RunShape(n, k)) return false;
  }
  if (!opt_.csv.empty()) {
    FILE* f = std::fopen(opt_.csv.c_str(), "w");
    if (f == nullptr) return false;
    std::fprintf(f, "m,n,k,version,status,median_us,tflops,gbps,ratio_vs_v0,chosen,vs_fastest_other\n");
    for (const Row& r : rows_) {
      std::fprintf(f, "%lld,%lld,%lld,%s,\"%s\",%.2f,%.2f,%.1f,%.3f,%s,%.3f\n", static_cast<long long>(r.m),
                   static_cast<long long>(r.n), static_cast<long long>(r.k), r.label.c_str(), r.status.c_str(),
                   r.median_us, r.tflops, r.gbps, r.ratio, r.chosen.c_str(), r.vs_best);
    }
    std::fclose(f);
  }
  return true;
}

}  // namespace
}  // namespace layerserve::kernels

int main(int argc, char** argv) {
  layerserve::kernels::Options opt;
  if (!layerserve::kernels::ParseOptions(argc, argv, &opt)) {
    std::fprintf(stderr,
                 "usage: gemm_bench [--versions=0,3,3b128,4,4s2,5,auto,6row,6block,6s4row,...] [--shapes=NxK,...] "
                 "[--ms=1,8,...] [--iters=N] "
                 "[--rounds=N] [--csv=PATH] [--gated] [--accumulate]\n");
    return 2;
  }
  layerserve::kernels::Bench bench(std::move(opt));
  return bench.Run() ? 0 : 1;
}
