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
// earlier kernel still runs. RMSNorm, RoPE (alone or with the KV-cache
// write) and the paged attention are launched that way too: they have
// nothing to do before the wait, but their launch is then processed while
// the kernel ahead still runs, instead of in the gap after it. Both calls
// are no-ops for kernels launched the ordinary way and on devices before
// Hopper.
//
// Every kernel launched as a dependent calls WaitForPrerequisiteGrids before
// it can finish, so "complete" stays transitive along a stream: a kernel's
// wait covers every kernel before it, not just the one ahead.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace layerserve::kernels {

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...) as a
// programmatic dependent of the kernel ahead of it on `stream` (after a copy
// or an event it starts as an ordinary launch would), in clusters of
// `cluster_x` CTAs along x (0: launched without clusters; a kernel that
// uses cluster operations gets 1 or more).
template <typename... Params, typename... Args>
cudaError_t LaunchDependentInClusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                      unsigned cluster_x, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = cluster_x;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = cluster_x > 0 ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                            Args&&... args) {
  return LaunchDependentInClusters(kernel, grid, block, smem_bytes, 0, stream, std::forward<Args>(args)...);
}

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
