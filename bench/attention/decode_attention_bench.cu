// Benchmark of the paged decode attention kernel (LaunchPagedAttention,
// layerserve/kernels/paged_attention.h) on decode steps of Llama-3-8B's
// attention: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16
// tokens. PyTorch's SDPA (flash and cuDNN backends) is the baseline, timed by
// torch_decode.py beside this file on the same points by the same method; it
// reads this program's --csv and prints both side by side.
//
// A point is B sequences with L tokens each already in the cache and
// q_tokens new ones (1: a decode step; more: a speculative step). Layout as
// the server has it: per input set a K and a V pool [blocks][16][8 * 128],
// each sequence's table a run of one shuffled permutation of the pool's
// blocks (so reads are truly paged), and the new tokens' q, k and v as column
// ranges of one fused qkv buffer [tokens, (32 + 2 * 8) * 128]. The plan
// (PlanPagedAttention for this device's SM count) is built and uploaded once
// per point and shared by every input set, as the server shares one plan
// across the layers of a step; building and uploading it is not timed.
//
// Method: inputs filled on the device from a hash (uniform in [-1, 1]). The
// output of input set 0 is checked against a float64 host reference (two
// sequences, all heads, every new token) before timing; a failure skips the
// point's timing and makes the exit status 1. Each timed launch sits between
// its own pair of CUDA events after a warm-up, queued behind a spin kernel
// that holds the stream while the host enqueues them, so the events time the
// kernels and not the host's launch latency (torch_decode.py does the same
// with torch.cuda._sleep). Input sets rotate so that their total is at least
// twice the L2; the median is reported. Bandwidth counts the K and V bytes a
// step must read: B * (L + q_tokens) * 8 * 128 * 2 bytes, for K and for V,
// and is given against the device's copy bandwidth measured at the start of
// the run (bench/layer/device_rates.h: bytes read plus written), the floor
// a step of this many bytes cannot pass.
//
// --kv-cache=fp8 keeps the cache as --kv-cache-dtype=fp8 serves it: e4m3
// codes (random bytes, none NaN) with a float scale per token and KV head
// (uniform in [0.002, 0.02]), laid out as PagedKv's FP8 form; the reference
// reads code * scale, and the bandwidth counts the codes and scales, B * (L
// + q_tokens) * 8 * (128 + 4) bytes for K and for V.
//
// Usage: decode_attention_bench [--points=1x1024,64x4096] [--q-tokens=N]
//          [--csv=PATH] [--iters=N] [--warmup=N] [--kv-cache=auto|fp8]
//          (flags also take "--flag N")
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
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "base/dtype.h"
#include "bench/attention/bench_util.cuh"
#include "bench/layer/device_rates.h"
#include "layerserve/kernels/common.h"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels {
namespace {

using attention_bench::Bf16ToFloat;
using attention_bench::MedianMs;
using attention_bench::MustAllocate;
using attention_bench::RandomBuffer;
using attention_bench::SetsFor;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 16;
constexpr int64_t kQWidth = int64_t{kHeads} * kHeadDim;     // q and out columns
constexpr int64_t kKvWidth = int64_t{kKvHeads} * kHeadDim;  // k or v columns
constexpr int64_t kQkvWidth = kQWidth + 2 * kKvWidth;       // the fused row: q | k | v
constexpr int64_t kBlockElems = int64_t{kBlockTokens} * kKvWidth;
constexpr uint32_t kSeed = 20240611;

template <typename T>
std::unique_ptr<cuda::DeviceBuffer> Upload(const std::vector<T>& host) {
  auto buf = MustAllocate(host.size() * sizeof(T));
  if (!host.empty()) {
    BENCH_CHECK_CUDA(cudaMemcpy(buf->data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return buf;
}

struct Point {
  int batch;    // sequences
  int context;  // tokens already in each sequence's cache
};

// What every input set of a point shares: the packing, the tables, the plan
// and its workspace.
struct Batch {
  int batch = 0, context = 0, q_tokens = 0;
  int64_t tokens = 0, blocks_per_seq = 0;
  std::vector<int32_t> cu_seqlens, start, cu_blocks, block_tables;
  std::unique_ptr<cuda::DeviceBuffer> d_cu_seqlens, d_start, d_cu_blocks, d_block_tables;
  PagedAttentionPlan plan;
  std::unique_ptr<cuda::DeviceBuffer> items, combines, partial_out, partial_lse;
};

Batch MakeBatch(const Point& point, int q_tokens, const DeviceInfo& dev) {
  Batch b;
  b.batch = point.batch;
  b.context = point.context;
  b.q_tokens = q_tokens;
  b.tokens = int64_t{point.batch} * q_tokens;
  // As the server allocates: each table covers the step's own positions too.
  b.blocks_per_seq = (point.context + q_tokens + kBlockTokens - 1) / kBlockTokens;
  std::vector<int32_t> ids(static_cast<size_t>(point.batch * b.blocks_per_seq));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(kSeed));
  b.block_tables = ids;
  std::vector<PagedSequence> seqs;
  b.cu_seqlens = {0};
  b.cu_blocks = {0};
  for (int s = 0; s < point.batch; ++s) {
    b.cu_seqlens.push_back(b.cu_seqlens.back() + q_tokens);
    b.cu_blocks.push_back(static_cast<int32_t>(b.cu_blocks.back() + b.blocks_per_seq));
    b.start.push_back(point.context);
    seqs.push_back({q_tokens, point.context});
  }
  b.d_cu_seqlens = Upload(b.cu_seqlens);
  b.d_start = Upload(b.start);
  b.d_cu_blocks = Upload(b.cu_blocks);
  b.d_block_tables = Upload(b.block_tables);
  const PagedPlanLimits limits = PagedPlanCapacity(b.tokens, point.batch, kHeads, kKvHeads, dev.num_sms);
  absl::StatusOr<PagedAttentionPlan> plan = PlanPagedAttention(seqs, kHeads, kKvHeads, dev.num_sms, limits);
  BENCH_CHECK_OK(plan.status());
  b.plan = *std::move(plan);
  b.items = Upload(b.plan.items);
  b.combines = Upload(b.plan.combines);
  b.partial_out = MustAllocate(static_cast<size_t>(b.plan.partial_rows * kKvWidth) * sizeof(float));
  b.partial_lse = MustAllocate(static_cast<size_t>(b.plan.partial_rows * kKvHeads) * sizeof(float));
  return b;
}

// One input set: a layer's K and V pools (in an FP8 set: the K codes, and
// the V groups of codes and scales), the step's fused qkv rows, the output.
struct InputSet {
  std::unique_ptr<cuda::DeviceBuffer> pool_k, pool_v, qkv, out;
  bool fp8 = false;
};

constexpr int64_t kGroupBytes = 16 * (kHeadDim + 8);  // an FP8 V group: codes, K scales, V scales

// Random e4m3 codes (the bytes of random bf16 values, a NaN code 0x7f /
// 0xff moved to 0x7e / 0xfe), then in each V group's scale slots floats
// uniform in [0.002, 0.02].
__global__ void SanitizeCodes(unsigned char* codes, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if ((codes[i] & 0x7f) == 0x7f) codes[i] ^= 1;
  }
}
__global__ void FillGroupScales(unsigned char* groups, int64_t num_groups) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < num_groups * 32;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    reinterpret_cast<float*>(groups + (i / 32) * kGroupBytes + kHeadDim * 16)[i % 32] =
        0.002f + 0.018f * static_cast<float>(h) / 4294967296.0f;
  }
}

InputSet MakeCodeSet(const Batch& b, uint32_t seed) {
  const int64_t tokens = int64_t{b.batch} * b.blocks_per_seq * kBlockTokens;
  const int64_t k_bytes = tokens * kKvWidth;
  const int64_t num_groups = tokens / 16 * kKvHeads;
  InputSet set;
  set.fp8 = true;
  set.pool_k = RandomBuffer((k_bytes + 1) / 2, seed);
  set.pool_v = RandomBuffer((num_groups * kGroupBytes + 1) / 2, seed + 1);
  set.qkv = RandomBuffer(b.tokens * kQkvWidth, seed + 2);
  set.out = MustAllocate(b.tokens * kQWidth * 2);
  SanitizeCodes<<<1024, 256>>>(static_cast<unsigned char*>(set.pool_k->data()), k_bytes);
  SanitizeCodes<<<1024, 256>>>(static_cast<unsigned char*>(set.pool_v->data()), num_groups * kGroupBytes);
  FillGroupScales<<<1024, 256>>>(static_cast<unsigned char*>(set.pool_v->data()), num_groups);
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  return set;
}

// Random pools and rows; then, as RopeKvAppend does before the attention in a
// served step, each new token's K and V row stored at its cache position.
InputSet MakeSet(const Batch& b, uint32_t seed) {
  const int64_t pool_elems = int64_t{b.batch} * b.blocks_per_seq * kBlockElems;
  InputSet set{RandomBuffer(pool_elems, seed), RandomBuffer(pool_elems, seed + 1),
               RandomBuffer(b.tokens * kQkvWidth, seed + 2), MustAllocate(b.tokens * kQWidth * 2)};
  const auto* qkv = static_cast<const __nv_bfloat16*>(set.qkv->data());
  for (int s = 0; s < b.batch; ++s) {
    for (int i = 0; i < b.q_tokens; ++i) {
      const int pos = b.context + i;
      const int64_t row =
          int64_t{b.block_tables[b.cu_blocks[s] + pos / kBlockTokens]} * kBlockTokens + pos % kBlockTokens;
      const __nv_bfloat16* src = qkv + (b.cu_seqlens[s] + i) * kQkvWidth + kQWidth;
      BENCH_CHECK_CUDA(cudaMemcpy(static_cast<__nv_bfloat16*>(set.pool_k->data()) + row * kKvWidth, src, kKvWidth * 2,
                                  cudaMemcpyDeviceToDevice));
      BENCH_CHECK_CUDA(cudaMemcpy(static_cast<__nv_bfloat16*>(set.pool_v->data()) + row * kKvWidth, src + kKvWidth,
                                  kKvWidth * 2, cudaMemcpyDeviceToDevice));
    }
  }
  return set;
}

PagedAttentionParams Params(const Batch& b, const InputSet& set) {
  const auto* qkv = static_cast<const __nv_bfloat16*>(set.qkv->data());
  PagedAttentionParams p;
  p.q = qkv;
  p.k = qkv + kQWidth;
  p.v = qkv + kQWidth + kKvWidth;
  p.out = set.out->data();
  p.q_row_stride = p.k_row_stride = p.v_row_stride = kQkvWidth;
  p.out_row_stride = kQWidth;
  p.cu_seqlens = static_cast<const int32_t*>(b.d_cu_seqlens->data());
  p.num_seqs = b.batch;
  p.tokens = b.tokens;
  p.cache.k = set.pool_k->data();
  p.cache.v = set.pool_v->data();
  p.cache.fp8 = set.fp8;
  p.cache.num_blocks = int64_t{b.batch} * b.blocks_per_seq;
  p.cache.block_tokens = kBlockTokens;
  p.cache.start = static_cast<const int32_t*>(b.d_start->data());
  p.cache.cu_blocks = static_cast<const int32_t*>(b.d_cu_blocks->data());
  p.cache.block_tables = static_cast<const int32_t*>(b.d_block_tables->data());
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double{kHeadDim}));
  p.dtype = DType::kBF16;
  p.items = static_cast<const PagedWorkItem*>(b.items->data());
  p.num_items = static_cast<int>(b.plan.items.size());
  p.combines = static_cast<const PagedCombineTask*>(b.combines->data());
  p.num_combines = static_cast<int>(b.plan.combines.size());
  p.partial_out = static_cast<float*>(b.partial_out->data());
  p.partial_lse = static_cast<float*>(b.partial_lse->data());
  return p;
}

std::vector<float> ToFloat(const std::vector<uint16_t>& bits) {
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = Bf16ToFloat(bits[i]);
  return f;
}

std::vector<uint16_t> Download(const void* src, int64_t elems) {
  std::vector<uint16_t> host(static_cast<size_t>(elems));
  BENCH_CHECK_CUDA(cudaMemcpy(host.data(), src, elems * 2, cudaMemcpyDeviceToHost));
  return host;
}

// Checks every new token and head of two sequences of `set`'s output against
// float64 attention over the downloaded bf16 inputs: keys 0 .. L-1 read from
// the pools through the sequence's table, keys L .. from the new rows (which
// MakeSet also stored in the pools, where the kernel reads them), causal.
// Returns whether all are within tolerance; `report` names the worst element.
bool Validate(const Batch& b, const InputSet& set, std::string& report) {
  const int L = b.context, nq = b.q_tokens, keys = L + nq;
  const double scale = 1.0 / std::sqrt(double{kHeadDim});
  double worst_ratio = -1, worst_err = 0, worst_ref = 0, worst_got = 0;  // ratio: |err| / tolerance
  std::string worst_at;
  std::vector<int> samples = {0};
  if (b.batch > 1) samples.push_back(b.batch - 1);
  for (const int s : samples) {
    // K and V of the sequence's keys, [keys, kKvWidth]: history, then the new rows.
    std::vector<uint16_t> k_bits(static_cast<size_t>(keys * kKvWidth)), v_bits(k_bits.size());
    for (int64_t blk = 0; !set.fp8 && blk * kBlockTokens < L; ++blk) {
      const int64_t rows = std::min<int64_t>(kBlockTokens, L - blk * kBlockTokens);
      const int64_t src = int64_t{b.block_tables[b.cu_blocks[s] + blk]} * kBlockElems * 2;
      const int64_t dst = blk * kBlockElems;
      BENCH_CHECK_CUDA(cudaMemcpy(&k_bits[dst], static_cast<const char*>(set.pool_k->data()) + src, rows * kKvWidth * 2,
                                  cudaMemcpyDeviceToHost));
      BENCH_CHECK_CUDA(cudaMemcpy(&v_bits[dst], static_cast<const char*>(set.pool_v->data()) + src, rows * kKvWidth * 2,
                                  cudaMemcpyDeviceToHost));
    }
    const auto* qkv_rows = static_cast<const uint16_t*>(set.qkv->data()) + b.cu_seqlens[s] * kQkvWidth;
    const std::vector<float> qkv = ToFloat(Download(qkv_rows, nq * kQkvWidth));
    const std::vector<uint16_t> out =
        Download(static_cast<const uint16_t*>(set.out->data()) + b.cu_seqlens[s] * kQWidth, nq * kQWidth);
    std::vector<float> k = ToFloat(k_bits), v = ToFloat(v_bits);
    if (set.fp8) {
      // Every key from the cache: K rows of codes; V groups of 16 keys per
      // block and KV head (codes transposed in ValueCodeSlot's order, then
      // the K and V scales).
      const int64_t blocks = int64_t{b.batch} * b.blocks_per_seq;
      std::vector<unsigned char> kc(static_cast<size_t>(blocks * kBlockElems));
      std::vector<unsigned char> groups(static_cast<size_t>(blocks * kBlockTokens / 16 * kKvHeads * kGroupBytes));
      BENCH_CHECK_CUDA(cudaMemcpy(kc.data(), set.pool_k->data(), kc.size(), cudaMemcpyDeviceToHost));
      BENCH_CHECK_CUDA(cudaMemcpy(groups.data(), set.pool_v->data(), groups.size(), cudaMemcpyDeviceToHost));
      for (int j = 0; j < keys; ++j) {
        const int64_t blk = b.block_tables[b.cu_blocks[s] + j / kBlockTokens];
        const int slot = j % kBlockTokens;
        const int in_group = slot % 16;
        const int place = 4 * ((in_group & 7) >> 1) + (in_group & 1) + 2 * (in_group >> 3);
        for (int h = 0; h < kKvHeads; ++h) {
          const unsigned char* group =
              &groups[static_cast<size_t>(((blk * kKvHeads + h) * (kBlockTokens / 16) + slot / 16) * kGroupBytes)];
          float ks, vs;
          std::memcpy(&ks, group + kHeadDim * 16 + in_group * 4, 4);
          std::memcpy(&vs, group + kHeadDim * 16 + 64 + in_group * 4, 4);
          for (int e = 0; e < kHeadDim; ++e) {
            k[int64_t{j} * kKvWidth + h * kHeadDim + e] = static_cast<float>(
                double{Fp8E4M3ToFloat(kc[(blk * kBlockTokens + slot) * kKvWidth + h * kHeadDim + e])} * ks);
            v[int64_t{j} * kKvWidth + h * kHeadDim + e] =
                static_cast<float>(double{Fp8E4M3ToFloat(group[e * 16 + place])} * vs);
          }
        }
      }
    } else {
      for (int i = 0; i < nq; ++i) {
        std::copy_n(&qkv[i * kQkvWidth + kQWidth], kKvWidth, &k[(L + i) * kKvWidth]);
        std::copy_n(&qkv[i * kQkvWidth + kQWidth + kKvWidth], kKvWidth, &v[(L + i) * kKvWidth]);
      }
    }
    std::vector<double> score(static_cast<size_t>(keys)), o(kHeadDim);
    for (int i = 0; i < nq; ++i) {
      const int seen = L + i + 1;  // query at position L + i sees keys 0 .. L + i
      for (int h = 0; h < kHeads; ++h) {
        const int kvh = h / (kHeads / kKvHeads);
        const float* q = &qkv[i * kQkvWidth + h * kHeadDim];
        double mx = -INFINITY;
        for (int j = 0; j < seen; ++j) {
          const float* kr = &k[int64_t{j} * kKvWidth + kvh * kHeadDim];
          double dot = 0;
          for (int e = 0; e < kHeadDim; ++e) dot += double{q[e]} * kr[e];
          score[j] = dot * scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (int j = 0; j < seen; ++j) sum += (score[j] = std::exp(score[j] - mx));
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = 0; j < seen; ++j) {
          const float* vr = &v[int64_t{j} * kKvWidth + kvh * kHeadDim];
          const double pj = score[j] / sum;
          for (int e = 0; e < kHeadDim; ++e) o[e] += pj * vr[e];
        }
        for (int e = 0; e < kHeadDim; ++e) {
          const double got = Bf16ToFloat(out[i * kQWidth + h * kHeadDim + e]);
          const double err = std::fabs(got - o[e]);
          // bf16 rounds to 2^-9 relative: allow four such roundings, and an
          // absolute floor for the fp32 sums over up to 32k keys. NaN fails.
          const double ratio = std::isfinite(got) ? err / (0x1p-7 * std::fabs(o[e]) + 2e-3) : INFINITY;
          if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst_err = err;
            worst_ref = o[e];
            worst_got = got;
            worst_at = "seq " + std::to_string(s) + " query " + std::to_string(i) + " head " + std::to_string(h) +
                       " dim " + std::to_string(e);
          }
        }
      }
    }
  }
  const bool ok = worst_ratio <= 1.0;
  char line[256];
  std::snprintf(line, sizeof(line), "check %s: worst at %s: got %.6f, ref %.6f, |err| %.3g (%.2f of the tolerance)",
                ok ? "ok" : "FAILED", worst_at.c_str(), worst_got, worst_ref, worst_err, worst_ratio);
  report = line;
  return ok;
}

// "--name=value" or "--name value"; advances `i` past a separate value.
const char* FlagValue(int argc, char** argv, int& i, const char* name) {
  const size_t n = std::strlen(name);
  if (std::strncmp(argv[i], name, n) != 0) return nullptr;
  if (argv[i][n] == '=') return argv[i] + n + 1;
  if (argv[i][n] == '\0' && i + 1 < argc) return argv[++i];
  return nullptr;
}

int Main(int argc, char** argv) {
  int iters = 100, warmup = 20, q_tokens = 1;
  bool fp8 = false;
  std::string csv_path;
  std::vector<Point> points = {{1, 1024},  {1, 4096},  {1, 16384}, {1, 32768},  {16, 1024},
                               {16, 4096}, {64, 1024}, {64, 4096}, {256, 1024}, {256, 2048}};
  for (int i = 1; i < argc; ++i) {
    const char* v = nullptr;
    if ((v = FlagValue(argc, argv, i, "--iters")) != nullptr) {
      iters = std::atoi(v);
    } else if ((v = FlagValue(argc, argv, i, "--warmup")) != nullptr) {
      warmup = std::atoi(v);
    } else if ((v = FlagValue(argc, argv, i, "--q-tokens")) != nullptr) {
      q_tokens = std::atoi(v);
    } else if ((v = FlagValue(argc, argv, i, "--kv-cache")) != nullptr) {
      if (std::strcmp(v, "fp8") != 0 && std::strcmp(v, "auto") != 0) {
        std::fprintf(stderr, "--kv-cache: auto or fp8, got '%s'\n", v);
        return 2;
      }
      fp8 = std::strcmp(v, "fp8") == 0;
    } else if ((v = FlagValue(argc, argv, i, "--csv")) != nullptr) {
      csv_path = v;
    } else if ((v = FlagValue(argc, argv, i, "--points")) != nullptr) {
      points.clear();
      for (const char* p = v; p != nullptr; p = std::strchr(p, ',')) {
        if (*p == ',') ++p;
        Point point{};
        if (std::sscanf(p, "%dx%d", &point.batch, &point.context) != 2 || point.batch < 1 || point.context < 0) {
          std::fprintf(stderr, "--points: expected BxL[,BxL...], e.g. 1x1024,64x4096; got '%s'\n", v);
          return 2;
        }
        points.push_back(point);
      }
    } else {
      std::fprintf(stderr, "unknown flag or missing value: '%s'\n", argv[i]);
      return 2;
    }
  }
  if (iters < 1 || warmup < 0 || q_tokens < 1) {
    std::fprintf(stderr, "--iters and --q-tokens must be >= 1, --warmup >= 0\n");
    return 2;
  }
  const absl::StatusOr<DeviceInfo> dev = CurrentDeviceInfo();
  BENCH_CHECK_OK(dev.status());
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, dev->ordinal));
  std::printf("device: %s, %d SMs, L2 %d MB, sm_%d%d\n", prop.name, dev->num_sms, dev->l2_bytes >> 20, dev->cc_major,
              dev->cc_minor);
  std::FILE* csv = nullptr;
  if (!csv_path.empty()) {
    csv = std::fopen(csv_path.c_str(), "w");
    if (csv == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", csv_path.c_str());
      return 1;
    }
    std::fprintf(csv, "B,L,q_tokens,us,kv_bytes,tbps,items,combines,of_copy\n");
  }
  absl::StatusOr<double> copy_bytes_per_s = bench::MeasureCopyBytesPerSecond(nullptr);
  BENCH_CHECK_OK(copy_bytes_per_s.status());
  const double copy_tbps = *copy_bytes_per_s / 1e12;
  std::printf("copy bandwidth (this run, read + written): %.2f TB/s\n", copy_tbps);
  std::printf(
      "\npaged decode attention: bf16, %s cache, heads %d, kv heads %d, head_dim %d, blocks of %d, q_tokens %d "
      "(median of %d)\n",
      fp8 ? "fp8" : "bf16", kHeads, kKvHeads, kHeadDim, kBlockTokens, q_tokens, iters);
  std::printf("%5s %6s %3s %10s %10s %7s %7s %6s %8s %5s\n", "B", "L", "q", "us", "KV MB", "TB/s", "of_copy", "items",
              "combines", "sets");
  bool all_ok = true;
  for (const Point& point : points) {
    const Batch b = MakeBatch(point, q_tokens, *dev);
    const double row_bytes = fp8 ? kKvWidth + 4.0 * kKvHeads : kKvWidth * 2.0;  // per token, K or V (and a scale)
    const double kv_bytes = 2.0 * point.batch * (int64_t{point.context} + q_tokens) * row_bytes;
    const size_t set_bytes = static_cast<size_t>(2.0 * point.batch * b.blocks_per_seq * kBlockTokens * row_bytes +
                                                 b.tokens * (kQkvWidth + kQWidth) * 2.0);
    const int sets = SetsFor(set_bytes, static_cast<size_t>(dev->l2_bytes));
    std::vector<InputSet> data;
    for (int i = 0; i < sets; ++i) {
      const uint32_t seed = kSeed + 16 * static_cast<uint32_t>(i);
      data.push_back(fp8 ? MakeCodeSet(b, seed) : MakeSet(b, seed));
    }
    BENCH_CHECK_CUDA(cudaMemset(data[0].out->data(), 0xFF, b.tokens * kQWidth * 2));  // NaN: unwritten fails
    BENCH_CHECK_OK(LaunchPagedAttention(Params(b, data[0]), nullptr));
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    std::string check;
    if (!Validate(b, data[0], check)) {
      std::printf("%5d %6d %3d  not timed\n        %s\n", point.batch, point.context, q_tokens, check.c_str());
      all_ok = false;
      continue;
    }
    std::vector<PagedAttentionParams> params;
    for (const InputSet& set : data) params.push_back(Params(b, set));
    const double ms = MedianMs(
        sets, warmup, iters, [&](int set) { BENCH_CHECK_OK(LaunchPagedAttention(params[set], nullptr)); },
        /*hold_stream=*/true);
    const double us = ms * 1e3, tbps = kv_bytes / (ms * 1e-3) / 1e12, of_copy = tbps / copy_tbps;
    std::printf("%5d %6d %3d %10.1f %10.1f %7.2f %7.2f %6zu %8zu %5d\n        %s\n", point.batch, point.context,
                q_tokens, us, kv_bytes / 1e6, tbps, of_copy, b.plan.items.size(), b.plan.combines.size(), sets,
                check.c_str());
    if (csv != nullptr) {
      std::fprintf(csv, "%d,%d,%d,%.3f,%.0f,%.4f,%zu,%zu,%.3f\n", point.batch, point.context, q_tokens, us, kv_bytes,
                   tbps, b.plan.items.size(), b.plan.combines.size(), of_copy);
      std::fflush(csv);
    }
  }
  if (csv != nullptr) std::fclose(csv);
  if (!all_ok) std::printf("\nVALIDATION FAILED on at least one point (its timing was skipped)\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace layerserve::kernels

int main(int argc, char** argv) { return layerserve::kernels::Main(argc, argv); }
