// Version 4: small-M (decode) GEMM, M <= 64. The work is streaming W once at
// full memory bandwidth; the math is negligible. So the operands swap roles:
// W rows are the wgmma M side (64 per consumer warpgroup, 128 per CTA) and the
// padded tokens the wgmma N side (kMPad = 8..64), computing Cᵀ tiles.
//
// K is split (by default 1, 2 or 4 ways: enough CTAs that every SM streams)
// and each CTA pulls its share of W through a kStages-deep TMA ring; two CTAs
// fit on an SM. The splits of one W tile form a thread
// block cluster: each CTA stages its fp32 Cᵀ tile in its own shared memory,
// and after a cluster barrier CTA r sums slice r of the tile over all the
// cluster's CTAs through distributed shared memory (in split order, so the
// result is deterministic), adds the residual and writes bf16 rows of C. No
// global workspace, no atomics.
//
// Warps 0-7 are the two consumer warpgroups, warp 8 the TMA producer.
//
// Grouped products (a mixture of experts, one group per expert) add a grid
// dimension: blockIdx.y is the group, whose rows of A and C and whose W_g the
// CTA reads; every group is padded to the same kMPad, a bound on any group's
// rows, and groups without rows exit at once.
//
// Launched with programmatic dependent launch (PDL): the producer streams its
// first ring's worth of W, which no kernel writes, before waiting
// (griddepcontrol.wait) for the preceding grid to complete; A, the residual
// and C are touched only after that wait. Each CTA also lets the next kernel
// launch early (griddepcontrol.launch_dependents), so that its CTAs take the
// SMs' free slots and fill their rings with W while this one runs. Without
// PDL both instructions are no-ops and the kernel runs as before.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_sm90.cuh"
#include "kernels/gemm/gemm_sm90_epilogue.cuh"

namespace layerserve::kernels::gemm::v4 {

constexpr int kBlockN = 128;  // W rows per CTA
constexpr int kBlockK = 64;
constexpr int kStages = 4;
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kConsumerWarps = 8;
constexpr int kWBytes = kBlockN * kBlockK * 2;
constexpr int kMaxM = 64;
constexpr int kMaxSplits = kMaxClusterSplits;
// Staged partial tile: fp32 [kMPad tokens][kStagePitch], n contiguous so the
// cluster reduction moves float4s; the pitch (== 4 mod 32 words) keeps the
// fragment-order writes free of bank conflicts.
constexpr int kStagePitch = kBlockN + 4;

template <int kMPad>
struct Layout {
  static constexpr int kActBytes = kMPad * kBlockK * 2;
  static constexpr int kStageBytes = kWBytes + kActBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(kActBytes % 1024 == 0, "token tile must stay 1024-byte aligned (kMPad multiple of 8)");
  static_assert(kMPad * kStagePitch * 4 <= kStages * kStageBytes, "epilogue staging must fit in the ring");
};

// Consumer warpgroups: wgmma over the CTA's k-blocks, then the accumulators
// staged to shared memory as fp32 [kMPad][kStagePitch]. The ring is free
// for that once both warpgroups are past their last wgmma: every copy the
// producer issued has been consumed.
template <int kMPad>
__device__ __forceinline__ void ConsumeAndStage(uint32_t ring, uint32_t full_bar, uint32_t empty_bar, int kb_begin,
                                                int kb_end, float* staged) {
  using L = Layout<kMPad>;
  const int consumer = threadIdx.x / 128;
  const bool signals = threadIdx.x % 32 == 0;
  float acc[kMPad / 2];
#pragma unroll
  for (int i = 0; i < kMPad / 2; ++i) acc[i] = 0.f;
  uint32_t iter = 0;
  for (int kb = kb_begin; kb < kb_end; ++kb, ++iter) {
    const int slot = iter % kStages;
    MbarWait(full_bar + 8 * slot, (iter / kStages) & 1);
    const uint64_t desc_w = SmemDescSw128(ring + slot * L::kStageBytes + consumer * (64 * kBlockK * 2));
    const uint64_t desc_a = SmemDescSw128(ring + slot * L::kStageBytes + kWBytes);
    FenceAccumulators(acc);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) WgmmaBf16M64<kMPad>(acc, desc_w + 2 * kk, desc_a + 2 * kk);
    WgmmaCommit();
    FenceAccumulators(acc);
    WgmmaWait<1>();
    if (iter > 0) {
      __syncwarp();
      if (signals) MbarArrive(empty_bar + 8 * ((iter - 1) % kStages));
    }
  }
  WgmmaWait<0>();
  FenceAccumulators(acc);

  // Accumulator element (row r, col c) of this warpgroup is Cᵀ: tile row
  // (output column) 64 * consumer + r, token c.
  NamedBarrierSync(1, kConsumerThreads);
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const int r_local = consumer * 64 + warp * 16 + lane / 4;
  const int c_base = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < kMPad / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) staged[(8 * j + c_base + e) * kStagePitch + r_local + 8 * h] = acc[4 * j + 2 * h + e];
}

template <int kMPad>
__global__ void __launch_bounds__(kThreads, 2)
    GemmSmallMKernel(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
                     const GemmArgs args) {
#if LS_GEMM_DEVICE_SM90A
  using L = Layout<kMPad>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const uint32_t full_bar = ring + kStages * L::kStageBytes;
  const uint32_t empty_bar = full_bar + kStages * 8;
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();

  // Clusters are (splits, 1, 1): consecutive blocks are the splits of a tile.
  const int tile = blockIdx.x / args.splits;
  const int split = static_cast<int>(cluster.block_rank());
  const int n0 = tile * kBlockN;
  // A grouped product runs group blockIdx.y: its rows of A and C, and W_g
  // (rows g n + n0 onwards of the stacked W). The rows come from the kernel
  // before this one, so a grouped CTA waits for it first and gives up its
  // W prefetch; a group without rows ends here, all its cluster with it,
  // before any barrier, and reads none of W_g.
  GroupRows rows{0, args.m};
  int w_row0 = n0;
  if (args.group_offsets != nullptr) {
    WaitForPrerequisiteGrids();
    const int g = static_cast<int>(blockIdx.y);
    rows.row0 = args.group_offsets[g];
    rows.rows = args.group_offsets[g + 1] - rows.row0;
    if (rows.rows <= 0) return;
    w_row0 += g * args.n;
  }
  const GemmArgs group_args = GroupArgs(args, rows);
  const int num_kb = (args.k + kBlockK - 1) / kBlockK;
  const int kb_begin = static_cast<int>(static_cast<int64_t>(split) * num_kb / args.splits);
  const int kb_end = static_cast<int>(static_cast<int64_t>(split + 1) * num_kb / args.splits);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_bar + 8 * s, 1);
      MbarInit(empty_bar + 8 * s, kConsumerWarps);
    }
    FenceBarrierInit();
  }
  __syncthreads();
  // When the next kernel may launch. For kMPad <= 32 at once: its CTAs wait
  // out this whole kernel with their rings full, which measured fastest (back
  // to back in gemm_bench) on every Llama-3-8B shape at M <= 16 and about
  // even at M = 32. At M = 64 that was 0.9-1.6 us slower on o_proj and down
  // than a launch once this CTA has issued its last load (below); why is not
  // known.
  constexpr bool kLaunchDependentsAtEntry = kMPad <= 32;
  if constexpr (kLaunchDependentsAtEntry) AllowDependentLaunch();

  float* staged = reinterpret_cast<float*>(smem_raw + (ring - SmemAddr(smem_raw)));
  if (threadIdx.x >= kConsumerThreads) {
    if (threadIdx.x == kConsumerThreads) {
      PrefetchTensorMap(&map_w);
      PrefetchTensorMap(&map_a);
      // No kernel writes W, so the ring's first pass takes its W tiles before
      // the wait for the preceding grid, which may still be writing A. Each
      // stage's barrier expects the W and the A bytes from the start.
      const int first_pass = min(kb_end - kb_begin, kStages);
      for (int slot = 0; slot < first_pass; ++slot) {
        const uint32_t bar = full_bar + 8 * slot;
        MbarArriveExpectTx(bar, L::kStageBytes);
        TmaLoad2d(ring + slot * L::kStageBytes, &map_w, bar, (kb_begin + slot) * kBlockK, w_row0);
      }
      WaitForPrerequisiteGrids();
      for (int slot = 0; slot < first_pass; ++slot) {
        TmaLoad2d(ring + slot * L::kStageBytes + kWBytes, &map_a, full_bar + 8 * slot, (kb_begin + slot) * kBlockK,
                  rows.row0);
      }
      for (int iter = first_pass; iter < kb_end - kb_begin; ++iter) {
        const int kb = kb_begin + iter;
        const int slot = iter % kStages;
        MbarWait(empty_bar + 8 * slot, ((iter / kStages) & 1) ^ 1);
        const uint32_t bar = full_bar + 8 * slot;
        const uint32_t dst = ring + slot * L::kStageBytes;
        MbarArriveExpectTx(bar, L::kStageBytes);
        TmaLoad2d(dst, &map_w, bar, kb * kBlockK, w_row0);
        TmaLoad2d(dst + kWBytes, &map_a, bar, kb * kBlockK, rows.row0);
      }
      if constexpr (!kLaunchDependentsAtEntry) AllowDependentLaunch();
    }
    __syncwarp();
  } else {
    ConsumeAndStage<kMPad>(ring, full_bar, empty_bar, kb_begin, kb_end, staged);
  }
  // The epilogue reads the residual and writes C, which the preceding grid
  // may read or write: every thread waits for it (long complete by now; the
  // producer has waited already).
  WaitForPrerequisiteGrids();
  // Every CTA of the cluster has staged its partial tile.
  cluster.sync();

  // This CTA's slice of the tile's [m][128] output block, in groups of four
  // columns: group g is token g / 32, columns n0 + 4 * (g % 32) + 0..3. Each
  // thread loads its group from every CTA of the cluster at once (all loads
  // in flight together), sums in rank order, and writes 8 bytes of C. With
  // silu_mul a group is four gate columns and the four up columns 8 further
  // (the interleaved blocks of 8), giving four outputs: 16 groups per token.
  const int per_token = args.silu_mul ? kBlockN / 8 : kBlockN / 4;
  const int groups = group_args.m * per_token;
  const int chunk = (groups + args.splits - 1) / args.splits;
  const int end = min(groups, (split + 1) * chunk);
  for (int g = split * chunk + static_cast<int>(threadIdx.x); g < end; g += kThreads) {
    const int m = g / per_token;
    const int q = g % per_token;
    const int r = args.silu_mul ? 16 * (q / 2) + 4 * (q % 2) : 4 * q;
    if (n0 + r >= args.n) continue;  // n % 8 == 0 (16 with silu_mul): the group is all in or all out
    float4 sum = SumOverCluster(cluster, staged, m * kStagePitch + r, args.splits);
    int64_t offset;
    if (args.silu_mul) {
      const float4 up = SumOverCluster(cluster, staged, m * kStagePitch + r + 8, args.splits);
      sum = make_float4(SiluMulOne(sum.x, up.x), SiluMulOne(sum.y, up.y), SiluMulOne(sum.z, up.z),
                        SiluMulOne(sum.w, up.w));
      offset = static_cast<int64_t>(m) * args.ldc + n0 / 2 + 8 * (q / 2) + 4 * (q % 2);
    } else {
      offset = static_cast<int64_t>(m) * args.n + n0 + r;
      if (group_args.residual != nullptr) {
        const uint2 bits = *reinterpret_cast<const uint2*>(group_args.residual + offset);
        const float2 r01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
        const float2 r23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
        sum.x += r01.x;
        sum.y += r01.y;
        sum.z += r23.x;
        sum.w += r23.y;
      }
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(sum.z, sum.w);
    uint2 out;
    out.x = *reinterpret_cast<const uint32_t*>(&lo);
    out.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(group_args.c + offset) = out;
  }
  // Peers may still be reading this CTA's shared memory.
  cluster.sync();
#endif
}

}  // namespace layerserve::kernels::gemm::v4
