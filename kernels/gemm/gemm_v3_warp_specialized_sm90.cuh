// Version 3: warp-specialized persistent GEMM. Warpgroup 0 is the producer:
// one thread walks the same tile sequence as the consumers and keeps the
// kStages-deep TMA ring full, waiting only on per-slot "empty" barriers.
// Warpgroups 1 and 2 are consumers: each owns 64 rows of a 128 x kBlockN tile
// (m64n256k16 wgmma and 128 fp32 accumulators per thread at kBlockN = 256),
// releases a slot as soon as the wgmma that read it has retired, and writes
// its tile straight from registers while the producer already streams the
// next tile's k-blocks. kBlockN = 128 (six stages) is for shapes whose
// 128x256 tiles would leave SMs idle.
//
// setmaxnreg moves registers from the producer (40) to the consumers (232);
// it requires the launch-bounds register cap (384 threads, 1 block/SM).
//
// A grouped product (a mixture of experts) walks one tile sequence over all
// groups: group g contributes ceil(rows_g / kBlockM) x tiles_n tiles, in grouped
// order within the group, so the CTAs running at one time share W_g in L2.
// The rows per group come from the device (the routing kernel before this
// one): each CTA first turns them into a tile prefix in shared memory, and
// producer and consumers map each tile index to (group, tile) from it. A
// group's last row tile may read rows of the next group or past the end of A
// (zero-filled by TMA); its epilogue stores only the group's own rows. With
// groups of a few dozen rows those partial tiles are most of the work, so
// grouped products may also run 64-row tiles (kBlockM = 64): both consumers
// then take all 64 rows and half the tile's columns each (m64n128 wgmma at
// kBlockN = 256), the W tile as before.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_sm90.cuh"
#include "kernels/gemm/gemm_sm90_epilogue.cuh"

namespace layerserve::kernels::gemm::v3 {

constexpr int kBlockK = 64;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kGroupM = 8;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");

// Shared memory of a grouped product's schedule (LoadGroupSchedule).
constexpr int kScheduleBytes = kGroupScheduleInts * 4;

// kBlockM: rows per tile, 128 (each consumer 64 of them) or 64 (each
// consumer half the columns).
template <int kBlockN, int kBlockM = 128>
struct Config {
  static_assert(kBlockM == 128 || kBlockM == 64, "row tiles of 128 or 64");
  static constexpr int kStages = kBlockN == 256 ? 4 : 6;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kWBytes = kBlockN * kBlockK * 2;
  // Each consumer warpgroup's share of a tile: 64 rows and kConsumerN columns.
  static constexpr int kConsumerN = kBlockM == 128 ? kBlockN : kBlockN / 2;
  static constexpr int kStageBytes = kABytes + kWBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + kScheduleBytes + 1024;
  static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0, "tiles must stay 1024-byte aligned");
};

// Where tile t of a product lies: its group's rows, the tile within the
// group, and the first row of W_g (0 for a dense product).
struct TileSite {
  GroupRows rows;
  TileCoord tile;
  int w_row0;
};

template <int kBlockM>
__device__ __forceinline__ TileSite LocateTile(int t, const GemmArgs& args, const int* first_row,
                                               const int* first_tile) {
  if (args.group_offsets == nullptr) {
    return TileSite{GroupRows{0, args.m}, GroupedTile(t, args.tiles_m, args.tiles_n, kGroupM), 0};
  }
  const GroupTile g = LocateGroupTile(t, args.groups, kBlockM, args.tiles_n, kGroupM, first_row, first_tile);
  return TileSite{g.rows, g.tile, g.group * args.n};
}

template <int kBlockN, int kBlockM = 128>
__global__ void __launch_bounds__(kThreads, 1)
    GemmWarpSpecializedKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                              const GemmArgs args) {
#if LS_GEMM_DEVICE_SM90A
  using C = Config<kBlockN, kBlockM>;
  constexpr int kStages = C::kStages;
  constexpr int kStageBytes = C::kStageBytes;
  constexpr int kABytes = C::kABytes;
  constexpr int kConsumerN = C::kConsumerN;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const uint32_t full_bar = ring + kStages * kStageBytes;
  const uint32_t empty_bar = full_bar + kStages * 8;
  int* const first_row = reinterpret_cast<int*>(smem_raw + (empty_bar + kStages * 8 - SmemAddr(smem_raw)));
  int* const first_tile = first_row + kMaxGemmGroups + 1;
  const int warpgroup = threadIdx.x / 128;
  const int num_kb = (args.k + kBlockK - 1) / kBlockK;
  int num_tiles = args.tiles_m * args.tiles_n;

  if (args.group_offsets != nullptr) {
    num_tiles = LoadGroupSchedule(args.group_offsets, args.groups, kBlockM, args.tiles_n, first_row, first_tile);
  }
  if (threadIdx.x == 0) {
    PrefetchTensorMap(&map_a);
    PrefetchTensorMap(&map_w);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_bar + 8 * s, 1);                // the producer's arrive.expect_tx
      MbarInit(empty_bar + 8 * s, kConsumerWarps);  // one arrive per consumer warp
    }
    FenceBarrierInit();
  }
  __syncthreads();

  if (warpgroup == 0) {
    SetMaxNRegDecrease<kProducerRegs>();
    if (threadIdx.x == 0) {
      uint32_t iter = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const TileSite site = LocateTile<kBlockM>(t, args, first_row, first_tile);
        for (int kb = 0; kb < num_kb; ++kb, ++iter) {
          const int slot = iter % kStages;
          // First pass over the ring: parity 1 of a fresh barrier counts as
          // completed, so the producer does not wait.
          MbarWait(empty_bar + 8 * slot, ((iter / kStages) & 1) ^ 1);
          const uint32_t bar = full_bar + 8 * slot;
          const uint32_t dst = ring + slot * kStageBytes;
          MbarArriveExpectTx(bar, kStageBytes);
          TmaLoad2d(dst, &map_a, bar, kb * kBlockK, site.rows.row0 + site.tile.m * kBlockM);
          TmaLoad2d(dst + kABytes, &map_w, bar, kb * kBlockK, site.w_row0 + site.tile.n * kBlockN);
        }
      }
    }
  } else {
    SetMaxNRegIncrease<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const bool signals = threadIdx.x % 32 == 0;
    uint32_t iter = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const TileSite site = LocateTile<kBlockM>(t, args, first_row, first_tile);
      float acc[kConsumerN / 2];
#pragma unroll
      for (int i = 0; i < kConsumerN / 2; ++i) acc[i] = 0.f;

      for (int kb = 0; kb < num_kb; ++kb, ++iter) {
        const int slot = iter % kStages;
        MbarWait(full_bar + 8 * slot, (iter / kStages) & 1);
        // 128-row tiles: this consumer's 64 rows of A against all of W; 64-row
        // tiles: all of A against this consumer's half of W's rows.
        const uint64_t desc_a =
            SmemDescSw128(ring + slot * kStageBytes + (kBlockM == 128 ? consumer * (64 * kBlockK * 2) : 0));
        const uint64_t desc_w = SmemDescSw128(ring + slot * kStageBytes + kABytes +
                                              (kBlockM == 128 ? 0 : consumer * (kConsumerN * kBlockK * 2)));
        FenceAccumulators(acc);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) WgmmaBf16M64<kConsumerN>(acc, desc_a + 2 * kk, desc_w + 2 * kk);
        WgmmaCommit();
        FenceAccumulators(acc);
        // Keep one k-block of wgmma in flight; the one before it has retired,
        // so its slot can be refilled.
        WgmmaWait<1>();
        if (kb > 0) {
          __syncwarp();
          if (signals) MbarArrive(empty_bar + 8 * ((iter - 1) % kStages));
        }
      }
      WgmmaWait<0>();
      FenceAccumulators(acc);
      if (num_kb > 0) {
        __syncwarp();
        if (signals) MbarArrive(empty_bar + 8 * ((iter - 1) % kStages));
      }
      const int row0 = site.tile.m * kBlockM + (kBlockM == 128 ? consumer * 64 : 0);
      const int col0 = site.tile.n * kBlockN + (kBlockM == 128 ? 0 : consumer * kConsumerN);
      StoreWgmmaAccumulators<kConsumerN>(acc, GroupArgs(args, site.rows), row0, col0);
    }
  }
#endif
}

}  // namespace layerserve::kernels::gemm::v3
