// The stage/phase bookkeeping of a TMA ring, in one place (STYLE habit 7): a
// producer fills kStages shared-memory slots that consumers drain in order;
// each slot has a "full" mbarrier (one producer arrival plus the TMA bytes)
// and an "empty" one (one arrival per consumer warp). PipeState walks the
// slots and flips the parity each time it wraps; the producer waits on
// "empty" at the opposite parity, so its first pass through the ring does not
// wait. Only nvcc sees this header.
#pragma once

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"

namespace layerserve::kernels::gemm {

template <int kStages>
struct PipeState {
  int index = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

template <int kStages>
class TmaPipeline {
 public:
  // `barriers`: 2 kStages mbarriers (8 bytes each) in shared memory, full
  // ones first.
  __device__ __forceinline__ explicit TmaPipeline(uint32_t barriers)
      : full_(barriers), empty_(barriers + 8 * kStages) {}

  // One thread, before any use (then a CTA-wide barrier). `producers`: the
  // arrivals a slot's "full" barrier waits for besides the TMA bytes (the
  // TMA producer's, and any helper's that fills part of the slot itself).
  __device__ __forceinline__ void Init(uint32_t consumer_warps, uint32_t producers = 1) const {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_ + 8 * s, producers);
      MbarInit(empty_ + 8 * s, consumer_warps);
    }
    FenceBarrierInit();
  }
  // Waits until the consumers released the slot: the TMA producer's first
  // step (ProducerAcquire), and all a helper producer (Init's producers)
  // waits for.
  __device__ __forceinline__ void HelperAcquire(const PipeState<kStages>& s) const {
    MbarWait(empty_ + 8 * s.index, s.phase ^ 1);
  }
  // A helper thread's copy of `bytes` (4: a float; 0: zeros) from global
  // `src` into the slot's shared memory at `dst`, asynchronously.
  __device__ __forceinline__ static void HelperCopy4(uint32_t dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
  }
  // A helper thread's one arrival on the slot's "full" barrier (Init counted
  // it among `producers`), made once its copies above have landed: the
  // helper goes on to the next slot without waiting for them.
  __device__ __forceinline__ void HelperArriveOnCopies(const PipeState<kStages>& s) const {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full_ + 8 * s.index) : "memory");
  }

  // Producer: waits until the consumers released the slot, then announces
  // `bytes` of TMA copies on its full barrier; returns that barrier.
  __device__ __forceinline__ uint32_t ProducerAcquire(const PipeState<kStages>& s, uint32_t bytes) const {
    HelperAcquire(s);
    return ProducerExpect(s, bytes);
  }
  // The same without the wait: a slot's first fill.
  __device__ __forceinline__ uint32_t ProducerExpect(const PipeState<kStages>& s, uint32_t bytes) const {
    MbarArriveExpectTx(full_ + 8 * s.index, bytes);
    return full_ + 8 * s.index;
  }
  __device__ __forceinline__ uint32_t FullBarrier(const PipeState<kStages>& s) const { return full_ + 8 * s.index; }

  // Consumer: waits until the slot's copies landed.
  __device__ __forceinline__ void ConsumerWait(const PipeState<kStages>& s) const {
    MbarWait(full_ + 8 * s.index, s.phase);
  }
  // Consumer warp: done reading the slot (lane 0 arrives for the warp).
  __device__ __forceinline__ void ConsumerRelease(const PipeState<kStages>& s) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) MbarArrive(empty_ + 8 * s.index);
  }

 private:
  uint32_t full_;
  uint32_t empty_;
};

}  // namespace layerserve::kernels::gemm
