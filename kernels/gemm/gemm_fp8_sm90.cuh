// Version 6's decode kernel (M <= 64): the FP8 (W8A8) GEMM, y = A·Wᵀ with A
// and W float8_e4m3fn codes and fp32 scales per row (Fp8Scaling::kPerRow) or
// per 128-wide K block (kBlock), bf16 out. Built as version 4 is: W rows are
// the wgmma M side (64 per consumer warpgroup, 128 per CTA) and the kTokN
// tokens (8..64, M padded up) the wgmma N side, computing Cᵀ tiles. The work
// is streaming W once, at half the bytes of bf16, and K is split over a
// thread block cluster whose CTAs sum their staged fp32 tiles through
// distributed shared memory in rank order (deterministic; no workspace, no
// atomics). Above 64 tokens gemm_fp8_prefill_sm90.cuh takes over.
//
// Each 128-byte swizzled shared-memory row holds one 128-wide K block: the
// wgmma e4m3 instruction takes K = 32, so a K block is four instructions
// into a fresh fp32 partial sum that is then promoted into the accumulator
// (FP8.md: the tensor cores do not keep a full fp32 sum of FP8 products).
// With block scales that promotion is where the scales apply: partial ·
// w_scale[this warpgroup's 64 rows, kb] · a_scale[kb, token]. With per-row
// scales the promotion is a plain add and both scales apply in the epilogue.
//
// Warps 0-7 are the two consumer warpgroups, warp 8 the TMA producer; the
// ring goes through TmaPipeline (kernels/common/pipeline_sm90.cuh). The
// epilogue stages the fp32 tile in the ring's shared memory ([token][W row],
// W rows contiguous) and writes bf16 rows of C: with the bias (fp32, before
// the one rounding) and the residual added, or,
// for the gated MLP (silu_mul), silu(gate) * up of W rows r and r + 64 (the
// kFp8GateUpBlock interleave), which never leave the CTA.
//
// Programmatic dependent launch as version 4: the producer streams its first
// ring's worth of W (written once, at load) before waiting for the preceding
// grid; A, the scales of A, the residual and C only after.
//
// Grouped products (a mixture of experts): blockIdx.y is a slot, the
// slot-th (group, token tile) pair of the groups that have rows, in group
// order, so that a group may hold more rows than one tile, and a group
// without rows costs no CTA (at one token 8 of Qwen3-MoE's 128 experts have
// rows: a grid row per group launched 16x the CTAs, and the empty ones cost
// more than the expert GEMMs' weight reads). The rows come from the kernel
// before (the routing), so a grouped CTA waits for it first and gives up its
// W prefetch; its first warp finds the slot's group and tile (GroupSlot);
// a slot past the last tile ends at once, its whole cluster with it, before
// any barrier.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/pipeline_sm90.cuh"
#include "kernels/common/reduce.cuh"
#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_fp8_sm90.cuh"
#include "kernels/gemm/gemm_sm90_epilogue.cuh"

namespace layerserve::kernels::gemm::fp8 {

constexpr int kBlockN = 128;   // W rows per CTA
constexpr int kHalfRows = 64;  // W rows per consumer warpgroup
constexpr int kBlockK = 128;   // K per stage: one 128-byte swizzle row, one scale block
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kConsumerWarps = 8;
constexpr int kWBytes = kBlockN * kBlockK;
constexpr int kMaxSplits = kMaxClusterSplits;
constexpr int kMaxDecodeTokens = 64;
// Staged tile pitch in floats (== 4 mod 32 words: conflict-free fragment
// writes, as in version 4).
constexpr int kStagePitch = kBlockN + 4;
static_assert(kHalfRows == kFp8WeightScaleRows && kHalfRows == kFp8GateUpBlock && kBlockK == kFp8BlockK,
              "the kernel's tile is the scale and interleave granularity gemm.h promises");

struct Fp8GemmArgs {
  const float* a_scale;           // [m] or [kblocks][m]
  const float* w_scale;           // [n] or [ceil(n / 64)][kblocks] (per group)
  const __nv_bfloat16* bias;      // [n] or null (dense, not gated)
  const __nv_bfloat16* residual;  // [m, n] or null (may alias c)
  __nv_bfloat16* c;               // [m, ldc]
  int m, n, k;                    // m: all rows of A (every group's)
  int ldc;                        // n, or n / 2 with silu_mul
  int kblocks;
  int splits;
  bool silu_mul;
  // A grouped product (DenseGemm::group_offsets), else null: group g's W is
  // rows [g n, (g + 1) n) of the stacked W, its scales start at w_scale + g
  // w_scale_stride.
  const int32_t* group_offsets;
  int groups;
  int64_t w_scale_stride;
};

// The rows of A one CTA multiplies: `count` (1..kTokN) from row `row0`.
struct TokenTile {
  int row0;
  int count;
};

// The slot-th (group, token tile) of a grouped product with kTokN-row token
// tiles, found by one warp over the offsets (each lane counts the tiles of
// a run of groups, then a warp scan): the tile's rows of A, and its group.
// count <= 0: no such slot.
template <int kTokN>
__device__ __forceinline__ TokenTile GroupSlot(const int32_t* offsets, int groups, int slot, int* group) {
  const int lane = threadIdx.x % 32;
  const int per_lane = (groups + 31) / 32;
  const int g_begin = min(groups, lane * per_lane);
  const int g_end = min(groups, g_begin + per_lane);
  int tiles = 0;
  for (int g = g_begin; g < g_end; ++g) tiles += (offsets[g + 1] - offsets[g] + kTokN - 1) / kTokN;
  const int inclusive = WarpInclusiveSum(tiles);
  TokenTile found{0, 0};
  int t = slot - (inclusive - tiles);  // the slot's tile among this lane's
  if (t >= 0 && t < tiles) {
    for (int g = g_begin; g < g_end; ++g) {
      const int rows = offsets[g + 1] - offsets[g];
      const int group_tiles = (rows + kTokN - 1) / kTokN;
      if (t < group_tiles) {
        found = TokenTile{offsets[g] + t * kTokN, min(kTokN, rows - t * kTokN)};
        *group = g;
        break;
      }
      t -= group_tiles;
    }
  }
  return found;
}

// kBlocks CTAs an SM: two of four stages each; or, for a grouped product's
// small token tiles, whose CTAs each stream little W and so spend more of
// their time launching, filling and draining, three of three stages (four
// would pass the SM's 228 KB of shared memory).
template <int kTokN, int kBlocks = 2>
struct Layout {
  static_assert(kTokN <= kMaxDecodeTokens, "decode token tiles only");
  static_assert(kBlocks == 2 || (kBlocks == 3 && kTokN <= 16), "three CTAs an SM fit token tiles of 16 at most");
  static constexpr int kStages = kBlocks == 3 ? 3 : 4;
  static constexpr int kMinBlocks = kBlocks;
  static constexpr int kActBytes = kTokN * kBlockK;
  static constexpr int kStageBytes = kWBytes + kActBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(kActBytes % 1024 == 0, "token tile must stay 1024-byte aligned (kTokN multiple of 8)");
  static_assert(kTokN * kStagePitch * 4 <= kStages * kStageBytes, "epilogue staging must fit in the ring");
};

// One consumer warpgroup: the K blocks [kb_begin, kb_end) of its 64 W rows
// against the token tile, promoted into fp32, then staged as [token][row].
template <int kTokN, bool kBlockScaled, int kBlocks>
__device__ __forceinline__ void ConsumeAndStage(const TmaPipeline<Layout<kTokN, kBlocks>::kStages>& pipe, uint32_t ring,
                                                int kb_begin, int kb_end, int n0, TokenTile tokens,
                                                const Fp8GemmArgs& args, float* staged) {
  using L = Layout<kTokN, kBlocks>;
  const int consumer = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  float acc[kTokN / 2];
#pragma unroll
  for (int i = 0; i < kTokN / 2; ++i) acc[i] = 0.f;
  FenceAccumulators(acc);
  // The scale rows this thread needs: its warpgroup's 64 W rows, and its
  // accumulator columns, tokens tokens.row0 + 8 j + 2 (lane % 4) + e.
  const int w_group = n0 / kHalfRows + consumer;
  const bool w_group_in = w_group * kHalfRows < args.n;
  // Block scales. Thread t < kTokN of the warpgroup loads token t's scale
  // of K block kb + 1 while kb runs (one register), and parks it in shared
  // memory for the warpgroup (double-buffered, one named barrier per block);
  // the promotion reads the kTokN / 4 it needs from there. The weight
  // block's scale is one value, loaded ahead the same way.
  __shared__ float parked_sa[2][2][kMaxDecodeTokens];  // [consumer][buffer][token]
  const int t = threadIdx.x % 128;
  float sa_next = 0.f;
  float sw_next = 1.f;
  const auto load_scales = [&](int kb) {
    if constexpr (kBlockScaled) {
      if (kb >= kb_end) return;
      sw_next = w_group_in ? args.w_scale[static_cast<int64_t>(w_group) * args.kblocks + kb] : 0.f;
      if (t < kTokN) {
        sa_next = t < tokens.count ? args.a_scale[static_cast<int64_t>(kb) * args.m + tokens.row0 + t] : 0.f;
      }
    }
  };
  // Two partial sums: K block kb + 1's wgmmas run while kb's partial is
  // promoted (the wgmma groups retire in order, so waiting for all but the
  // newest retires kb's).
  float part0[kTokN / 2];
  float part1[kTokN / 2];
  PipeState<L::kStages> issue_state;
  PipeState<L::kStages> retire_state;
  const auto issue = [&](float(&part)[kTokN / 2]) {
    pipe.ConsumerWait(issue_state);
    const uint32_t stage = ring + issue_state.index * L::kStageBytes;
    const uint64_t desc_w = SmemDescSw128(stage + consumer * (kHalfRows * kBlockK));
    const uint64_t desc_a = SmemDescSw128(stage + kWBytes);
    FenceAccumulators(part);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 32; ++kk) WgmmaE4m3M64<kTokN>(part, desc_w + 2 * kk, desc_a + 2 * kk, kk > 0);
    WgmmaCommit();
    issue_state.Advance();
  };
  // Block kb's scales, parked before its promotion (buffer kb % 2).
  float sw = 1.f;
  const auto park = [&](int kb) {
    sw = sw_next;
    if constexpr (kBlockScaled) {
      if (t < kTokN) parked_sa[consumer][kb & 1][t] = sa_next;
      load_scales(kb + 1);
      NamedBarrierSync(2 + consumer, 128);
    }
  };
  // kb's wgmmas have retired: free its stage, promote its partial.
  const auto retire = [&](float(&part)[kTokN / 2], int kb) {
    FenceAccumulators(part);
    pipe.ConsumerRelease(retire_state);
    retire_state.Advance();
#pragma unroll
    for (int j = 0; j < kTokN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 4 * j + 2 * h + e;
          if constexpr (kBlockScaled) {
            acc[i] += part[i] * (sw * parked_sa[consumer][kb & 1][8 * j + 2 * (lane % 4) + e]);
          } else {
            acc[i] += part[i];
          }
        }
  };
  // K blocks in pairs, so that no wgmma is in flight across the loop's back
  // edge (where the compiler would copy its accumulators and serialize every
  // wgmma of the kernel). Not for 64 tokens: at two CTAs an SM a thread has
  // 96 registers, and three 32-register sums would spill.
  load_scales(kb_begin);
  int kb = kb_begin;
  if constexpr (kTokN <= 32) {
    for (; kb + 1 < kb_end; kb += 2) {
      park(kb);
      issue(part0);
      issue(part1);
      WgmmaWait<1>();
      retire(part0, kb);
      park(kb + 1);
      WgmmaWait<0>();
      retire(part1, kb + 1);
    }
  }
  for (; kb < kb_end; ++kb) {
    park(kb);
    issue(part0);
    WgmmaWait<0>();
    retire(part0, kb);
  }

  // Accumulator element (row r, col c) of this warpgroup is Cᵀ: tile row
  // 64 consumer + r, token c. Every copy the producer issued has been
  // consumed once both warpgroups pass this barrier, so the ring is free.
  NamedBarrierSync(1, kConsumerThreads);
  const int r_local = consumer * kHalfRows + warp * 16 + lane / 4;
  const int c_base = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < kTokN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) staged[(8 * j + c_base + e) * kStagePitch + r_local + 8 * h] = acc[4 * j + 2 * h + e];
}

__device__ __forceinline__ float4 Scale4(float4 v, float s, const float* w_scale) {
  const float4 w = *reinterpret_cast<const float4*>(w_scale);
  return make_float4(v.x * (s * w.x), v.y * (s * w.y), v.z * (s * w.z), v.w * (s * w.w));
}

template <int kTokN, bool kBlockScaled, int kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocks)
    Fp8GemmKernel(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
                  const Fp8GemmArgs dense_args) {
#if LS_GEMM_DEVICE_SM90A
  using L = Layout<kTokN, kBlocks>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const TmaPipeline<L::kStages> pipe(ring + L::kStages * L::kStageBytes);
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();

  // The CTA's rows of A, and its group's W rows and scales (below).
  Fp8GemmArgs args = dense_args;
  // Clusters are (splits, 1, 1): consecutive blocks are the splits of a W tile.
  const int tile = blockIdx.x / args.splits;
  const int split = static_cast<int>(cluster.block_rank());
  const int n0 = tile * kBlockN;
  TokenTile tokens{0, min(kTokN, args.m)};
  int w_row0 = n0;
  if (args.group_offsets != nullptr) {
    __shared__ int slot_site[3];  // group, first row, rows
    WaitForPrerequisiteGrids();
    if (threadIdx.x < 32) {
      int g = 0;
      const TokenTile found = GroupSlot<kTokN>(args.group_offsets, args.groups, static_cast<int>(blockIdx.y), &g);
      if (threadIdx.x == 0) slot_site[2] = 0;
      __syncwarp();
      if (found.count > 0) {
        slot_site[0] = g;
        slot_site[1] = found.row0;
        slot_site[2] = found.count;
      }
    }
    __syncthreads();
    tokens = TokenTile{slot_site[1], slot_site[2]};
    if (tokens.count <= 0) return;
    w_row0 += slot_site[0] * args.n;
    args.w_scale += slot_site[0] * args.w_scale_stride;
  }
  const int kb_begin = static_cast<int>(static_cast<int64_t>(split) * args.kblocks / args.splits);
  const int kb_end = static_cast<int>(static_cast<int64_t>(split + 1) * args.kblocks / args.splits);

  if (threadIdx.x == 0) pipe.Init(kConsumerWarps);
  __syncthreads();
  // As version 4: small token tiles let the next kernel launch at once.
  constexpr bool kLaunchDependentsAtEntry = kTokN <= 32;
  if constexpr (kLaunchDependentsAtEntry) AllowDependentLaunch();

  float* staged = reinterpret_cast<float*>(smem_raw + (ring - SmemAddr(smem_raw)));
  if (threadIdx.x >= kConsumerThreads) {
    if (threadIdx.x == kConsumerThreads) {
      PrefetchTensorMap(&map_w);
      PrefetchTensorMap(&map_a);
      // The first pass takes its W tiles before waiting for the preceding
      // grid (which may still be writing A); each stage expects W and A.
      const int iters = kb_end - kb_begin;
      const int first_pass = min(iters, L::kStages);
      PipeState<L::kStages> state;
      for (int i = 0; i < first_pass; ++i, state.Advance()) {
        const uint32_t bar = pipe.ProducerExpect(state, L::kStageBytes);
        TmaLoad2d(ring + state.index * L::kStageBytes, &map_w, bar, (kb_begin + i) * kBlockK, w_row0);
      }
      WaitForPrerequisiteGrids();
      state = PipeState<L::kStages>{};
      for (int i = 0; i < first_pass; ++i, state.Advance()) {
        TmaLoad2d(ring + state.index * L::kStageBytes + kWBytes, &map_a, pipe.FullBarrier(state),
                  (kb_begin + i) * kBlockK, tokens.row0);
      }
      for (int i = first_pass; i < iters; ++i, state.Advance()) {
        const uint32_t bar = pipe.ProducerAcquire(state, L::kStageBytes);
        const uint32_t dst = ring + state.index * L::kStageBytes;
        TmaLoad2d(dst, &map_w, bar, (kb_begin + i) * kBlockK, w_row0);
        TmaLoad2d(dst + kWBytes, &map_a, bar, (kb_begin + i) * kBlockK, tokens.row0);
      }
      if constexpr (!kLaunchDependentsAtEntry) AllowDependentLaunch();
    }
    __syncwarp();
  } else {
    // The block scales of A come from the preceding grid (the quantization).
    if constexpr (kBlockScaled) WaitForPrerequisiteGrids();
    ConsumeAndStage<kTokN, kBlockScaled, kBlocks>(pipe, ring, kb_begin, kb_end, n0, tokens, args, staged);
  }
  WaitForPrerequisiteGrids();
  cluster.sync();

  // This CTA's share of the tile's outputs, in groups of four: group g is
  // token g / per_token, W rows n0 + r .. r + 3 (r = 4 (g % per_token)); with
  // silu_mul the gate rows r.. and the up rows r + 64.., giving output
  // columns n0 / 2 + r ...
  const int per_token = args.silu_mul ? kHalfRows / 4 : kBlockN / 4;
  const int groups = tokens.count * per_token;
  const int chunk = (groups + args.splits - 1) / args.splits;
  const int end = min(groups, (split + 1) * chunk);
  for (int g = split * chunk + static_cast<int>(threadIdx.x); g < end; g += kThreads) {
    const int t = g / per_token;
    const int r = 4 * (g % per_token);
    if (n0 + r >= args.n) continue;  // n % 16 == 0: a group is all in or all out
    const int64_t row = tokens.row0 + t;
    float4 sum = SumOverCluster(cluster, staged, t * kStagePitch + r, args.splits);
    const float sa = kBlockScaled ? 1.f : args.a_scale[row];
    int64_t offset;
    if (args.silu_mul) {
      float4 up = SumOverCluster(cluster, staged, t * kStagePitch + r + kHalfRows, args.splits);
      if constexpr (!kBlockScaled) {
        sum = Scale4(sum, sa, args.w_scale + n0 + r);
        up = Scale4(up, sa, args.w_scale + n0 + kHalfRows + r);
      }
      sum = make_float4(SiluMulOne(sum.x, up.x), SiluMulOne(sum.y, up.y), SiluMulOne(sum.z, up.z),
                        SiluMulOne(sum.w, up.w));
      offset = row * args.ldc + n0 / 2 + r;
    } else {
      if constexpr (!kBlockScaled) sum = Scale4(sum, sa, args.w_scale + n0 + r);
      offset = row * args.n + n0 + r;
      if (args.bias != nullptr) {
        const uint2 bits = *reinterpret_cast<const uint2*>(args.bias + n0 + r);
        const float2 b01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
        const float2 b23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
        sum.x += b01.x;
        sum.y += b01.y;
        sum.z += b23.x;
        sum.w += b23.y;
      }
      if (args.residual != nullptr) {
        const uint2 bits = *reinterpret_cast<const uint2*>(args.residual + offset);
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
    *reinterpret_cast<uint2*>(args.c + offset) = out;
  }
  // Peers may still be reading this CTA's shared memory.
  cluster.sync();
#endif
}

}  // namespace layerserve::kernels::gemm::fp8
