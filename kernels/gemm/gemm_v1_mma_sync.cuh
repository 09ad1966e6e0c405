// Version 1: persistent tiled GEMM on warp-level mma.sync (m16n8k16 bf16),
// the pre-Hopper way. Shared-memory tiles are filled by cp.async in a
// kStages-deep ring so that loads of later k-blocks overlap the math of the
// current one; operands reach registers through ldmatrix.
//
// CTA tile 128x128x32, 8 warps as 2 (M) x 4 (N), warp tile 64x32. Rows of the
// shared tiles are padded from 32 to 40 elements (80 bytes) so that the eight
// 16-byte rows one ldmatrix phase reads fall in distinct banks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/gemm_sm90_utils.cuh"

namespace layerserve::kernels::gemm::v1 {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 32;
constexpr int kStages = 4;
constexpr int kRowElems = kBlockK + 8;  // padded row
constexpr int kThreads = 256;
constexpr int kGroupM = 8;
constexpr int kStageElems = (kBlockM + kBlockN) * kRowElems;
constexpr int kSmemBytes = kStages * kStageElems * 2;
static_assert(kBlockM * kBlockK / 8 == 2 * kThreads, "each thread copies two 16-byte chunks of A per stage");
static_assert(kBlockN * kBlockK / 8 == 2 * kThreads, "each thread copies two 16-byte chunks of W per stage");
static_assert((kRowElems * 2) % 16 == 0, "cp.async and ldmatrix need 16-byte aligned rows");

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  // src-size 0 zero-fills the destination (rows past m or n, k past K).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies k-block `kb` of tile (m0, n0) into ring slot `stage`.
__device__ __forceinline__ void LoadStage(const GemmArgs& args, uint32_t smem, int stage, int m0, int n0, int kb) {
  const uint32_t a_base = smem + stage * kStageElems * 2;
  const uint32_t w_base = a_base + kBlockM * kRowElems * 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int row = chunk / (kBlockK / 8);
    const int col = (chunk % (kBlockK / 8)) * 8;
    const int k = kb * kBlockK + col;
    const bool k_ok = k < args.k;
    const bool a_ok = k_ok && m0 + row < args.m;
    const bool w_ok = k_ok && n0 + row < args.n;
    // Out-of-range chunks still need a valid address; the copy reads 0 bytes.
    const __nv_bfloat16* a_src = a_ok ? args.a + static_cast<int64_t>(m0 + row) * args.k + k : args.a;
    const __nv_bfloat16* w_src = w_ok ? args.w + static_cast<int64_t>(n0 + row) * args.k + k : args.w;
    CpAsync16(a_base + (row * kRowElems + col) * 2, a_src, a_ok);
    CpAsync16(w_base + (row * kRowElems + col) * 2, w_src, w_ok);
  }
}

__global__ void __launch_bounds__(kThreads, 2) GemmMmaSyncKernel(const GemmArgs args) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t smem = SmemAddr(smem_raw);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_m = warp / 4;  // 0..1: 64-row half of the tile
  const int warp_n = warp % 4;  // 0..3: 32-column quarter
  const int num_kb = (args.k + kBlockK - 1) / kBlockK;
  const int num_tiles = args.tiles_m * args.tiles_n;

  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord tile = GroupedTile(t, args.tiles_m, args.tiles_n, kGroupM);
    const int m0 = tile.m * kBlockM;
    const int n0 = tile.n * kBlockN;
    // The previous tile's last k-blocks may still be read by other warps.
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_kb) LoadStage(args, smem, s, m0, n0, s);
      CpAsyncCommit();  // empty groups keep the wait_group arithmetic uniform
    }

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    for (int kb = 0; kb < num_kb; ++kb) {
      CpAsyncWait<kStages - 2>();  // k-block kb has landed (for this thread)
      __syncthreads();             // ... for all threads; and slot kb-1 is free
      const int next = kb + kStages - 1;
      if (next < num_kb) LoadStage(args, smem, next % kStages, m0, n0, next);
      CpAsyncCommit();

      const uint32_t a_base = smem + (kb % kStages) * kStageElems * 2;
      const uint32_t w_base = a_base + kBlockM * kRowElems * 2;
#pragma unroll
      for (int kk = 0; kk < kBlockK; kk += 16) {
        uint32_t a_frag[4][4];
        uint32_t b_frag[2][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Matrices: rows 0-7 / 8-15 (lane & 15) x k 0-7 / 8-15 (lane >> 4).
          const int row = warp_m * 64 + i * 16 + (lane & 15);
          const int col = kk + (lane >> 4) * 8;
          LdMatrixX4(a_base + (row * kRowElems + col) * 2, a_frag[i]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
          const int row = warp_n * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int col = kk + ((lane >> 3) & 1) * 8;
          LdMatrixX4(w_base + (row * kRowElems + col) * 2, b_frag[j]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) MmaBf16(acc[i][j], a_frag[i], b_frag[j / 2][(j % 2) * 2], b_frag[j / 2][(j % 2) * 2 + 1]);
      }
    }
    CpAsyncWait<0>();

    // mma.sync C fragment: c0,c1 at (g, 2t..2t+1), c2,c3 at (g + 8, 2t..2t+1).
    const int row_base = m0 + warp_m * 64 + lane / 4;
    const int col_base = n0 + warp_n * 32 + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = col_base + j * 8;
        if (col >= args.n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_base + i * 16 + h * 8;
          if (row < args.m) {
            StorePair(args, static_cast<int64_t>(row) * args.n + col, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
          }
        }
      }
  }
}

}  // namespace layerserve::kernels::gemm::v1
