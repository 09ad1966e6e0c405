// The CUDA backend: serves a decoder-layer span on one GPU.
//
// Weights are uploaded once at construction (bf16, or fp16 for fp16
// checkpoints; q/k/v and gate/up fused). Batches run on a pool of streams:
// each stream owns its activation arena, pinned host staging, cuBLASLt
// workspace and events, all allocated here, so the request path never calls
// cudaMalloc. Each stream has one thread that takes the next queued batch,
// packs its inputs into pinned memory, launches copy-in, the layers and
// copy-out on its stream, waits for the stream's event, fills the outputs
// and calls `done` (stream_pool.h, with the batch's parts in stream_slot.h,
// batch_staging.h and batch_launch.h).
// Execute only queues, so it never blocks its caller; with num_streams
// streams, that many batches overlap (MaxInflightBatches). Small batches
// replay their layers as CUDA graphs, one per batch shape and stream
// (forward_graphs.h). Before serving, the backend warms up: a batch of zeros
// of every size up to 256 tokens, one per GEMM token-count bucket above, and
// a session step once the KV cache exists, so that kernel loading and
// cuBLASLt's planning of each shape happen then, not on the first requests
// of each size.
//
// Sessions (docs/sessions.md): AllocateKvCache makes one paged KV pool on the
// device (kv_pool.h), shared by the streams; a batch with session steps
// rotates at the sequences' absolute positions, stores their new K/V in the
// pool and attends over it (layer_executor.h).
//
// A failed batch fails alone (its `done` gets the error, usually INTERNAL).
// A sticky device error (illegal address, device assert, ...) corrupts the
// CUDA context for good: Health() then returns it permanently, later batches
// fail with UNAVAILABLE, and the frontend reports NOT_SERVING.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"
#include "server/core/backend.h"
#include "server/core/kv_cache_dtype.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/kernel_timing.h"
#include "server/model/model.h"

namespace layerserve {

struct CudaBackendOptions {
  int device = 0;       // CUDA device ordinal
  int num_streams = 2;  // batches in flight at once
  // Threads per stream (its own included) that copy a large batch's tensors
  // to and from pinned memory (batches that move 256 KiB or more).
  int host_copy_threads = 4;
  // Largest batch (sum of B*T over its requests); sizes each stream's arena.
  int64_t max_batch_tokens = 8192;
  // Batches of up to this many tokens run as CUDA graphs (forward_graphs.h)
  // when no other batch is computing, except those timed per op; 0: none.
  int64_t cuda_graph_max_tokens = 256;
  // Before serving, run a batch of zeros per GEMM bucket (and, once the KV
  // cache exists, a session step), so that no request waits for a kernel
  // module to load or cuBLASLt to plan a shape.
  bool warm_up = true;
  // How a stream's thread waits for its batch: false spins on the event
  // (the CUDA default with a single context: the fastest wake-up, but a core
  // busy for the whole batch); true blocks on it (cudaEventBlockingSync:
  // the driver wakes the thread, which leaves the core to gRPC meanwhile).
  bool blocking_wait = false;
  // Receives per-op device times of sampled batches; not owned, must outlive
  // the backend. Null: no timing.
  KernelTimingSink* timing_sink = nullptr;
  // Times one batch in this many (the events cost a little); 0 never.
  int timing_sample_every = 16;
  // Which GEMM implementation serves each projection shape (the kernel
  // library's GemmRouter): auto
  // takes our Hopper kernels only where they match cuBLASLt; cublaslt and
  // custom force one side, for comparison. Off Hopper everything is cuBLASLt.
  kernels::GemmMode gemm_mode = kernels::GemmMode::kAuto;
  // Auto mode: where its per-shape table comes from (cache file, autotune
  // pass at load, pins); see gemm_tuning.h.
  cuda::GemmTuningOptions gemm_tuning;
  // What the KV cache stores (--kv-cache-dtype): the activation dtype, or
  // FP8 codes and scales (server/core/kv_cache_dtype.h; block_tokens a
  // multiple of 16).
  KvCacheDType kv_cache_dtype = KvCacheDType::kActivation;
};

class CudaBackend : public Backend {
 public:
  // Weight bytes held on the device.
  virtual size_t WeightBytes() const = 0;
  // Device bytes of the stream pool: arenas, staging and GEMM workspaces.
  virtual size_t ActivationBytes() const = 0;
  // Memory in use on the whole device (cudaMemGetInfo: total - free), which
  // includes the CUDA context and other processes. Callable from any thread.
  virtual absl::StatusOr<int64_t> DeviceMemoryUsedBytes() const = 0;
  // The kernel each projection shape runs per token-count bucket, as the
  // GEMM router chose at load (what the start-up log's table says).
  virtual const std::vector<cuda::GemmRoute>& GemmRoutes() const = 0;
};

// True when the CUDA runtime sees at least one device (for --backend=auto).
bool CudaDeviceAvailable();

// Validates the model and options (INVALID_ARGUMENT), uploads the weights and
// allocates the stream pool (INTERNAL on device failures, out of memory
// included). Logs (base/log.h) the GEMM table and one line with the bytes
// uploaded.
absl::StatusOr<std::unique_ptr<CudaBackend>> MakeCudaBackend(const ModelSpan& model,
                                                             const CudaBackendOptions& options);

}  // namespace layerserve
