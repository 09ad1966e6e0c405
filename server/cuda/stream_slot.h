// One stream of the CUDA backend's pool and everything it owns: its
// activation arena, the batch's staging on the device and in pinned host
// memory, its cuBLASLt workspace, its op timer, its CUDA graphs and the
// event its thread waits on. All allocated once, by MakeStreamSlot, so the
// request path never calls cudaMalloc; touched only by the stream's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "base/cuda/cuda_resources.h"
#include "base/thread_pool.h"
#include "server/cuda/forward_graphs.h"
#include "server/cuda/kernel_timing.h"
#include "server/cuda/layer_executor.h"

namespace layerserve::cuda {

struct StreamSlot {
  int index = 0;  // in the pool of streams (its KvPool staging)
  CudaStream stream;
  CudaEvent done;  // recorded after the copy-out; the thread waits on it
  ActivationArena arena;
  DeviceBuffer io_device;  // wire-dtype inputs, then outputs, of the batch
  PinnedBuffer io_host;
  PinnedBuffer meta_host;  // positions [tokens] then cu_seqlens [num_seqs + 1]
  // A mixture of experts: each layer's tokens per expert, copied back with
  // the outputs (ActivationArena::expert_tokens).
  PinnedBuffer expert_tokens_host;
  // Copies large batches' tensors to and from io_host (BatchStaging); the
  // stream's thread is one of its threads.
  std::unique_ptr<ThreadPool> copy_pool;
  DeviceBuffer workspace;  // the GEMM router's
  OpTimer timer;
  // Captured Forwards of small batches (forward_graphs.h).
  std::unique_ptr<ForwardGraphs> graphs;
};

struct StreamSlotOptions {
  int64_t max_tokens = 0;  // the largest batch, in tokens
  int num_layers = 0;
  size_t workspace_bytes = 0;
  int copy_threads = 1;        // the copy pool's, the stream's thread included
  bool blocking_wait = false;  // CudaBackendOptions::blocking_wait
};

// Allocates slot `index` for batches of `shape` (INTERNAL on device
// failures, out of memory included).
absl::StatusOr<std::unique_ptr<StreamSlot>> MakeStreamSlot(int index, const LayerShape& shape,
                                                           const StreamSlotOptions& options);

}  // namespace layerserve::cuda
