// The CPU backend: the reference implementation of a decoder-layer span, and
// the backend CI and machines without a GPU serve with.
//
// Weights are converted to float32 once at construction. Each batch runs on
// the backend's own worker thread (one batch in flight), so the batcher keeps
// queueing while it computes. Projections are single BLAS GEMMs over all
// packed tokens; attention runs per sequence and head.
//
// Sessions keep their keys and values in a paged KV cache (kv_cache.h) in
// host memory, float32 or FP8 (kv_cache_dtype.h), allocated once by AllocateKvCache and sized by
// the caller from KvBlockBytes and KvMemoryAvailable (the OS's available
// memory). Each session step writes its new rows there and attends over the
// rows earlier steps wrote.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/core/backend.h"
#include "server/core/kv_cache_dtype.h"
#include "server/model/model.h"

namespace layerserve {

struct CpuBackendOptions {
  int num_threads = 0;  // BLAS and attention threads; 0 = all cores
  KvCacheDType kv_cache_dtype = KvCacheDType::kActivation;  // --kv-cache-dtype
};

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const ModelSpan& model,
                                                        const CpuBackendOptions& options);

}  // namespace layerserve
