// Version 5: version 3's warp-specialized persistent GEMM (producer
// warpgroup + two consumer warpgroups, 128x256 tile per CTA, 4-stage TMA ring)
// run as thread block clusters of two CTAs stacked along M, with the
// epilogue going out through shared memory and TMA stores.
//
// Multicast: the two CTAs of a cluster compute a 256x256 cluster tile. Each
// loads its own 128-row A tile and one 128-row half of the shared 256-row W
// tile, which TMA multicasts into the same ring slot of both CTAs. Every CTA
// thus reads 16 + 16 KB from L2 per k-block instead of v3's 16 + 32 KB.
//
// Because a CTA's producer writes W into its peer's ring, slot reuse needs
// both CTAs' consumers: each "empty" barrier counts the consumer warps of
// the whole cluster, and every consumer warp releases a slot in both CTAs
// (one lane each, through mapa). Each "full" barrier expects the whole 48 KB
// stage: its own A, its own W half and the peer's W half.
//
// Epilogue: each consumer warpgroup stages its 64x256 result as four 64x64
// bf16 chunks in two shared-memory buffers of its own and hands each chunk
// to a TMA bulk store. The warpgroup goes back to the next tile's wgmmas as
// soon as its last chunk is staged; the stores drain meanwhile. v3's stores
// straight from registers kept the tensor cores idle until the whole tile
// had been issued to memory.
//
// Both CTAs walk the same cluster tile sequence (grouped order, as v3), so
// their rings stay in step. With an odd number of 128-row tiles the last
// cluster row's second CTA has no A rows: it skips the A copy and the stores
// but runs the same pipeline (its peer needs its W half and its releases).
// Elsewhere TMA stores skip the rows and columns outside C.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_sm90.cuh"
#include "kernels/gemm/gemm_sm90_epilogue.cuh"

namespace layerserve::kernels::gemm::v5 {

constexpr int kClusterM = 2;  // CTAs per cluster, stacked along M
constexpr int kBlockM = 128;  // rows of A per CTA
constexpr int kClusterBlockM = kClusterM * kBlockM;
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
// Cluster tile rows per group of the tile order: 1024 rows of A, as v3's 8.
constexpr int kGroupM = 4;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kABytes = kBlockM * kBlockK * 2;
constexpr int kWBytes = kBlockN * kBlockK * 2;
constexpr int kWSliceRows = kBlockN / kClusterM;  // W rows each CTA fetches per k-block
constexpr int kWSliceBytes = kWBytes / kClusterM;
constexpr int kStageBytes = kABytes + kWBytes;
// Epilogue staging: a chunk is a warpgroup's 64 rows by one 128-byte
// swizzle row (64 bf16).
constexpr int kChunkRows = 64;
constexpr int kChunkCols = 64;
constexpr int kChunkBytes = kChunkRows * kChunkCols * 2;
constexpr int kChunkBuffers = 2;  // per consumer warpgroup
constexpr int kOutBytes = (kConsumerWarps / 4) * kChunkBuffers * kChunkBytes;
constexpr int kSmemBytes = kStages * kStageBytes + kOutBytes + 2 * kStages * 8 + 1024;
constexpr uint16_t kClusterMask = (1u << kClusterM) - 1;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
// The 128B swizzle repeats every 8 rows (1024 bytes), so W halves stacked at
// kWSliceBytes read back as one 256-row tile.
static_assert(kABytes % 1024 == 0 && kWSliceBytes % 1024 == 0, "tiles must stay 1024-byte aligned");

// 2-D tile copy global -> shared that lands at shared offset `dst` in every
// CTA of `cta_mask`, each of which counts the bytes on its barrier at `bar`.
__device__ __forceinline__ void TmaLoad2dMulticast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int k, int row,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar), "h"(cta_mask)
      : "memory");
}

// Arrives on the barrier at shared offset `bar` of cluster CTA `rank` (this
// CTA's own rank included). Default (CTA-scope) release: a cluster-scope
// release compiles to a full GPU memory barrier per k-block, which measured
// v5 at 0.55x of v3. Nothing needs it: the arrive only says that this warp's
// wgmma reads of the slot have completed (wgmma.wait_group), and the
// producer's next copy into the slot is ordered after the barrier phase.
__device__ __forceinline__ void MbarArriveInCta(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// A consumer warp is done reading a ring slot: free it in every CTA of the
// cluster (the peers' producers multicast into this CTA's copy of it).
__device__ __forceinline__ void ReleaseSlot(uint32_t empty_bar) {
  __syncwarp();
  const uint32_t lane = threadIdx.x % 32;
  if (lane < kClusterM) MbarArriveInCta(empty_bar, lane);
}

// --- epilogue through shared memory ------------------------------------------

// 2-D tile copy shared -> global, tracked in this thread's bulk async-group.
// Elements outside the tensor map's extent are not written.
__device__ __forceinline__ void TmaStore2d(const CUtensorMap* map, uint32_t src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's bulk groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders this thread's ordinary shared-memory stores before later reads by the TMA engine.
__device__ __forceinline__ void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Writes a consumer warpgroup's m64 x kBlockN accumulator tile, whose top-left
// output element is (row0, col0), as kBlockN / kChunkCols TMA stores of 64x64
// chunks staged in the warpgroup's buffers at `out` (bf16, adding the
// residual). Stores still in flight on return read their buffers until the
// next call (or BulkWaitAll) has waited for them.
__device__ __forceinline__ void StoreTileThroughSmem(const float (&acc)[kBlockN / 2], const GemmArgs& args,
                                                     const CUtensorMap* map_c, uint32_t out, int consumer, int row0,
                                                     int col0) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const bool issuer = threadIdx.x % 128 == 0;
  const int barrier = 1 + consumer;  // named barrier of this warpgroup's 128 threads
#pragma unroll
  for (int c = 0; c < kBlockN / kChunkCols; ++c) {
    const uint32_t buf = out + (c % kChunkBuffers) * kChunkBytes;
    // The chunk's residual, all loaded before its first shared-memory store:
    // no load moves past those stores (asm with a memory clobber), so one
    // load before each store made a chain of memory latencies.
    float2 res[kChunkCols / 8][2];
#pragma unroll
    for (int u = 0; u < kChunkCols / 8; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + warp * 16 + lane / 4 + 8 * h;
        const int col = col0 + 8 * (c * (kChunkCols / 8) + u) + 2 * (lane % 4);
        // n % 8 == 0: col + 1 < n too.
        res[u][h] = args.residual != nullptr && row < args.m && col < args.n
                        ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                              args.residual + static_cast<int64_t>(row) * args.n + col))
                        : float2{0.f, 0.f};
      }
    }
    // The store issued kChunkBuffers chunks ago has finished reading this buffer.
    if (issuer) BulkWaitRead<kChunkBuffers - 1>();
    NamedBarrierSync(barrier, 128);
#pragma unroll
    for (int u = 0; u < kChunkCols / 8; ++u) {  // u: 16-byte unit (8 columns) of the chunk's rows
      const int j = c * (kChunkCols / 8) + u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + lane / 4 + 8 * h;
        float x = acc[4 * j + 2 * h];
        float y = acc[4 * j + 2 * h + 1];
        if (args.residual != nullptr) {
          x += res[u][h].x;
          y += res[u][h].y;
        }
        const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
        // 128B swizzle: unit u of row r lies at unit u ^ (r % 8). A warp's
        // 32 stores hit 32 different banks.
        const uint32_t addr = buf + r * 128 + ((u ^ (r % 8)) << 4) + 4 * (lane % 4);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
      }
    }
    FenceProxyAsyncShared();
    NamedBarrierSync(barrier, 128);
    if (issuer) {
      TmaStore2d(map_c, buf, col0 + c * kChunkCols, row0);
      BulkCommit();
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    GemmClusterMulticastKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                               const __grid_constant__ CUtensorMap map_c, const GemmArgs args) {
#if LS_GEMM_DEVICE_SM90A
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Same offsets in every CTA of the cluster: multicast copies and remote
  // arrives address the peer's ring and barriers by this CTA's offsets.
  const uint32_t ring = (SmemAddr(smem_raw) + 1023) & ~1023u;
  const uint32_t out_bufs = ring + kStages * kStageBytes;
  const uint32_t full_bar = out_bufs + kOutBytes;
  const uint32_t empty_bar = full_bar + kStages * 8;
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  // Clusters are (kClusterM, 1, 1) blocks; args.tiles_m counts cluster tiles.
  const int cluster_id = blockIdx.x / kClusterM;
  const int num_clusters = gridDim.x / kClusterM;
  const int warpgroup = threadIdx.x / 128;
  const int num_kb = (args.k + kBlockK - 1) / kBlockK;
  const int num_tiles = args.tiles_m * args.tiles_n;

  if (threadIdx.x == 0) {
    PrefetchTensorMap(&map_a);
    PrefetchTensorMap(&map_w);
    PrefetchTensorMap(&map_c);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_bar + 8 * s, 1);                            // this CTA's producer
      MbarInit(empty_bar + 8 * s, kClusterM * kConsumerWarps);  // every consumer warp of the cluster
    }
    FenceBarrierInit();
  }
  // No CTA may multicast into or arrive on a peer before the peer's barriers exist.
  cluster.sync();

  if (warpgroup == 0) {
    SetMaxNRegDecrease<kProducerRegs>();
    if (threadIdx.x == 0) {
      uint32_t iter = 0;
      for (int t = cluster_id; t < num_tiles; t += num_clusters) {
        const TileCoord tile = GroupedTile(t, args.tiles_m, args.tiles_n, kGroupM);
        const int a_row = (tile.m * kClusterM + rank) * kBlockM;
        const int w_row = tile.n * kBlockN + rank * kWSliceRows;
        // A tile wholly past M is not fetched; its consumers multiply
        // whatever the slot holds and skip the epilogue.
        const bool a_rows_exist = a_row < args.m;
        for (int kb = 0; kb < num_kb; ++kb, ++iter) {
          const int slot = iter % kStages;
          // First pass over the ring: parity 1 of a fresh barrier counts as
          // completed, so the producer does not wait.
          MbarWait(empty_bar + 8 * slot, ((iter / kStages) & 1) ^ 1);
          const uint32_t bar = full_bar + 8 * slot;
          const uint32_t dst = ring + slot * kStageBytes;
          MbarArriveExpectTx(bar, a_rows_exist ? kStageBytes : kWBytes);
          if (a_rows_exist) TmaLoad2d(dst, &map_a, bar, kb * kBlockK, a_row);
          TmaLoad2dMulticast(dst + kABytes + rank * kWSliceBytes, &map_w, bar, kb * kBlockK, w_row, kClusterMask);
        }
      }
    }
    __syncwarp();
  } else {
    SetMaxNRegIncrease<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    uint32_t iter = 0;
    for (int t = cluster_id; t < num_tiles; t += num_clusters) {
      const TileCoord tile = GroupedTile(t, args.tiles_m, args.tiles_n, kGroupM);
      float acc[kBlockN / 2];
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.f;

      for (int kb = 0; kb < num_kb; ++kb, ++iter) {
        const int slot = iter % kStages;
        MbarWait(full_bar + 8 * slot, (iter / kStages) & 1);
        const uint64_t desc_a = SmemDescSw128(ring + slot * kStageBytes + consumer * (64 * kBlockK * 2));
        const uint64_t desc_w = SmemDescSw128(ring + slot * kStageBytes + kABytes);
        FenceAccumulators(acc);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) WgmmaBf16M64<kBlockN>(acc, desc_a + 2 * kk, desc_w + 2 * kk);
        WgmmaCommit();
        FenceAccumulators(acc);
        // One k-block of wgmma stays in flight; the one before it has
        // retired, so its slot can be refilled.
        WgmmaWait<1>();
        if (kb > 0) ReleaseSlot(empty_bar + 8 * ((iter - 1) % kStages));
      }
      WgmmaWait<0>();
      FenceAccumulators(acc);
      ReleaseSlot(empty_bar + 8 * ((iter - 1) % kStages));  // num_kb >= 1 (k >= 1)
      const int row0 = (tile.m * kClusterM + rank) * kBlockM + consumer * 64;
      if (row0 < args.m) {
        StoreTileThroughSmem(acc, args, &map_c, out_bufs + consumer * kChunkBuffers * kChunkBytes, consumer, row0,
                             tile.n * kBlockN);
      }
    }
    // Shared memory must outlive the last stores' reads of it.
    if (threadIdx.x % 128 == 0) BulkWaitAll();
  }
  // The peer may still arrive on this CTA's barriers; leave together.
  cluster.sync();
#endif
}

}  // namespace layerserve::kernels::gemm::v5
