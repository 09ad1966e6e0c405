// Version 6's prefill kernel (M > 64): the FP8 GEMM as a persistent,
// warp-specialized kernel with tokens on the wgmma M side, the layout whose
// per-token scales cost two registers a thread (the decode kernel,
// gemm_fp8_sm90.cuh, puts W rows there and pays a scale per token column).
//
// Warpgroup 0 is the producer: one thread walks the CTA's tiles (t =
// blockIdx.x, + gridDim.x, ...; grouped so that the CTAs running together
// share bands of A and W in L2) and keeps a TmaPipeline ring of 128 x 128
// A and W tiles full, running into the next tile while the consumers finish
// the last. With block-128 scaling its second warp walks the same slots and
// writes each one's scales into shared memory beside it (the slot's "full"
// barrier waits for both), so the consumers' loop makes no global load. Warpgroups 1 and 2 are consumers: each owns 64
// rows of the 128 x 128 output tile. Per 128-wide K block, four m64n128k32 e4m3 wgmma go into a fresh fp32 partial sum
// that is then promoted into the accumulator (FP8.md), while the next K block's wgmma already run into a second one,
// scaled there by the block's scales with block-128 scaling:
// a_scale of the thread's two rows times w_scale of its columns' two 64-row
// groups, read from the slot. With per-row scaling both scales apply at the epilogue. The
// epilogue writes bf16 straight from registers (bias and residual added, or the
// gated MLP's silu(gate) * up of columns c and c + 64, the kFp8GateUpBlock
// interleave), while the producer already streams the next tile.
//
// setmaxnreg moves registers from the producer (40) to the consumers (232),
// as in version 3.
//
// A grouped product (a mixture of experts) walks one tile sequence over all
// groups as version 3 does (LoadGroupSchedule, after the routing kernel
// before it has completed): a group's last row tile may read the next
// group's rows of A, and stores only its own.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/pipeline_sm90.cuh"
#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_fp8_sm90.cuh"
#include "kernels/gemm/gemm_fp8_sm90.cuh"
#include "kernels/gemm/gemm_sm90_epilogue.cuh"

namespace layerserve::kernels::gemm::fp8_prefill {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = fp8::kBlockK;
constexpr int kHalf = fp8::kHalfRows;  // one consumer's rows; a scale row of W
constexpr int kStages = 6;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kGroupM = 8;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kABytes = kBlockM * kBlockK;
constexpr int kWBytes = kBlockN * kBlockK;
constexpr int kStageBytes = kABytes + kWBytes;
constexpr int kScheduleOffset = kStages * kStageBytes + 2 * kStages * 8;
// Block-128 scaling: each ring slot's scales, written by the producer
// warpgroup's second warp: the tile's 128 rows' A scales and its two 64-row
// W groups' scales for the slot's K block (floats; 4 of padding).
constexpr int kSlotScales = kBlockM + 4;
constexpr int kScalesOffset = kScheduleOffset + kGroupScheduleInts * 4;
constexpr int kSmemBytes = kScalesOffset + kStages * kSlotScales * 4 + 1024;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
static_assert(kBlockN == 2 * kHalf, "a tile's columns span two W scale rows (or gate and up halves)");

template <bool kBlockScaled>
__global__ void __launch_bounds__(kThreads, 1)
    Fp8PrefillKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                     const fp8::Fp8GemmArgs args) {
#if LS_GEMM_DEVICE_SM90A
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const TmaPipeline<kStages> pipe(ring + kStages * kStageBytes);
  const int warpgroup = threadIdx.x / 128;
  int* const first_row = reinterpret_cast<int*>(smem_raw + (ring - SmemAddr(smem_raw)) + kScheduleOffset);
  int* const first_tile = first_row + kMaxGemmGroups + 1;
  const int tiles_m = (args.m + kBlockM - 1) / kBlockM;
  const int tiles_n = (args.n + kBlockN - 1) / kBlockN;
  const int num_kb = args.kblocks;
  const bool grouped = args.group_offsets != nullptr;
  // Tile t's group (0 for a dense product), rows and coordinates.
  const auto locate = [&](int t) {
    if (!grouped) return GroupTile{0, GroupRows{0, args.m}, GroupedTile(t, tiles_m, tiles_n, kGroupM)};
    return LocateGroupTile(t, args.groups, kBlockM, tiles_n, kGroupM, first_row, first_tile);
  };

  float* const slot_scales = reinterpret_cast<float*>(smem_raw + (ring - SmemAddr(smem_raw)) + kScalesOffset);
  if (threadIdx.x == 0) {
    PrefetchTensorMap(&map_a);
    PrefetchTensorMap(&map_w);
    // (Block-128: the scale warp's 32 lanes arrive too.)
    pipe.Init(kConsumerWarps, kBlockScaled ? 1 + 32 : 1);
  }
  __syncthreads();
  // A, its scales, the residual and the group offsets come from the
  // preceding grids.
  WaitForPrerequisiteGrids();
  const int num_tiles =
      grouped ? LoadGroupSchedule(args.group_offsets, args.groups, kBlockM, tiles_n, first_row, first_tile)
              : tiles_m * tiles_n;

  if (warpgroup == 0) {
    SetMaxNRegDecrease<kProducerRegs>();
    if (threadIdx.x == 0) {
      PipeState<kStages> state;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const GroupTile site = locate(t);
        for (int kb = 0; kb < num_kb; ++kb, state.Advance()) {
          const uint32_t bar = pipe.ProducerAcquire(state, kStageBytes);
          const uint32_t dst = ring + state.index * kStageBytes;
          TmaLoad2d(dst, &map_a, bar, kb * kBlockK, site.rows.row0 + site.tile.m * kBlockM);
          TmaLoad2d(dst + kABytes, &map_w, bar, kb * kBlockK, site.group * args.n + site.tile.n * kBlockN);
        }
      }
    } else if (kBlockScaled && threadIdx.x / 32 == 1) {
      // The scales of each slot's K block, copied a ring ahead of their use
      // (in the consumers' loop, a load's L2 latency showed at every K
      // block), asynchronously: one wait per slot made this warp the ring's
      // bottleneck. Rows past the group and W groups past n get zeros.
      const int lane = threadIdx.x % 32;
      PipeState<kStages> state;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const GroupTile site = locate(t);
        // This lane's rows (lane + 32 i: in while 32 i < rows_left) and,
        // for lanes 0 and 1, W group `group`, stepped one K block at a time.
        const int rows_left = site.rows.rows - site.tile.m * kBlockM - lane;
        const float* a_scale = args.a_scale + site.rows.row0 + site.tile.m * kBlockM + lane;
        const int group = site.tile.n * (kBlockN / kHalf) + min(lane, 1);
        const bool w_in = lane < 2 && group * kHalf < args.n;
        const float* w_scale =
            args.w_scale + site.group * args.w_scale_stride + static_cast<int64_t>(w_in ? group : 0) * num_kb;
        for (int kb = 0; kb < num_kb; ++kb, state.Advance(), a_scale += args.m, ++w_scale) {
          pipe.HelperAcquire(state);
          const uint32_t scales = SmemAddr(slot_scales + state.index * kSlotScales) + 4 * lane;
#pragma unroll
          for (int i = 0; i < kBlockM / 32; ++i) {
            const bool in = 32 * i < rows_left;
            pipe.HelperCopy4(scales + 128 * i, in ? a_scale + 32 * i : args.a_scale, in ? 4 : 0);
          }
          if (lane < 2) pipe.HelperCopy4(scales + 4 * kBlockM, w_scale, w_in ? 4 : 0);
          pipe.HelperArriveOnCopies(state);
        }
      }
    }
    return;
  }
  SetMaxNRegIncrease<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  PipeState<kStages> state;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const GroupTile site = locate(t);
    const TileCoord tile = site.tile;
    // This thread's rows (h = 0, 1) within the group, and its columns 8 j +
    // 2 (lane % 4) + e; a row's index into A, its scales and C is
    // site.rows.row0 + its row.
    const int row0 = tile.m * kBlockM + consumer * 64 + warp * 16 + lane / 4;
    const int n0 = tile.n * kBlockN;
    const int64_t first = site.rows.row0;
    const float* const w_scale = args.w_scale + site.group * args.w_scale_stride;
    float acc[kBlockN / 2];
    float part0[kBlockN / 2];
    float part1[kBlockN / 2];
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc[i] = part0[i] = part1[i] = 0.f;
    // Two partial sums in flight: K block kb + 1's wgmma run while kb's sum
    // is promoted, so the tensor cores do not wait for the promotion.
    // `issued` walks the ring ahead of `retired` by one K block.
    PipeState<kStages> issued = state;
    const auto issue = [&](float(&part)[kBlockN / 2]) {
      pipe.ConsumerWait(issued);
      const uint32_t stage = ring + issued.index * kStageBytes;
      const uint64_t desc_a = SmemDescSw128(stage + consumer * (64 * kBlockK));
      const uint64_t desc_w = SmemDescSw128(stage + kABytes);
      FenceAccumulators(part);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) WgmmaE4m3M64<kBlockN>(part, desc_a + 2 * kk, desc_w + 2 * kk, kk > 0);
      WgmmaCommit();
      issued.Advance();
    };
    // Waits for K block kb's partial sum (`more`: the next one stays in
    // flight), frees its slot and promotes it.
    // Block scales: the two rows', and the two 64-row W groups' of the
    // tile's columns, from the slot (read before it is freed).
    const int local_row = consumer * 64 + warp * 16 + lane / 4;
    const auto retire = [&](float(&part)[kBlockN / 2], bool more) {
      float s[2][2];
      if constexpr (kBlockScaled) {
        const float* const scales = slot_scales + state.index * kSlotScales;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int g = 0; g < 2; ++g) s[h][g] = scales[local_row + 8 * h] * scales[kBlockM + g];
      }
      if (more) {
        WgmmaWait<1>();
      } else {
        WgmmaWait<0>();
      }
      FenceAccumulators(part);
      pipe.ConsumerRelease(state);
      state.Advance();
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * j + 2 * h + e;
            if constexpr (kBlockScaled) {
              acc[i] += part[i] * s[h][j / (kBlockN / 16)];
            } else {
              acc[i] += part[i];
            }
          }
    };
    // num_kb >= 1 (k >= 16). Pairs while a third block follows, then the
    // last one or two.
    issue(part0);
    int kb = 0;
    for (; kb + 2 < num_kb; kb += 2) {
      issue(part1);
      retire(part0, true);
      issue(part0);
      retire(part1, true);
    }
    if (kb + 1 < num_kb) {
      issue(part1);
      retire(part0, true);
      retire(part1, false);
    } else {
      retire(part0, false);
    }

    // Epilogue, from registers: element (h, j, e) is row row0 + 8 h, column
    // n0 + 8 j + 2 (lane % 4) + e. Every accumulator is read outside any
    // branch that depends on the thread (only the stores are predicated):
    // ptxas serializes all of a kernel's wgmma when accumulator registers
    // are touched on a divergent path.
    // Every value the stores need is loaded before the first store: for all
    // the compiler knows a store through args.c may alias a scale, the bias
    // or the residual, so a load after a store waits for it. Such a chain of
    // 32 loads and stores a thread made the per-row kernel 0.7-0.8x its
    // block-scaled twin; loads first took it from 710 to 1 072 TFLOP/s at
    // 8192 x 4096 x 4096 (H200).
    const int col_lane = 2 * (lane % 4);
    float sa[2];
    int64_t out_row[2];
    bool row_in[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      row_in[h] = row < site.rows.rows;
      out_row[h] = first + min(row, site.rows.rows - 1);
      sa[h] = kBlockScaled ? 1.f : args.a_scale[out_row[h]];
    }
    if (args.silu_mul) {
      // n % 128 == 0: the tile is whole; columns j < 8 are gates, j + 8
      // their ups.
      float2 wg[kBlockN / 16], wu[kBlockN / 16];
      if constexpr (!kBlockScaled) {
#pragma unroll
        for (int j = 0; j < kBlockN / 16; ++j) {
          wg[j] = *reinterpret_cast<const float2*>(w_scale + n0 + 8 * j + col_lane);
          wu[j] = *reinterpret_cast<const float2*>(w_scale + n0 + kHalf + 8 * j + col_lane);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < kBlockN / 16; ++j) {
          float g0 = acc[4 * j + 2 * h], g1 = acc[4 * j + 2 * h + 1];
          float u0 = acc[4 * (j + 8) + 2 * h], u1 = acc[4 * (j + 8) + 2 * h + 1];
          if constexpr (!kBlockScaled) {
            g0 *= sa[h] * wg[j].x;
            g1 *= sa[h] * wg[j].y;
            u0 *= sa[h] * wu[j].x;
            u1 *= sa[h] * wu[j].y;
          }
          const __nv_bfloat162 out = __floats2bfloat162_rn(SiluMulOne(g0, u0), SiluMulOne(g1, u1));
          if (row_in[h]) {
            *reinterpret_cast<__nv_bfloat162*>(args.c + out_row[h] * args.ldc + n0 / 2 + 8 * j + col_lane) = out;
          }
        }
      }
    } else {
      // Column pairs (n % 16 == 0: a pair is all in or all out), clamped
      // into C so that every load is in bounds.
      int col[kBlockN / 8];
      float2 w[kBlockN / 8], b[kBlockN / 8];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        col[j] = min(n0 + 8 * j + col_lane, args.n - 2);
        w[j] = kBlockScaled ? float2{1.f, 1.f} : *reinterpret_cast<const float2*>(w_scale + col[j]);
        b[j] = args.bias != nullptr ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(args.bias + col[j]))
                                    : float2{0.f, 0.f};
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 r[kBlockN / 8];
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          r[j] = args.residual != nullptr ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                                                args.residual + out_row[h] * args.n + col[j]))
                                          : float2{0.f, 0.f};
        }
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          float x = acc[4 * j + 2 * h], y = acc[4 * j + 2 * h + 1];
          if constexpr (!kBlockScaled) {
            x *= sa[h] * w[j].x;
            y *= sa[h] * w[j].y;
          }
          if (args.bias != nullptr) {
            x += b[j].x;
            y += b[j].y;
          }
          if (args.residual != nullptr) {
            x += r[j].x;
            y += r[j].y;
          }
          if (row_in[h] && n0 + 8 * j + col_lane < args.n) {
            *reinterpret_cast<__nv_bfloat162*>(args.c + out_row[h] * args.n + col[j]) = __floats2bfloat162_rn(x, y);
          }
        }
      }
    }
  }
#endif
}

}  // namespace layerserve::kernels::gemm::fp8_prefill
