// Programmatic dependent launch (PDL, compute capability 9.0 and later): a
// kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// may start before the kernel ahead of it on the stream has finished, once
// every CTA of that kernel has called AllowDependentLaunch (or exited). It
// then must call WaitForPrerequisiteGrids before it touches anything the
// earlier kernel reads or writes; work that depends on neither (the GEMMs
// stream weights no kernel writes) can go first.
//
// The layer's GEMMs (v4) are launched that way. The kernels that run just
// before them (RMSNorm, flash attention, SiLU-mul) allow it at entry, so a
// GEMM's CTAs take the SMs' free slots and fill their weight rings while the
// earlier kernel still runs. Both calls are no-ops for kernels launched the
// ordinary way and on devices before Hopper.
#pragma once

namespace layerserve::kernels {

__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the grids this one depends on have completed and their memory
// operations are visible to this thread.
__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace layerserve::kernels
