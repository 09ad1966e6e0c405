// Device-side random initialisation for the layer benchmark: fills bf16
// buffers on the GPU so an 8B-shaped layer needs no checkpoint and no host
// round trip. Not a statistical RNG: a splitmix64 hash of (seed, index).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace layerserve::bench {

// dst[i] = center + half_width * u_i with u_i uniform in [-1, 1), as bf16.
absl::Status FillUniformBf16(void* dst, int64_t n, uint64_t seed, float center, float half_width, cudaStream_t stream);

}  // namespace layerserve::bench
