// TMA descriptors (CUtensorMap) over row-major device matrices, for every
// kernel that loads tiles with the tensor memory accelerator (the GEMMs, the
// paged attention). Host code; nothing links libcuda: the encoder is the
// driver's cuTensorMapEncodeTiled, reached through the runtime's entry point.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "absl/status/statusor.h"

namespace layerserve::kernels {

// A 2-D tensor map over [rows, cols] elements of element_bytes each, rows
// row_stride elements apart (cols contiguous; base and the stride in bytes
// multiples of 16), with boxes of box_rows x (128 bytes) under the 128-byte
// swizzle, zero fill outside the matrix. Remembered per thread by its
// arguments, so repeated launches on the same buffers skip the encode.
absl::StatusOr<CUtensorMap> MakeSw128TensorMap(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                               int box_rows, CUtensorMapDataType type, int element_bytes);

// The same over bytes (e.g. e4m3 codes), with boxes of box_rows x box_cols
// bytes (box_cols a multiple of 16, at most 128 with a swizzle) under
// `swizzle`: the FP8 KV cache's tiles (paged_attention.cuh).
absl::StatusOr<CUtensorMap> MakeByteTensorMap(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                              int box_rows, int box_cols, CUtensorMapSwizzle swizzle);

}  // namespace layerserve::kernels
