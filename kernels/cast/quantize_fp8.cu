// Activation quantization to float8_e4m3fn (LaunchQuantizeFp8, layer_ops.h):
// the input of every FP8 product. Two shapes of the same computation:
//  - per 128-column group: one warp per (row, group), four elements a lane,
//    the group's amax by shuffles; scales written token-contiguous per group;
//  - per row: a cluster of up to 8 256-thread CTAs per row, each thread
//    holding its (at most 32) elements in registers, the row's amax reduced
//    through the CTAs' shared memory across the cluster, so the row is read
//    once and its latency is about one load's, where one CTA a row looped
//    over it twice (14 loads a thread each pass for a down input of 14 336
//    columns), while the FP8 GEMM after it waits; or no amax at all with a
//    static scale. Rows wider than the cluster holds (over 65 536 columns)
//    take one CTA a row in two passes, the second from L1/L2.
// The conversion is kernels/common/e4m3.cuh's (x / s correctly rounded,
// then cvt.rn.satfinite.e4m3x2), as the CPU reference quantizes.
// Launched as a programmatic dependent (kernels/common/pdl.cuh) that lets
// the FP8 GEMM after it launch at once: the GEMM streams its first weights
// while this runs, and waits for the codes.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "kernels/common/e4m3.cuh"
#include "kernels/common/pdl.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

constexpr int kRowThreads = 256;
constexpr int kGroupWarpsPerBlock = 8;
// The cluster form: at most 8 CTAs a row (the portable cluster size), each
// thread at most kMaxVectors vectors of 8 elements.
constexpr int kMaxClusterCtas = 8;
constexpr int kMaxVectors = 4;

// Eight bf16 (16 bytes) as floats.
__device__ __forceinline__ void Load8(const __nv_bfloat16* x, float (&v)[8]) {
  const uint4 bits = *reinterpret_cast<const uint4*>(x);
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void Load4(const __nv_bfloat16* x, float (&v)[4]) {
  const uint2 bits = *reinterpret_cast<const uint2*>(x);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
  v[0] = a.x;
  v[1] = a.y;
  v[2] = b.x;
  v[3] = b.y;
}

// Group of 128 columns: lane l holds columns 4l..4l+3 of the group.
__global__ void QuantizeGroupsKernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ codes,
                                     float* __restrict__ scales, int64_t rows, int64_t cols, int64_t groups) {
  AllowDependentLaunch();
  WaitForPrerequisiteGrids();  // x is complete, and the codes' last reader done
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kGroupWarpsPerBlock + threadIdx.x / 32;
  if (item >= rows * groups) return;
  const int64_t row = item / groups;
  const int64_t group = item % groups;
  const int lane = threadIdx.x % 32;
  const int64_t col = group * 128 + 4 * lane;
  const bool in = col < cols;  // cols % 16 == 0: a lane's four are all in or all out
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (in) Load4(x + row * cols + col, v);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float s = amax / kE4m3MaxValue;
  uint32_t word[1];
  E4m3Scale(s, true).Codes(v, word);
  if (in) *reinterpret_cast<uint32_t*>(codes + row * cols + col) = word[0];
  if (lane == 0) scales[group * rows + row] = s;
}

// One row per cluster (blockIdx.y); the CTA of rank r holds, in thread t,
// the vectors j * ranks + r of 256 (vector v: columns 8v..8v+7), so the
// CTAs of a row take its columns in turn.
template <int kVectors>
__global__ void __launch_bounds__(kRowThreads)
    QuantizeRowsInClusterKernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ codes,
                                float* __restrict__ scales, int64_t cols, float static_scale) {
  namespace cg = cooperative_groups;
  AllowDependentLaunch();
  WaitForPrerequisiteGrids();  // x is complete, and the codes' last reader done
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const unsigned ranks = cluster.num_blocks();
  const int64_t row = blockIdx.y;
  const __nv_bfloat16* in = x + row * cols;
  uint8_t* out = codes + row * cols;
  float v[kVectors][8];
  int64_t col[kVectors];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    col[j] = ((static_cast<int64_t>(j) * ranks + rank) * kRowThreads + threadIdx.x) * 8;
    if (col[j] < cols) {  // cols % 16 == 0: a vector is all in or all out
      Load8(in + col[j], v[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
    }
  }
  __shared__ float warp_amax[kRowThreads / 32];
  __shared__ float cta_amax;
  float s = static_scale;
  if (!(s > 0.f)) {  // uniform over the grid: every CTA reaches the cluster barriers or none does
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = warp_amax[0];
#pragma unroll
      for (int w = 1; w < kRowThreads / 32; ++w) m = fmaxf(m, warp_amax[w]);
      cta_amax = m;
    }
    cluster.sync();  // every CTA's amax written and visible across the cluster
    amax = 0.f;
    for (unsigned r = 0; r < ranks; ++r) amax = fmaxf(amax, *cluster.map_shared_rank(&cta_amax, r));
    // No CTA may leave (and free its shared memory) while another still
    // reads it: arrive now, wait after the stores.
    cluster.barrier_arrive();
    s = amax / kE4m3MaxValue;
  }
  const E4m3Scale scale(s, !(static_scale > 0.f));
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    if (col[j] < cols) {
      uint32_t words[2];
      scale.Codes(v[j], words);
      *reinterpret_cast<uint2*>(out + col[j]) = make_uint2(words[0], words[1]);
    }
  }
  if (rank == 0 && threadIdx.x == 0) scales[row] = s;
  if (!(static_scale > 0.f)) cluster.barrier_wait();
}

// Rows wider than a cluster holds: one CTA a row, two passes.
__global__ void QuantizeRowsKernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ codes,
                                   float* __restrict__ scales, int64_t cols, float static_scale) {
  AllowDependentLaunch();
  WaitForPrerequisiteGrids();  // x is complete, and the codes' last reader done
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* in = x + row * cols;
  uint8_t* out = codes + row * cols;
  __shared__ float warp_amax[kRowThreads / 32];
  float s = static_scale;
  if (!(s > 0.f)) {
    float amax = 0.f;
    for (int64_t c = 4 * static_cast<int64_t>(threadIdx.x); c < cols; c += 4 * kRowThreads) {
      float v[4];
      Load4(in + c, v);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = warp_amax[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
    s = amax / kE4m3MaxValue;
  }
  const E4m3Scale scale(s, !(static_scale > 0.f));
  for (int64_t c = 4 * static_cast<int64_t>(threadIdx.x); c < cols; c += 4 * kRowThreads) {
    float v[4];
    Load4(in + c, v);
    uint32_t word[1];
    scale.Codes(v, word);
    *reinterpret_cast<uint32_t*>(out + c) = word[0];
  }
  if (threadIdx.x == 0) scales[row] = s;
}

// How the cluster form takes a row of `cols`: `ctas` CTAs of 256 threads,
// each thread `vectors` vectors of 8 (0: wider than a cluster holds). E.g.
// 4 096 columns (the o input of Llama-3-8B): 512 vectors, 1 CTA, 2 a
// thread; 14 336 (its down input): 1 792 vectors, 4 CTAs, 2 a thread;
// 28 672 (Llama-3-70B's): 7 CTAs, 2 a thread; 65 536: 8 CTAs, 4 a thread.
struct RowPlan {
  int ctas = 0;
  int vectors = 0;
};
RowPlan PlanRows(int64_t cols) {
  const int64_t vectors = (cols + 7) / 8;
  // About two vectors a thread: the fewest CTAs whose loads are all in
  // flight at once, so a decode step's row costs one load's latency.
  const int64_t ctas = std::clamp<int64_t>((vectors + 2 * kRowThreads - 1) / (2 * kRowThreads), 1, kMaxClusterCtas);
  const int64_t per_thread = (vectors + ctas * kRowThreads - 1) / (ctas * kRowThreads);
  if (per_thread > kMaxVectors) return RowPlan{};
  return RowPlan{.ctas = static_cast<int>(ctas), .vectors = per_thread == 1 ? 1 : per_thread == 2 ? 2 : kMaxVectors};
}

absl::Status LaunchRowsInOneCta(const QuantizeFp8Params& p, cudaStream_t stream) {
  if (p.rows >= (int64_t{1} << 31)) return absl::InvalidArgumentError("quantize_fp8: too many rows");
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(QuantizeRowsKernel, dim3(static_cast<unsigned>(p.rows)), dim3(kRowThreads), 0,
                                          stream, static_cast<const __nv_bfloat16*>(p.x),
                                          static_cast<uint8_t*>(p.codes), p.scales, p.cols, p.static_scale));
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchQuantizeFp8(const QuantizeFp8Params& p, cudaStream_t stream) {
  if (p.x == nullptr || p.codes == nullptr || p.scales == nullptr) {
    return absl::InvalidArgumentError("quantize_fp8: null pointer");
  }
  if (p.rows < 0 || p.cols < 16 || p.cols % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize_fp8: cols must be a positive multiple of 16, got ", p.cols));
  }
  if (p.group != 0 && p.group != 128) {
    return absl::InvalidArgumentError(absl::StrCat("quantize_fp8: group must be 0 or 128, got ", p.group));
  }
  if (p.group != 0 && p.static_scale > 0.f) {
    return absl::InvalidArgumentError("quantize_fp8: a static scale is per row (group 0)");
  }
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0 || reinterpret_cast<uintptr_t>(p.codes) % 16 != 0) {
    return absl::InvalidArgumentError("quantize_fp8: x and codes must be 16-byte aligned");
  }
  if (p.rows == 0) return absl::OkStatus();
  const auto* x = static_cast<const __nv_bfloat16*>(p.x);
  auto* codes = static_cast<uint8_t*>(p.codes);
  if (p.group == 0) {
    if (p.rows >= 65536) return LaunchRowsInOneCta(p, stream);  // the grid's y extent
    const RowPlan plan = PlanRows(p.cols);
    if (plan.vectors == 0) return LaunchRowsInOneCta(p, stream);
    const dim3 grid(static_cast<unsigned>(plan.ctas), static_cast<unsigned>(p.rows));
    const auto launch = [&](auto kernel) {
      return LaunchDependentInClusters(kernel, grid, dim3(kRowThreads), 0, static_cast<unsigned>(plan.ctas), stream, x,
                                       codes, p.scales, p.cols, p.static_scale);
    };
    switch (plan.vectors) {
      case 1:
        LS_CUDA_RETURN_IF_ERROR(launch(QuantizeRowsInClusterKernel<1>));
        break;
      case 2:
        LS_CUDA_RETURN_IF_ERROR(launch(QuantizeRowsInClusterKernel<2>));
        break;
      default:
        LS_CUDA_RETURN_IF_ERROR(launch(QuantizeRowsInClusterKernel<kMaxVectors>));
        break;
    }
    return absl::OkStatus();
  }
  const int64_t groups = (p.cols + p.group - 1) / p.group;
  const int64_t blocks = (p.rows * groups + kGroupWarpsPerBlock - 1) / kGroupWarpsPerBlock;
  if (blocks >= (int64_t{1} << 31)) return absl::InvalidArgumentError("quantize_fp8: too many rows");
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(QuantizeGroupsKernel, dim3(static_cast<unsigned>(blocks)),
                                          dim3(32 * kGroupWarpsPerBlock), 0, stream, x, codes, p.scales, p.rows, p.cols,
                                          groups));
  return absl::OkStatus();
}

}  // namespace layerserve::kernels
