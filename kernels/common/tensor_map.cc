// MakeSw128TensorMap (tensor_map.h).
#include "kernels/common/tensor_map.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {
namespace {

absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> TensorMapEncoder() {
  // Resolved once; the driver entry point is process-wide.
  static const absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> encoder =
      []() -> absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    LS_CUDA_RETURN_IF_ERROR(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query));
    if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
      return absl::UnimplementedError("driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// Every map of the project: 2-D, boxes of box_rows x box_bytes, zero fill
// outside the matrix. The descriptor is a pure function of these values
// (device addresses are unified), so a remembered one is never stale, not
// even for memory freed and allocated again at the same address. Serving
// repeats a few hundred (buffer, rows) combinations, so most launches skip
// the driver call. Per thread, so the launch path takes no lock (the server
// drives each stream from its own thread); bounded: a full memo is dropped
// and refills.
absl::StatusOr<CUtensorMap> MakeTensorMap(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                          int box_rows, int box_bytes, CUtensorMapDataType type, int element_bytes,
                                          CUtensorMapSwizzle swizzle) {
  constexpr size_t kMaxRemembered = 1024;
  using Key = std::tuple<const void*, int64_t, int64_t, int64_t, int, int, int, int, int>;
  thread_local std::map<Key, CUtensorMap> remembered;
  const Key key{base,
                rows,
                cols,
                row_stride,
                box_rows,
                box_bytes,
                static_cast<int>(type),
                element_bytes,
                static_cast<int>(swizzle)};
  if (const auto it = remembered.find(key); it != remembered.end()) return it->second;

  absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> encode = TensorMapEncoder();
  if (!encode.ok()) return encode.status();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * element_bytes};  // bytes, of dim 1
  const cuuint32_t box_cols = static_cast<cuuint32_t>(box_bytes / element_bytes);
  const cuuint32_t box[2] = {box_cols, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = (*encode)(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(res),
                                            ") for [", rows, ", ", cols, "] (row stride ", row_stride, ") box ",
                                            box_rows, "x", box_cols));
  }
  if (remembered.size() >= kMaxRemembered) remembered.clear();
  remembered.emplace(key, map);
  return map;
}

}  // namespace

absl::StatusOr<CUtensorMap> MakeSw128TensorMap(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                               int box_rows, CUtensorMapDataType type, int element_bytes) {
  return MakeTensorMap(base, rows, cols, row_stride, box_rows, 128, type, element_bytes, CU_TENSOR_MAP_SWIZZLE_128B);
}

absl::StatusOr<CUtensorMap> MakeByteTensorMap(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                              int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  return MakeTensorMap(base, rows, cols, row_stride, box_rows, box_cols, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, swizzle);
}

}  // namespace layerserve::kernels
