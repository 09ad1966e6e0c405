// Device building blocks of the Hopper (sm_90a) kernels, used by the GEMM
// versions and attention v8: thin wrappers over the Hopper instructions
// (mbarrier, TMA bulk tensor copies, wgmma fences and shared-memory matrix
// descriptors, setmaxnreg). Only nvcc sees this header.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no libcuda link)
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/pdl.cuh"  // the PDL calls of v4 and attention

// Hopper-only instructions are emitted only in the sm_90a device pass; other
// passes compile the kernels to empty bodies that the host never launches
// (the launchers check the device and LAYERSERVE_GEMM_HAVE_SM90A first).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LS_GEMM_DEVICE_SM90A 1
#else
#define LS_GEMM_DEVICE_SM90A 0
#endif

namespace layerserve::kernels::gemm {

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

// A bulk copy (no tensor map) of `bytes` from global `src` to shared `dst`,
// counted on barrier `bar` as TmaLoad2d's boxes are: both addresses and
// `bytes` multiples of 16.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
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
