// Version 2: persistent GEMM on Hopper's own data path. TMA (bulk tensor
// copies, 128B swizzle) fills a kStages-deep shared-memory ring, completion is
// signalled on one mbarrier per slot, and the tensor cores read both operands
// straight from shared memory through wgmma.
//
// Not yet specialized: the two warpgroups both compute (64 rows each of a
// 128x128 tile) and thread 0 also issues the copies, refilling a slot only
// after a CTA-wide barrier says both warpgroups are done with it. Version 3
// removes that barrier from the main loop.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/gemm_sm90_utils.cuh"
#include "kernels/gemm/wgmma_sm90.cuh"

namespace layerserve::kernels::gemm::v2 {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 64;  // one 128-byte swizzle row of bf16
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kGroupM = 8;
constexpr int kABytes = kBlockM * kBlockK * 2;
constexpr int kWBytes = kBlockN * kBlockK * 2;
constexpr int kStageBytes = kABytes + kWBytes;
// Ring, then the barriers; +1024 to align the ring to the swizzle atom.
constexpr int kSmemBytes = kStages * kStageBytes + kStages * 8 + 1024;
static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0, "tiles must stay 1024-byte aligned");

__global__ void __launch_bounds__(kThreads, 1)
    GemmTmaWgmmaKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                       const GemmArgs args) {
#if LS_GEMM_DEVICE_SM90A
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const uint32_t full_bar = ring + kStages * kStageBytes;
  const int warpgroup = threadIdx.x / 128;
  const int num_kb = (args.k + kBlockK - 1) / kBlockK;
  const int num_tiles = args.tiles_m * args.tiles_n;

  if (threadIdx.x == 0) {
    PrefetchTensorMap(&map_a);
    PrefetchTensorMap(&map_w);
    for (int s = 0; s < kStages; ++s) MbarInit(full_bar + 8 * s, 1);
    FenceBarrierInit();
  }
  __syncthreads();

  auto issue = [&](int slot, int m0, int n0, int kb) {
    const uint32_t bar = full_bar + 8 * slot;
    const uint32_t dst = ring + slot * kStageBytes;
    MbarArriveExpectTx(bar, kStageBytes);
    TmaLoad2d(dst, &map_a, bar, kb * kBlockK, m0);
    TmaLoad2d(dst + kABytes, &map_w, bar, kb * kBlockK, n0);
  };

  // k-blocks consumed by this CTA so far: selects ring slot and barrier parity.
  uint32_t iter = 0;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord tile = GroupedTile(t, args.tiles_m, args.tiles_n, kGroupM);
    const int m0 = tile.m * kBlockM;
    const int n0 = tile.n * kBlockN;
    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages && i < num_kb; ++i) issue((iter + i) % kStages, m0, n0, i);
    }

    float acc[kBlockN / 2];
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.f;

    for (int kb = 0; kb < num_kb; ++kb, ++iter) {
      const int slot = iter % kStages;
      MbarWait(full_bar + 8 * slot, (iter / kStages) & 1);
      const uint32_t a_tile = ring + slot * kStageBytes + warpgroup * (64 * kBlockK * 2);
      const uint32_t w_tile = ring + slot * kStageBytes + kABytes;
      const uint64_t desc_a = SmemDescSw128(a_tile);
      const uint64_t desc_w = SmemDescSw128(w_tile);
      FenceAccumulators(acc);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) WgmmaBf16M64<kBlockN>(acc, desc_a + 2 * kk, desc_w + 2 * kk);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceAccumulators(acc);
      __syncthreads();  // both warpgroups are done reading the slot
      if (threadIdx.x == 0 && kb + kStages < num_kb) issue(slot, m0, n0, kb + kStages);
    }

    StoreWgmmaAccumulators<kBlockN>(acc, args, m0 + warpgroup * 64, n0);
  }
#endif
}

}  // namespace layerserve::kernels::gemm::v2
