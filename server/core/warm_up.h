// Warm-up batches: synthetic work a backend runs through its own Execute
// before serving, so that what it does lazily on first use (a CUDA kernel's
// module load, cuBLASLt's plan of a GEMM shape, a first allocation) happens
// before the first request of each size instead of during it. The CUDA
// backend runs them at construction and once its KV cache exists
// (CudaBackendOptions::warm_up); any backend could.
//
// Each batch is one FP32 sequence of zeros, executed and waited for in
// turn; the outputs are dropped. Zeros keep every value finite, so routing,
// softmax and norms take their ordinary paths.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "server/core/backend.h"

namespace layerserve {

// The token counts of the stateless warm-up batches, ascending: every count
// from 1 to `every_up_to`, then each entry of `bucket_uppers` (ascending)
// above it, all capped at `max_batch_tokens` (>= 1). A GEMM library plans
// each exact shape and may pick another kernel for it (cuBLASLt's heuristic
// runs per M), so a first batch of 27 tokens pays its own first use even
// after one of 32 ran; one-token decode batches of up to a few hundred
// sessions take every count up to there.
std::vector<int64_t> WarmUpSizes(int64_t max_batch_tokens, int64_t every_up_to,
                                 std::span<const int64_t> bucket_uppers);

// One stateless batch per entry of `tokens`: a sequence of that many tokens
// of `hidden` zeros. The first failure is returned, prefixed "warm-up batch
// of N tokens: ".
absl::Status WarmUpStateless(Backend& backend, int64_t hidden, std::span<const int64_t> tokens);

// One session step of one token at position min(128, the pool's tokens - 1)
// over blocks 0, 1, ... of the pool (a session id no client can hold mid-
// start-up: nothing is registered in any session table). With 128 cached
// tokens a split-KV plan splits, so its combine runs too. The step reads
// whatever those blocks hold and writes one row, which a real session,
// storing its rows before it reads them, never sees. Does nothing for a
// pool of fewer than 2 tokens.
absl::Status WarmUpSessionStep(Backend& backend, int64_t hidden, const KvCacheShape& cache);

}  // namespace layerserve
