// Device building blocks of the Hopper (sm_90a) kernels: thin wrappers over
// the Hopper instructions (mbarrier, TMA bulk tensor copies, wgmma fences and
// shared-memory matrix descriptors, setmaxnreg), used by the GEMM versions and
// attention v8, and the GEMMs' kernel arguments, grouped tile order of the
// persistent kernels and bf16 epilogue. Only nvcc sees this header.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no libcuda link)
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/pdl.cuh"  // the PDL calls of v4
#include "layerserve/kernels/gemm.h"

// Hopper-only instructions are emitted only in the sm_90a device pass; other
// passes compile the kernels to empty bodies that the host never launches
// (the launchers check the device and LAYERSERVE_GEMM_HAVE_SM90A first).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LS_GEMM_DEVICE_SM90A 1
#else
#define LS_GEMM_DEVICE_SM90A 0
#endif

namespace layerserve::kernels::gemm {

// Everything a kernel needs besides tensor maps. Pointers are 16-byte aligned
// and n, k multiples of 8 (checked by the launchers).
struct GemmArgs {
  const __nv_bfloat16* a;         // [m, k]
  const __nv_bfloat16* w;         // [n, k]
  const __nv_bfloat16* residual;  // [m, n] or null
  __nv_bfloat16* c;               // [m, n]
  int m, n, k;
  int tiles_m, tiles_n;
  int splits;                     // version 4: K splits (= cluster size)
};

// Host side: kernel arguments from validated params and a tile shape.
inline GemmArgs MakeGemmArgs(const GemmParams& p, int block_m, int block_n) {
  GemmArgs args{};
  args.a = static_cast<const __nv_bfloat16*>(p.a);
  args.w = static_cast<const __nv_bfloat16*>(p.w);
  args.residual = static_cast<const __nv_bfloat16*>(p.residual);
  args.c = static_cast<__nv_bfloat16*>(p.c);
  args.m = static_cast<int>(p.m);
  args.n = static_cast<int>(p.n);
  args.k = static_cast<int>(p.k);
  args.tiles_m = static_cast<int>((p.m + block_m - 1) / block_m);
  args.tiles_n = static_cast<int>((p.n + block_n - 1) / block_n);
  args.splits = 1;
  return args;
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

// out = bf16(x + residual) for two adjacent columns at `offset`.
__device__ __forceinline__ void StorePair(const GemmArgs& args, int64_t offset, float x, float y) {
  if (args.residual != nullptr) {
    const float2 r = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(args.residual + offset));
    x += r.x;
    y += r.y;
  }
  *reinterpret_cast<__nv_bfloat162*>(args.c + offset) = __floats2bfloat162_rn(x, y);
}

// Writes a warpgroup's m64 x kN wgmma accumulator tile whose top-left output
// element is (row0, col0).
template <int kN>
__device__ __forceinline__ void StoreWgmmaAccumulators(const float (&acc)[kN / 2], const GemmArgs& args, int row0,
                                                       int col0) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const int row = row0 + warp * 16 + lane / 4;
  const int col = col0 + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    // n is a multiple of 8, so col + 8j < n implies col + 8j + 1 < n.
    if (col + 8 * j >= args.n) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row + 8 * h < args.m) {
        StorePair(args, static_cast<int64_t>(row + 8 * h) * args.n + col + 8 * j, acc[4 * j + 2 * h],
                  acc[4 * j + 2 * h + 1]);
      }
    }
  }
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- mbarrier -------------------------------------------------------------

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes barrier initialization visible to the async proxy (TMA) before use.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits for the phase of parity `parity` to complete. A pipeline bug would
// otherwise hang the GPU; after ~10^10 cycles (seconds) it traps instead, so
// the launch fails with an error the host sees.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  if (MbarTryWait(bar, parity)) return;
  const long long start = clock64();
  while (!MbarTryWait(bar, parity)) {
    if (clock64() - start > 10000000000LL) __trap();
  }
}

// --- TMA ------------------------------------------------------------------

// 2-D tile copy global -> shared; completion is counted in bytes on `bar`.
// Coordinates are (innermost = k, row).
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int k, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// --- wgmma ----------------------------------------------------------------

// Descriptor of a K-major bf16 tile whose rows are 128 bytes (64 elements),
// stored as the TMA 128B swizzle leaves it: 8-row groups 1024 bytes apart.
// The tile must start 1024-byte aligned; the k16 steps inside it are reached
// by adding 32 bytes (2 in descriptor units) to the start address.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma
// instructions that use those registers asynchronously.
template <int kCount>
__device__ __forceinline__ void FenceAccumulators(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// --- warpgroup register reallocation ----------------------------------------

template <int kRegs>
__device__ __forceinline__ void SetMaxNRegIncrease() {
#if LS_GEMM_DEVICE_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDecrease() {
#if LS_GEMM_DEVICE_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

// Barrier among `count` threads (a multiple of 32) of the CTA; id 0 is
// __syncthreads.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

}  // namespace layerserve::kernels::gemm
