// Device pieces the GEMM versions share on top of kernels/common/sm90_utils.cuh:
// the kernel arguments, the grouped tile order of the persistent kernels and
// the bf16 epilogue (with the optional residual add). Only nvcc sees this
// header.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"
#include "kernels/gemm/gemm_internal.h"

namespace layerserve::kernels::gemm {

// Everything a kernel needs besides tensor maps. Pointers are 16-byte aligned
// and n, k multiples of 8 (checked by the launchers).
struct GemmArgs {
  const __nv_bfloat16* a;         // [m, k]
  const __nv_bfloat16* w;         // [n, k]
  const __nv_bfloat16* residual;  // [m, n] or null
  __nv_bfloat16* c;               // [m, ldc]
  int m, n, k;
  int ldc;        // n, or n / 2 with silu_mul
  bool silu_mul;  // DenseGemm::silu_mul
  int tiles_m, tiles_n;
  int splits;  // version 4: K splits (= cluster size)
  // Grouped products (DenseGemm): null for one dense product.
  const int32_t* group_offsets;
  int groups;
};

// Host side: kernel arguments from validated params and a tile shape.
inline GemmArgs MakeGemmArgs(const DenseGemm& p, int block_m, int block_n) {
  GemmArgs args{};
  args.a = static_cast<const __nv_bfloat16*>(p.a);
  args.w = static_cast<const __nv_bfloat16*>(p.w);
  args.residual = static_cast<const __nv_bfloat16*>(p.residual);
  args.c = static_cast<__nv_bfloat16*>(p.c);
  args.m = static_cast<int>(p.m);
  args.n = static_cast<int>(p.n);
  args.k = static_cast<int>(p.k);
  args.ldc = static_cast<int>(p.silu_mul ? p.n / 2 : p.n);
  args.silu_mul = p.silu_mul;
  args.tiles_m = static_cast<int>((p.m + block_m - 1) / block_m);
  args.tiles_n = static_cast<int>((p.n + block_n - 1) / block_n);
  args.splits = 1;
  args.group_offsets = p.group_offsets;
  args.groups = p.groups;
  return args;
}

// The rows of group `g` of a grouped product: output rows [row0, row0 +
// rows), read as a dense problem of `rows` rows whose A, residual and C start
// at row0 (W_g's offset is the caller's). The returned arguments bound the
// epilogue to the group's rows.
struct GroupRows {
  int row0;
  int rows;
};
__device__ __forceinline__ GemmArgs GroupArgs(const GemmArgs& args, GroupRows g) {
  GemmArgs out = args;
  out.c = args.c + static_cast<int64_t>(g.row0) * args.ldc;
  if (args.residual != nullptr) out.residual = args.residual + static_cast<int64_t>(g.row0) * args.n;
  out.m = g.rows;
  return out;
}

// Persistent kernels walk tiles t = blockIdx.x, + gridDim.x, ... in groups of
// kGroupM tile rows that sweep all tile columns, so that the CTAs running at
// one time share a band of A rows and a band of W rows in L2.
struct TileCoord {
  int m;
  int n;
};
__device__ __forceinline__ TileCoord GroupedTile(int t, int tiles_m, int tiles_n, int group_m) {
  const int per_group = group_m * tiles_n;
  const int first_m = (t / per_group) * group_m;
  const int rows = min(tiles_m - first_m, group_m);
  const int r = t % per_group;
  return TileCoord{first_m + r % rows, r / rows};
}

// The tile schedule of a grouped product in a persistent kernel (versions 3
// and 6): group g owns output rows [first_row[g], first_row[g + 1]) and the
// ceil(rows / block_m) x tiles_n tiles from first_tile[g] on, in GroupedTile
// order within the group, so the CTAs running at one time share W_g in L2.
// Both arrays (groups + 1 entries each, kGroupScheduleInts in all) live in
// shared memory; every thread of the CTA calls LoadGroupSchedule, after the
// kernel that wrote the offsets (the expert routing) has completed, and it
// returns the number of tiles.
inline constexpr int kGroupScheduleInts = 2 * (kMaxGemmGroups + 1);
__device__ __forceinline__ int LoadGroupSchedule(const int32_t* offsets, int groups, int block_m, int tiles_n,
                                                 int* first_row, int* first_tile) {
  for (int g = threadIdx.x; g <= groups; g += blockDim.x) first_row[g] = offsets[g];
  __syncthreads();
  if (threadIdx.x == 0) {
    first_tile[0] = 0;
    for (int g = 0; g < groups; ++g) {
      const int rows = first_row[g + 1] - first_row[g];
      first_tile[g + 1] = first_tile[g] + (rows + block_m - 1) / block_m * tiles_n;
    }
  }
  __syncthreads();
  return first_tile[groups];
}

// Where tile t of a grouped product lies: its group, the group's rows and
// the tile within the group.
struct GroupTile {
  int group;
  GroupRows rows;
  TileCoord tile;
};
__device__ __forceinline__ GroupTile LocateGroupTile(int t, int groups, int block_m, int tiles_n, int group_m,
                                                     const int* first_row, const int* first_tile) {
  // The last group whose first tile is <= t: groups without rows share their
  // first tile with the next group, so this one has rows.
  int lo = 0;
  int hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_tile[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const GroupRows rows{first_row[lo], first_row[lo + 1] - first_row[lo]};
  const int tiles_m = (rows.rows + block_m - 1) / block_m;
  return GroupTile{lo, rows, GroupedTile(t - first_tile[lo], tiles_m, tiles_n, group_m)};
}

// silu(gate) * up in bf16 for one output, from fp32 accumulators, with the
// roundings of the separate kernel (kernels/activation/silu_mul.cuh) on the
// bf16 product it would read: gate and up to bf16, silu's result to bf16,
// then the product. So a fused and an unfused run of one kernel agree bit
// for bit.
__device__ __forceinline__ float SiluMulOne(float gate, float up) {
  const float g = __bfloat162float(__float2bfloat16_rn(gate));
  const float silu = __bfloat162float(__float2bfloat16_rn(g / (1.f + expf(-g))));
  return silu * __bfloat162float(__float2bfloat16_rn(up));
}

// The split-K kernels (v4, v6) reduce over a thread block cluster of at most
// this many CTAs (the portable cluster size).
inline constexpr int kMaxClusterSplits = 8;

// Four consecutive fp32 values at `offset` of every cluster CTA's `staged`
// tile, summed in rank order (all loads issued first), so the result does not
// depend on timing.
__device__ __forceinline__ float4 SumOverCluster(const cooperative_groups::cluster_group& cluster, float* staged,
                                                 int offset, int splits) {
  float4 part[kMaxClusterSplits];
#pragma unroll
  for (int q = 0; q < kMaxClusterSplits; ++q) {
    if (q < splits) part[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(staged, q) + offset);
  }
  float4 sum = part[0];
#pragma unroll
  for (int q = 1; q < kMaxClusterSplits; ++q) {
    if (q < splits) {
      sum.x += part[q].x;
      sum.y += part[q].y;
      sum.z += part[q].z;
      sum.w += part[q].w;
    }
  }
  return sum;
}

// Writes a warpgroup's m64 x kN wgmma accumulator tile whose top-left output
// element is (row0, col0); col0 is a multiple of 16.
//
// Thread `lane` holds columns col0 + 2 (lane % 4) + 8 j (and the next one) for
// every j, so with silu_mul (gate/up columns interleaved in blocks of 8) its
// even j are gate columns and j + 1 the up columns of the same two features:
// output columns (col0 + 8 j) / 2 + 2 (lane % 4), one bf16 pair.
template <int kN>
__device__ __forceinline__ void StoreWgmmaAccumulators(const float (&acc)[kN / 2], const GemmArgs& args, int row0,
                                                       int col0) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const int row = row0 + warp * 16 + lane / 4;
  const int col = col0 + 2 * (lane % 4);
  if (args.silu_mul) {
#pragma unroll
    for (int j = 0; j < kN / 8; j += 2) {
      // n is a multiple of 16: a gate block in range has its up block too.
      if (col + 8 * j >= args.n) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row + 8 * h < args.m) {
          const int64_t offset = static_cast<int64_t>(row + 8 * h) * args.ldc + (col0 + 8 * j) / 2 + 2 * (lane % 4);
          *reinterpret_cast<__nv_bfloat162*>(args.c + offset) =
              __floats2bfloat162_rn(SiluMulOne(acc[4 * j + 2 * h], acc[4 * j + 4 + 2 * h]),
                                    SiluMulOne(acc[4 * j + 2 * h + 1], acc[4 * j + 4 + 2 * h + 1]));
        }
      }
    }
    return;
  }
  // The residual is read a run of kRun column pairs ahead of their stores:
  // a store through C may alias it for all the compiler knows (with
  // accumulation it does: each thread reads only what it writes), so a load
  // after a store waits for the store, and one load-store chain over the
  // row's pairs costs a memory latency per pair.
  constexpr int kRun = kN / 8 < 16 ? kN / 8 : 16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool row_in = row + 8 * h < args.m;
    const int64_t row_offset = static_cast<int64_t>(row + 8 * h) * args.n;
#pragma unroll
    for (int j0 = 0; j0 < kN / 8; j0 += kRun) {
      float2 r[kRun];
#pragma unroll
      for (int u = 0; u < kRun; ++u) {
        // n is a multiple of 8, so col + 8j < n implies col + 8j + 1 < n.
        const bool in = row_in && col + 8 * (j0 + u) < args.n;
        r[u] = args.residual != nullptr && in ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                                                    args.residual + row_offset + col + 8 * (j0 + u)))
                                              : float2{0.f, 0.f};
      }
#pragma unroll
      for (int u = 0; u < kRun; ++u) {
        const int j = j0 + u;
        float x = acc[4 * j + 2 * h], y = acc[4 * j + 2 * h + 1];
        if (args.residual != nullptr) {
          x += r[u].x;
          y += r[u].y;
        }
        if (row_in && col + 8 * j < args.n) {
          *reinterpret_cast<__nv_bfloat162*>(args.c + row_offset + col + 8 * j) = __floats2bfloat162_rn(x, y);
        }
      }
    }
  }
}

}  // namespace layerserve::kernels::gemm
