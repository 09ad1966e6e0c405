// Benchmark of the built flash-attention versions (and, briefly, the RMSNorm, RoPE
// and SiLU-gate kernels) on the device; PyTorch is version 0, measured by
// torch_sdpa.py beside this file with the same shapes and method.
//
// Method: inputs filled on the device from a hash (uniform in [-1, 1]);
// every version is validated against a float64 host reference on sampled
// rows before it is timed; each timed launch sits between its own pair of
// CUDA events after a warm-up; input sets rotate so that no launch finds its
// operands in L2 from the previous one; the median is reported.
// Attention FLOPs: 4 * head_dim * heads per (query, visible key) pair, taken
// as len^2 / 2 pairs per causal sequence, and with --window W as W^2 / 2 +
// (len - W) * W: the figure counts only the work a window leaves, so its
// TFLOP/s compare with the causal ones, and the time shows what the skipped
// key tiles save.
// Shapes marked "qkv" read q, k and v from one fused [tokens, (heads +
// 2 kv_heads) * head_dim] buffer, as the served layer does; the others from
// three packed buffers. The sm80 fast path (v6) and v8 are also timed with
// all heads in one section where their default section is smaller.
//
// Versions a problem cannot run (v8: head_dim 128, bf16 and Hopper only) are
// listed as skipped with the reason.
//
// Usage: flash_attention_bench [--iters N] [--warmup N] [--versions 6,8] [--window W]
// (--window: sliding-window attention, FlashAttentionParams::window; 0, the
// default, is plain causal attention.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "bench/attention/bench_util.cuh"
#include "kernels/attention/flash_attention_versions.h"
#include "layerserve/kernels/attention.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

using attention_bench::Bf16ToFloat;
using attention_bench::MedianMs;
using attention_bench::MustAllocate;
using attention_bench::RandomBuffer;
using attention_bench::SetsFor;

struct Shape {
  const char* name;
  std::vector<int> seqlens;
  bool fused_qkv = false;
};

constexpr int kHeads = 32, kKvHeads = 8;

// One input set: q, k, v as three packed buffers, or as column ranges of one
// fused qkv buffer (then `q` holds it and `k`, `v` are null).
struct AttnSet {
  std::unique_ptr<cuda::DeviceBuffer> q, k, v, out;
  const void* q_ptr = nullptr;
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  int64_t q_stride = 0, kv_stride = 0;
};

AttnSet MakeSet(bool fused_qkv, int64_t tokens, int head_dim, uint32_t seed) {
  AttnSet set;
  const int64_t qw = int64_t{kHeads} * head_dim, kw = int64_t{kKvHeads} * head_dim;
  if (fused_qkv) {
    set.q = RandomBuffer(tokens * (qw + 2 * kw), seed);
    const auto* base = static_cast<const __nv_bfloat16*>(set.q->data());
    set.q_ptr = base;
    set.k_ptr = base + qw;
    set.v_ptr = base + qw + kw;
    set.q_stride = set.kv_stride = qw + 2 * kw;
  } else {
    set.q = RandomBuffer(tokens * qw, seed);
    set.k = RandomBuffer(tokens * kw, seed + 1);
    set.v = RandomBuffer(tokens * kw, seed + 2);
    set.q_ptr = set.q->data();
    set.k_ptr = set.k->data();
    set.v_ptr = set.v->data();
    set.q_stride = qw;
    set.kv_stride = kw;
  }
  set.out = MustAllocate(tokens * qw * 2);
  return set;
}

// Copies rows of `width` elements, `stride` apart on the device, to a packed host array.
std::vector<uint16_t> DownloadRows(const void* src, int64_t rows, int64_t width, int64_t stride) {
  std::vector<uint16_t> host(rows * width);
  BENCH_CHECK_CUDA(cudaMemcpy2D(host.data(), width * 2, src, stride * 2, width * 2, rows, cudaMemcpyDeviceToHost));
  return host;
}

// Checks sampled (token, head) rows of set 0's output against float64, each
// row over the keys its window (0: none) lets it see.
bool Validate(const Shape& shape, const std::vector<int32_t>& cu, const AttnSet& set, int64_t tokens, int head_dim,
              int window) {
  const int64_t qw = int64_t{kHeads} * head_dim, kw = int64_t{kKvHeads} * head_dim;
  const std::vector<uint16_t> q = DownloadRows(set.q_ptr, tokens, qw, set.q_stride);
  const std::vector<uint16_t> k = DownloadRows(set.k_ptr, tokens, kw, set.kv_stride);
  const std::vector<uint16_t> v = DownloadRows(set.v_ptr, tokens, kw, set.kv_stride);
  const std::vector<uint16_t> out = DownloadRows(set.out->data(), tokens, qw, qw);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  double worst = 0;
  for (int sample = 0; sample < 48; ++sample) {
    const int s = sample % static_cast<int>(shape.seqlens.size());
    const int len = shape.seqlens[s];
    const int row = static_cast<int>((static_cast<int64_t>(sample) * 7919 + len - 1) % len);
    const int h = (sample * 13) % kHeads;
    const int kvh = h / (kHeads / kKvHeads);
    const int64_t t = cu[s] + row;
    const int first = window > 0 ? std::max(0, row - window + 1) : 0;  // the oldest key row sees
    std::vector<double> score(row + 1 - first);
    double mx = -INFINITY;
    for (int j = first; j <= row; ++j) {
      double dot = 0;
      for (int e = 0; e < head_dim; ++e)
        dot +=
            double{Bf16ToFloat(q[t * qw + h * head_dim + e])} * Bf16ToFloat(k[(cu[s] + j) * kw + kvh * head_dim + e]);
      score[j - first] = dot * scale;
      mx = std::max(mx, score[j - first]);
    }
    double sum = 0;
    for (double& x : score) sum += (x = std::exp(x - mx));
    for (int e = 0; e < head_dim; ++e) {
      double o = 0;
      for (int j = first; j <= row; ++j)
        o += score[j - first] / sum * Bf16ToFloat(v[(cu[s] + j) * kw + kvh * head_dim + e]);
      const double got = Bf16ToFloat(out[t * qw + h * head_dim + e]);
      const double err = std::isfinite(got) ? std::fabs(got - o) : INFINITY;
      worst = std::max(worst, err);
    }
  }
  // bf16 output rounding of values below 1 is < 2^-9; allow a few of those.
  const bool ok = worst < 1e-2;
  if (!ok) std::printf("  VALIDATION FAILED: max |err| %.3g on sampled rows\n", worst);
  return ok;
}

void BenchAttention(int head_dim, const std::vector<Shape>& shapes, const std::vector<int>& versions, int warmup,
                    int iters, int window, const DeviceInfo& dev) {
  const size_t l2_bytes = static_cast<size_t>(dev.l2_bytes);
  const std::string kind = window > 0 ? "causal, window " + std::to_string(window) : std::string("causal");
  std::printf("\nflash attention fwd: %s, bf16, heads %d, kv heads %d, head_dim %d (median of %d)\n", kind.c_str(),
              kHeads, kKvHeads, head_dim, iters);
  std::printf("%-10s %6s  %-48s %9s %9s\n", "shape", "tokens", "version", "ms", "TFLOP/s");
  for (const Shape& shape : shapes) {
    std::vector<int32_t> cu = {0};
    double flops = 0;
    for (int len : shape.seqlens) {
      cu.push_back(cu.back() + len);
      // (query, key) pairs as the causal count has always taken them, len^2 / 2:
      // the first w rows are a causal triangle, the rest see w keys each.
      const double w = window > 0 ? std::min(window, len) : len;
      const double pairs = w * w / 2 + (len - w) * w;
      flops += 4.0 * pairs * head_dim * kHeads;
    }
    const int64_t tokens = cu.back();
    const int max_len = *std::max_element(shape.seqlens.begin(), shape.seqlens.end());
    const auto d_cu = MustAllocate(cu.size() * sizeof(int32_t));
    BENCH_CHECK_CUDA(cudaMemcpy(d_cu->data(), cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    const size_t set_bytes = tokens * (2 * kHeads + 2 * kKvHeads) * head_dim * 2;
    const int sets = SetsFor(set_bytes, l2_bytes);
    std::vector<AttnSet> data;
    for (int i = 0; i < sets; ++i) data.push_back(MakeSet(shape.fused_qkv, tokens, head_dim, 100 + 3 * i));
    auto params = [&](int set) {
      FlashAttentionParams p;
      p.q = data[set].q_ptr;
      p.k = data[set].k_ptr;
      p.v = data[set].v_ptr;
      p.out = data[set].out->data();
      p.q_row_stride = data[set].q_stride;
      p.k_row_stride = p.v_row_stride = data[set].kv_stride;
      p.out_row_stride = int64_t{kHeads} * head_dim;
      p.cu_seqlens = static_cast<const int32_t*>(d_cu->data());
      p.num_seqs = static_cast<int>(shape.seqlens.size());
      p.max_seqlen = max_len;
      p.num_heads = kHeads;
      p.num_kv_heads = kKvHeads;
      p.head_dim = head_dim;
      p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      p.window = window;
      p.dtype = DType::kBF16;
      return p;
    };
    const int default_version = DefaultFlashAttentionVersion(params(0), dev);
    struct Run {
      int version;
      int heads_per_section;  // 0: the launcher's choice
    };
    std::vector<Run> runs;
    for (int version : versions) runs.push_back({version, 0});
    if (FlashHeadsPerSection(params(0), static_cast<int64_t>(l2_bytes)) < kHeads) {
      for (int version : versions)
        if (version == 6 || version == 8) runs.push_back({version, kHeads});
    }
    for (const Run& run : runs) {
      if (const absl::Status available = FlashAttentionVersionAvailable(params(0), run.version, dev); !available.ok()) {
        if (run.heads_per_section == 0) {
          std::printf("%-10s %6lld  %-48s skipped: %s\n", shape.name, static_cast<long long>(tokens),
                      FlashAttentionVersionName(run.version), std::string(available.message()).c_str());
        }
        continue;
      }
      BENCH_CHECK_CUDA(cudaMemset(data[0].out->data(), 0xFF, tokens * kHeads * head_dim * 2));
      BENCH_CHECK_OK(LaunchFlashAttentionVersion(params(0), run.version, dev, nullptr, run.heads_per_section));
      BENCH_CHECK_CUDA(cudaDeviceSynchronize());
      if (!Validate(shape, cu, data[0], tokens, head_dim, window)) continue;
      const double ms = MedianMs(sets, warmup, iters, [&](int set) {
        BENCH_CHECK_OK(LaunchFlashAttentionVersion(params(set), run.version, dev, nullptr, run.heads_per_section));
      });
      const std::string name =
          std::string(FlashAttentionVersionName(run.version)) + (run.heads_per_section > 0 ? ", 1 section" : "");
      std::printf("%-10s %6lld  %-48s %9.3f %9.1f%s\n", shape.name, static_cast<long long>(tokens), name.c_str(), ms,
                  flops / (ms * 1e-3) / 1e12,
                  run.version == default_version && run.heads_per_section == 0 ? "  (default)" : "");
    }
  }
}

// Memory-bound kernels: GB/s counting each byte read or written once.
void BenchLayerOps(int warmup, int iters, size_t l2_bytes) {
  std::printf("\nlayer ops, bf16 (median of %d): GB/s counts each tensor byte read or written once\n", iters);
  std::printf("%-34s %9s %9s\n", "op", "us", "GB/s");
  auto report = [](const char* name, double ms, double bytes) {
    std::printf("%-34s %9.1f %9.0f\n", name, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
  };
  const int64_t tokens = 8192;
  {
    const int64_t cols = 4096;
    const double bytes = 4.0 * tokens * cols * 2 + cols * 2;
    const int sets = SetsFor(static_cast<size_t>(bytes), l2_bytes);
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> x, r, h, y;
    for (int i = 0; i < sets; ++i) {
      x.push_back(RandomBuffer(tokens * cols, 200 + i));
      r.push_back(RandomBuffer(tokens * cols, 300 + i));
      h.push_back(MustAllocate(tokens * cols * 2));
      y.push_back(MustAllocate(tokens * cols * 2));
    }
    auto w = RandomBuffer(cols, 400);
    const double ms = MedianMs(sets, warmup, iters, [&](int s) {
      RmsNormParams p;
      p.x = x[s]->data();
      p.residual = r[s]->data();
      p.h_out = h[s]->data();
      p.weight = w->data();
      p.y = y[s]->data();
      p.rows = tokens;
      p.cols = cols;
      BENCH_CHECK_OK(LaunchRmsNorm(p, nullptr));
    });
    report("rms_norm+residual 8192x4096", ms, bytes);
  }
  {
    const int heads = 32, kv_heads = 8, head_dim = 128;
    const int64_t width = int64_t{heads + 2 * kv_heads} * head_dim;
    const double bytes = 2.0 * tokens * (heads + kv_heads) * head_dim * 2;
    const int sets = SetsFor(static_cast<size_t>(tokens * width * 2), l2_bytes);
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> qkv;
    for (int i = 0; i < sets; ++i) qkv.push_back(RandomBuffer(tokens * width, 500 + i));
    std::vector<int32_t> pos(tokens);
    for (int64_t t = 0; t < tokens; ++t) pos[t] = static_cast<int32_t>(t);
    std::vector<float> inv_freq(head_dim / 2);
    for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / head_dim));
    const auto d_pos = MustAllocate(tokens * 4);
    const auto d_freq = MustAllocate(head_dim * 2);
    BENCH_CHECK_CUDA(cudaMemcpy(d_pos->data(), pos.data(), tokens * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK_CUDA(cudaMemcpy(d_freq->data(), inv_freq.data(), head_dim * 2, cudaMemcpyHostToDevice));
    const double ms = MedianMs(sets, warmup, iters, [&](int s) {
      RopeParams p;
      p.qkv = qkv[s]->data();
      p.positions = static_cast<const int32_t*>(d_pos->data());
      p.inv_freq = static_cast<const float*>(d_freq->data());
      p.tokens = tokens;
      p.num_heads = heads;
      p.num_kv_heads = kv_heads;
      p.head_dim = head_dim;
      BENCH_CHECK_OK(LaunchRope(p, nullptr));
    });
    report("rope q,k 8192 tok, 32+8 heads x128", ms, bytes);
  }
  {
    const int64_t width = 14336;
    const double bytes = 3.0 * tokens * width * 2;
    const int sets = SetsFor(static_cast<size_t>(bytes), l2_bytes);
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> in, out;
    for (int i = 0; i < sets; ++i) {
      in.push_back(RandomBuffer(tokens * 2 * width, 600 + i));
      out.push_back(MustAllocate(tokens * width * 2));
    }
    const double ms = MedianMs(sets, warmup, iters, [&](int s) {
      SiluMulParams p;
      p.gate_up = in[s]->data();
      p.out = out[s]->data();
      p.rows = tokens;
      p.width = width;
      BENCH_CHECK_OK(LaunchSiluMul(p, nullptr));
    });
    report("silu_mul 8192x14336", ms, bytes);
  }
}

int Main(int argc, char** argv) {
  int iters = 50, warmup = 10, window = 0;
  std::vector<int> versions;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--warmup") == 0) warmup = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--window") == 0) window = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--versions") == 0) {
      for (const char* v = argv[i + 1]; v != nullptr; v = std::strchr(v, ',')) {
        if (*v == ',') ++v;
        const int version = std::atoi(v);
        if (std::find(std::begin(kFlashAttentionVersions), std::end(kFlashAttentionVersions), version) ==
            std::end(kFlashAttentionVersions)) {
          std::string built;
          for (int b : kFlashAttentionVersions) built += (built.empty() ? "" : ", ") + std::to_string(b);
          std::fprintf(stderr, "--versions: version %d is not built (built: %s)\n", version, built.c_str());
          return 1;
        }
        versions.push_back(version);
      }
    }
  }
  if (versions.empty()) {
    versions.assign(std::begin(kFlashAttentionVersions), std::end(kFlashAttentionVersions));
  }
  int device = 0;
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDevice(&device));
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device: %s, %d SMs, L2 %d MB, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              prop.major, prop.minor);
  const std::vector<Shape> shapes = {
      {"1x2048", {2048}},
      {"4x512", {512, 512, 512, 512}},
      {"1x4096", {4096}},
      {"4x1024", {1024, 1024, 1024, 1024}},
      {"1x8192", {8192}},
      {"8x1024", std::vector<int>(8, 1024)},
      {"mix8k", {4096, 2048, 1024, 512, 512}},
      {"1x4096qkv", {4096}, /*fused_qkv=*/true},
      {"1x8192qkv", {8192}, /*fused_qkv=*/true},
      // K/V of 64 MiB: the first length whose default splits the heads into sections.
      {"1x16384", {16384}},
  };
  const absl::StatusOr<DeviceInfo> dev = QueryDeviceInfo(device);
  BENCH_CHECK_OK(dev.status());
  BenchAttention(128, shapes, versions, warmup, iters, window, *dev);
  BenchAttention(64, {shapes[0], shapes[2], shapes[4], shapes[5]}, versions, warmup, iters, window, *dev);
  // Short sequences, as the server batches them: one-token requests (28 and
  // 97 were the mean batches at concurrency 64 and 256 on the H100), and
  // short prompts up to v9's limit, from the fused qkv buffer.
  const std::vector<Shape> short_shapes = {
      {"1x1", {1}, true},
      {"28x1", std::vector<int>(28, 1), true},
      {"97x1", std::vector<int>(97, 1), true},
      {"256x1", std::vector<int>(256, 1), true},
      {"16x8", std::vector<int>(16, 8), true},
      {"8x32", std::vector<int>(8, 32), true},
  };
  BenchAttention(128, short_shapes, versions, warmup, iters, window, *dev);
  BenchLayerOps(warmup, iters, prop.l2CacheSize);
  return 0;
}

}  // namespace
}  // namespace layerserve::kernels

int main(int argc, char** argv) { return layerserve::kernels::Main(argc, argv); }
