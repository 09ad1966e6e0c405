// Device code of flash-attention version 8: the forward pass on Hopper's
// warpgroup tensor-core instructions (wgmma, sm_90a only), head_dim 128, bf16.
//
// One CTA owns 128 query rows of one (sequence, head) and runs two warpgroups
// of 64 rows each. Per key tile of 128 keys, each warpgroup computes
// S = Q·Kᵀ with wgmma m64n128k16 (Q and K read from shared memory through
// 128B-swizzle descriptors), runs the online softmax on the fp32 accumulator
// fragments in registers (lazy rescale, as v6), packs P to bf16 in place and
// issues O += P·V with P as the register A operand and V read MN-major from
// the same swizzled [key][dim] layout. Three ways of keeping the tensor
// cores busy (design record 0005 has what each was worth):
// - the P·V of one tile is issued with the next tile's Q·Kᵀ, so each
//   warpgroup's softmax overlaps its own P·V;
// - the two warpgroups take turns issuing their products (named barriers),
//   so one's softmax runs while the other's products run;
// - no CTA-wide barrier in the key loop: K/V tiles sit in a 3-stage ring
//   filled by cp.async from all 256 threads, whose completion is counted on
//   one mbarrier per stage ("full"), and a stage is refilled once every
//   thread has arrived on its "empty" mbarrier, so the warpgroups may drift
//   apart by up to a tile.
// Blocks are enumerated longest-first within sections of heads, and a
// sliding window starts each tile's key loop at its first visible key tile,
// exactly as in flash_fwd_kernel.cuh. Every thread both loads and consumes
// the K/V ring, so all agree on the tile range by computing it from the same
// CTA-uniform values.
//
// Shared layout: every 128-row tile (Q, each K and V stage) is two 16 KiB
// halves of 64 columns; within a half, row r's 16-byte chunk c sits at
// r*128 + (c ^ r%8)*16 (the 128B swizzle wgmma expects; halves 1024-aligned).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention/flash_fwd_kernel.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/reduce.cuh"
#include "kernels/common/sm90_utils.cuh"
#include "kernels/common/wgmma_sm90.cuh"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels::flash::sm90 {

inline constexpr int kHeadDim = 128;
inline constexpr int kBlockM = 128;  // 2 warpgroups x 64 query rows
inline constexpr int kBlockN = 128;
inline constexpr int kThreads = 256;
inline constexpr int kStages = 3;
inline constexpr int kHalfBytes = 128 * 128;       // 128 rows x 128 bytes (64 bf16 columns)
inline constexpr int kTileBytes = 2 * kHalfBytes;  // 128 rows x 128 columns
// mbarriers: q_full, then full[kStages] and empty[kStages] (see the kernel).
inline constexpr int kNumMbarriers = 1 + 2 * kStages;
// Q, kStages K tiles, kStages V tiles, the mbarriers, and slack to align the
// tiles to 1024 bytes.
inline constexpr int kSmemBytes = (1 + 2 * kStages) * kTileBytes + kNumMbarriers * 8 + 1024;

#if LS_GEMM_DEVICE_SM90A

// Orders shared memory written through the generic proxy (cp.async, whose
// completion this thread has observed) before this thread's async-proxy
// (wgmma) reads of it.
__device__ __forceinline__ void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Arrives on mbarrier `bar` once all of this thread's earlier cp.async copies
// have landed (without raising the barrier's expected count).
__device__ __forceinline__ void CpAsyncArriveOnBarrier(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Arrives on named barrier `id` (of `count` threads) without waiting.
__device__ __forceinline__ void NamedBarrierArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Keeps the register A operand of an in-flight wgmma alive (and unmoved)
// until after the wait that ends it.
template <int kCount>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[kCount][4]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Starts the cp.async copy of a 128 x 128 bf16 tile into the swizzled halves.
// Rows at or past `valid_rows` are zero-filled, never read: a tile overhanging
// a sequence's end feeds no other sequence's bytes into the products.
__device__ __forceinline__ void LoadTile(uint8_t* smem, const __nv_bfloat16* gmem, int64_t row_stride, int valid_rows,
                                         int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
  for (int i = 0; i < kBlockN * kChunksPerRow / kThreads; ++i) {
    const int idx = i * kThreads + tid;
    const int row = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const bool valid = row < valid_rows;
    const __nv_bfloat16* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
    CpAsync16(smem + (chunk >> 3) * kHalfBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4), src, valid);
  }
}

// S = Q·Kᵀ for one warpgroup's 64 rows and a 128-key tile: 8 k16 steps over
// head_dim, 4 in each 64-column half. Overwrites `acc_s`; commits one group.
__device__ __forceinline__ void IssueQK(float (&acc_s)[64], uint32_t q_addr, uint32_t k_addr) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc_s[i] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t offset = (kk / 4) * kHalfBytes + (kk % 4) * 32;
    gemm::WgmmaBf16M64N128(acc_s, gemm::SmemDescSw128(q_addr + offset), gemm::SmemDescSw128(k_addr + offset));
  }
  gemm::WgmmaCommit();
}

// O += P·V over a 128-key tile: 8 k16 steps of 16 swizzled V rows (2048
// bytes) each. Commits one group.
__device__ __forceinline__ void IssuePV(float (&acc_o)[64], const uint32_t (&p_frag)[kBlockN / 16][4],
                                        uint32_t v_addr) {
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    gemm::WgmmaBf16M64N128RegA(acc_o, p_frag[ks], gemm::SmemDescSw128MnMajor(v_addr + ks * 2048, kHalfBytes));
  }
  gemm::WgmmaCommit();
}

// Turns one tile of raw scores into unnormalized probabilities in place,
// with the lazy rescale of flash_fwd_kernel.cuh. `key0` is the tile's first
// key, `query0` the query index of this thread's row half 0 (half 1 is 8
// rows further), `col0` its first column. Returns whether this warp raised
// its maxima; then the output must still be multiplied by `correction`
// (left to the caller, which may have a P·V in flight on it).
__device__ __forceinline__ bool SoftmaxTile(float (&acc_s)[64], float (&row_max)[2], float (&row_sum)[2],
                                            float (&correction)[2], int key0, int query0, int seqlen, int window,
                                            int col0, float scale_log2) {
  // Keys past the sequence end, after the query or below its window: only
  // on the diagonal tile, the sequence's last tile and the window's edge. A
  // row may see none of a tile's keys, even in the first tile it reads; its
  // -inf scores leave it at "nothing seen yet" (see flash_fwd_kernel.cuh).
  if (TileNeedsMask<kBlockN>(key0, query0, query0 + 8, seqlen, window)) {
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + 8 * j + col0 + e;
          if (KeyMasked(query0 + 8 * h, key, seqlen, window)) acc_s[4 * j + 2 * h + e] = -INFINITY;
        }
  }
  float tile_max[2];
  bool raise = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * h], acc_s[4 * j + 2 * h + 1]));
    tile_max[h] = QuadReduceMax(mx);
    raise |= (tile_max[h] - row_max[h]) * scale_log2 > kRescaleSlackLog2;
  }
  const bool rescale = __any_sync(0xffffffffu, raise);
  if (rescale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float max_scaled = tile_max[h] == -INFINITY ? 0.f : tile_max[h] * scale_log2;
      correction[h] = FastExp2(row_max[h] * scale_log2 - max_scaled);
      row_max[h] = tile_max[h];
      row_sum[h] *= correction[h];
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float max_scaled = row_max[h] == -INFINITY ? 0.f : row_max[h] * scale_log2;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float prob = FastExp2(acc_s[4 * j + 2 * h + e] * scale_log2 - max_scaled);
        acc_s[4 * j + 2 * h + e] = prob;
        row_sum[h] += prob;
      }
  }
  return rescale;
}

// P in bf16, packed straight into A fragments: k16 step ks covers the
// accumulator's column groups 2ks (registers 0, 1) and 2ks + 1 (2, 3).
__device__ __forceinline__ void PackP(uint32_t (&p_frag)[kBlockN / 16][4], const float (&acc_s)[64]) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      p_frag[j / 2][(j % 2) * 2 + h] = PackPair<__nv_bfloat16>(acc_s[4 * j + 2 * h], acc_s[4 * j + 2 * h + 1]);
}

#endif  // LS_GEMM_DEVICE_SM90A

// Grid (query tiles x heads, sequences); `heads_per_section` divides num_heads.
// Other device passes than sm_90a compile an empty body that the launcher
// never runs (it checks the build and the device first).
__global__ void __launch_bounds__(kThreads, 1)
    FlashFwdSm90Kernel(const FlashAttentionParams p, const int heads_per_section) {
#if LS_GEMM_DEVICE_SM90A
  using T = __nv_bfloat16;
  using gemm::FenceAccumulators;
  using gemm::SmemAddr;
  AllowDependentLaunch();  // o_proj may start streaming its weights

  // Longest-first order within sections of heads (see flash_fwd_kernel.cuh).
  const int m_blocks = (p.max_seqlen + kBlockM - 1) / kBlockM;
  const int section_blocks = m_blocks * heads_per_section;
  const int section = blockIdx.x / section_blocks;
  const int in_section = blockIdx.x - section * section_blocks;
  const int rank = in_section / heads_per_section;
  const int m_block = m_blocks - 1 - rank;
  const int head = section * heads_per_section + (in_section - rank * heads_per_section);
  const int seq = blockIdx.y;
  const int seq_start = p.cu_seqlens[seq];
  const int seqlen = p.cu_seqlens[seq + 1] - seq_start;
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen) return;

  // Keys [n_start, n_end) in n_tiles tiles, as in flash_fwd_kernel.cuh: k and
  // v point at key n_start, and kv_rows of the sequence's keys lie from there.
  // Tile indices below (groups, stages, phases) count from n_start's tile.
  const int n_end = min(seqlen, m0 + kBlockM);
  const int n_start = FirstKeyTile<kBlockN>(m0, p.window) * kBlockN;
  const int n_tiles = (n_end - n_start + kBlockN - 1) / kBlockN;
  const int kv_rows = seqlen - n_start;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const T* q = static_cast<const T*>(p.q) + (seq_start + m0) * p.q_row_stride + head * kHeadDim;
  const T* k = static_cast<const T*>(p.k) + (seq_start + n_start) * p.k_row_stride + kv_head * kHeadDim;
  const T* v = static_cast<const T*>(p.v) + (seq_start + n_start) * p.v_row_stride + kv_head * kHeadDim;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* sQ = smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr);
  uint8_t* sK = sQ + kTileBytes;                                // [kStages] tiles
  uint8_t* sV = sK + kStages * kTileBytes;                      // [kStages] tiles
  const uint32_t q_full = SmemAddr(sV + kStages * kTileBytes);  // kNumMbarriers of 8 bytes

  const int tid = threadIdx.x;
  const int warpgroup = tid / 128;
  const int lane = tid % 32;
  // This thread's query rows (tile-relative): row0 and row0 + 8, the two row
  // halves h of the wgmma accumulator layout; its columns are 8j + col0 + e.
  const int row0 = warpgroup * 64 + (tid / 32 % 4) * 16 + lane / 4;
  const int col0 = (lane % 4) * 2;

  // Stage bookkeeping. Group g (g < n_tiles) is K of tile g + 1 and V of
  // tile g, loaded by all threads into K stage (g + 1) % kStages and V stage
  // g % kStages; its copies arrive on full[g % kStages] (the Q / K 0 copies on
  // q_full). At the end of its step for tile i every thread arrives on
  // empty[(i + 2) % kStages]: tile i's K and tile i - 1's V are no longer
  // read, which is what group i + 2 overwrites. Phases complete every
  // kStages uses, so parities are (use index / kStages) & 1.
  auto full = [&](int g) { return q_full + 8 * (1 + g % kStages); };
  auto empty = [&](int g) { return q_full + 8 * (1 + kStages + g % kStages); };
  if (tid == 0) {
    for (int i = 0; i < kNumMbarriers; ++i) gemm::MbarInit(q_full + 8 * i, kThreads);
    gemm::FenceBarrierInit();
  }
  __syncthreads();

  auto load_group = [&](int g) {
    if (g >= 2) gemm::MbarWait(empty(g), ((g - 2) / kStages) & 1);
    if (g + 1 < n_tiles) {
      const int n_next = (g + 1) * kBlockN;  // from key n_start
      LoadTile(sK + ((g + 1) % kStages) * kTileBytes, k + n_next * p.k_row_stride, p.k_row_stride, kv_rows - n_next,
               tid);
    }
    const int n_this = g * kBlockN;
    LoadTile(sV + (g % kStages) * kTileBytes, v + n_this * p.v_row_stride, p.v_row_stride, kv_rows - n_this, tid);
    CpAsyncArriveOnBarrier(full(g));
  };
  // Before reading a group: its copies (by every thread) have landed, and
  // this thread orders them before its own async-proxy (wgmma) reads.
  auto wait_full = [&](uint32_t bar, int parity) {
    gemm::MbarWait(bar, parity);
    FenceProxyAsyncShared();
  };

  // The two warpgroups take turns issuing their products (named barriers 1
  // and 2), so one warpgroup's softmax runs while the other's products use
  // the tensor cores instead of both contending at once. Warpgroup 0 goes
  // first; each warpgroup issues n_tiles + 1 times, and warpgroup 1 skips
  // its last hand-over, which nobody would wait for.
  const int my_turn = 1 + warpgroup, other_turn = 2 - warpgroup;
  if (warpgroup == 1) NamedBarrierArrive(other_turn, kThreads);

  // Q and the first K tile, then group 0 behind them.
  LoadTile(sQ, q, p.q_row_stride, seqlen - m0, tid);
  LoadTile(sK, k, p.k_row_stride, kv_rows, tid);
  CpAsyncArriveOnBarrier(q_full);
  load_group(0);

  // acc[4j + 2h + e] = row (row0 + 8h), column 8j + col0 + e.
  float acc_o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc_o[i] = 0.f;
  float acc_s[64];
  uint32_t p_frag[kBlockN / 16][4];  // P of the tile whose P·V is next
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this thread's partial sums; the quad's are added at the end
  float correction[2];
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  const int query0 = m0 + row0;
  const uint32_t q_addr = SmemAddr(sQ) + warpgroup * 64 * 128;
  const uint32_t k_addr = SmemAddr(sK);
  const uint32_t v_addr = SmemAddr(sV);

  // Tile 0: S only (the output is still zero, so its rescale is moot).
  wait_full(q_full, 0);
  gemm::NamedBarrierSync(my_turn, kThreads);
  gemm::WgmmaFence();
  IssueQK(acc_s, q_addr, k_addr);
  NamedBarrierArrive(other_turn, kThreads);
  gemm::WgmmaWait<0>();
  FenceAccumulators(acc_s);
  SoftmaxTile(acc_s, row_max, row_sum, correction, n_start, query0, seqlen, p.window, col0, scale_log2);
  PackP(p_frag, acc_s);
  gemm::MbarArrive(empty(2));

  // Tiles 1..: S of tile nb is issued together with P·V of tile nb - 1, so
  // this warpgroup's softmax of tile nb also overlaps its own P·V.
  for (int nb = 1; nb < n_tiles; ++nb) {
    load_group(nb);
    wait_full(full(nb - 1), ((nb - 1) / kStages) & 1);
    gemm::NamedBarrierSync(my_turn, kThreads);
    FenceAccumulators(acc_o);
    gemm::WgmmaFence();
    IssueQK(acc_s, q_addr, k_addr + (nb % kStages) * kTileBytes);
    IssuePV(acc_o, p_frag, v_addr + ((nb - 1) % kStages) * kTileBytes);
    NamedBarrierArrive(other_turn, kThreads);
    gemm::WgmmaWait<1>();  // S is done; P·V may still run
    FenceAccumulators(acc_s);
    const bool rescale = SoftmaxTile(acc_s, row_max, row_sum, correction, n_start + nb * kBlockN, query0, seqlen,
                                     p.window, col0, scale_log2);
    gemm::WgmmaWait<0>();
    FenceAccumulators(acc_o);
    FenceRegisters(p_frag);
    if (rescale) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          acc_o[4 * j + 2 * h] *= correction[h];
          acc_o[4 * j + 2 * h + 1] *= correction[h];
        }
    }
    PackP(p_frag, acc_s);
    gemm::MbarArrive(empty(nb + 2));
  }

  // The last tile's P·V.
  wait_full(full(n_tiles - 1), ((n_tiles - 1) / kStages) & 1);
  gemm::NamedBarrierSync(my_turn, kThreads);
  FenceAccumulators(acc_o);
  gemm::WgmmaFence();
  IssuePV(acc_o, p_frag, v_addr + ((n_tiles - 1) % kStages) * kTileBytes);
  if (warpgroup == 0) NamedBarrierArrive(other_turn, kThreads);
  gemm::WgmmaWait<0>();
  FenceAccumulators(acc_o);
  FenceRegisters(p_frag);

  // Normalize and store; rows past the sequence end are not written.
  T* out = static_cast<T*>(p.out) + (seq_start + m0) * p.out_row_stride + head * kHeadDim;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = QuadReduceSum(row_sum[h]);
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
    const int row = row0 + 8 * h;
    if (m0 + row < seqlen) {
      T* out_row = out + row * p.out_row_stride;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        *reinterpret_cast<uint32_t*>(out_row + 8 * j + col0) =
            PackPair<T>(acc_o[4 * j + 2 * h] * inv_sum, acc_o[4 * j + 2 * h + 1] * inv_sum);
      }
    }
  }
#endif  // LS_GEMM_DEVICE_SM90A
}

}  // namespace layerserve::kernels::flash::sm90
