// Launchers of the paged KV cache's kernels (paged_attention.h): validation,
// the attention's tensor maps, grid math and dtype / head_dim dispatch. The device code is in
// paged_attention.cuh, the plan (host only) in paged_plan.cc.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/attention/paged_attention.cuh"
#include "kernels/common/static_switch.h"
#include "kernels/common/tensor_map.h"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels {
namespace {

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// What both kernels need: the packing, the cache, the head shape. Rows move in
// vectors of up to 16 bytes, so every row must start 16-byte aligned.
absl::Status ValidateCommon(const char* name, const PagedKv& cache, const int32_t* cu_seqlens, int num_seqs,
                            int64_t tokens, int num_kv_heads, int head_dim, DType dtype) {
  if (head_dim != 64 && head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": head_dim must be 64 or 128, got ", head_dim));
  }
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype must be bf16 or fp16"));
  }
  if (num_kv_heads <= 0 || tokens < 0 || tokens >= (int64_t{1} << 31) || num_seqs < 0 ||
      (tokens > 0 && num_seqs == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": num_kv_heads must be positive, tokens in [0, 2^31) and, with tokens, num_seqs >= 1"));
  }
  if (cache.block_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": block_tokens must be positive"));
  }
  if (cu_seqlens == nullptr || cache.k == nullptr || cache.v == nullptr || cache.start == nullptr ||
      cache.cu_blocks == nullptr || cache.block_tables == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": cu_seqlens and the cache's k, v, start, cu_blocks and block_tables must be set"));
  }
  if (!Aligned16(cache.k) || !Aligned16(cache.v)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the cache's k and v pools must be 16-byte aligned"));
  }
  // An FP8 cache's loads: V groups of 16 keys, none straddling a block.
  if (cache.fp8 && cache.block_tokens % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": an FP8 cache needs block_tokens a multiple of 16, got ", cache.block_tokens));
  }
  return absl::OkStatus();
}

// A row pointer and stride: 16-byte aligned rows of at least `width` elements.
bool RowsOk(const void* ptr, int64_t row_stride, int64_t width) {
  return ptr != nullptr && Aligned16(ptr) && row_stride % 8 == 0 && row_stride >= width;
}

#if defined(LAYERSERVE_ATTENTION_HAVE_SM90A)
// The attention, then (with split items) the combine. Both launched as
// programmatic dependents (kernels/common/pdl.cuh): the combine's CTAs are
// scheduled as the attention's last CTAs start and wait for its results on
// the device, instead of the stream's launch gap after it (a few us, much of
// a one-sequence decode step's attention).
template <typename T, int kHeadDim, bool kCodes>
absl::Status Launch(const PagedAttentionParams& p, const paged::PagedKvMaps& maps, cudaStream_t stream) {
  constexpr int kSmemBytes = paged::PagedTraits<kHeadDim>::kSmemBytes;
  // Above 48 KiB a kernel must opt in to its dynamic shared memory.
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(paged::PagedAttentionKernel<T, kHeadDim, kCodes>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(p.num_kv_heads));
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(paged::PagedAttentionKernel<T, kHeadDim, kCodes>, grid,
                                          dim3(paged::kPagedThreads), kSmemBytes, stream, p, maps));
  if (p.num_combines > 0) {
    const dim3 combine_grid(static_cast<unsigned>(p.num_combines), static_cast<unsigned>(p.num_kv_heads));
    LS_CUDA_RETURN_IF_ERROR(LaunchDependent(paged::PagedCombineKernel<T, kHeadDim>, combine_grid,
                                            dim3(paged::kCombineThreads), 0, stream, p));
  }
  return absl::OkStatus();
}
#endif

}  // namespace

absl::Status LaunchRopeKvAppend(const RopeParams& rope, const KvAppendParams& append, cudaStream_t stream) {
  LS_RETURN_IF_ERROR(rope::ValidateRopeParams(rope));
  LS_RETURN_IF_ERROR(ValidateCommon("rope + kv append", append.cache, append.cu_seqlens, append.num_seqs, rope.tokens,
                                    rope.num_kv_heads, rope.head_dim, rope.dtype));
  if (rope.tokens == 0) return absl::OkStatus();
  return LS_HALF_DTYPE_SWITCH(rope.dtype, T, [&]() -> absl::Status {
    LS_CUDA_RETURN_IF_ERROR(LaunchDependent(paged::RopeKvAppendKernel<T>, dim3(static_cast<unsigned>(rope.tokens)),
                                            dim3(paged::kAppendThreads), rope::CosSinBytes(rope.head_dim), stream, rope,
                                            append));
    return absl::OkStatus();
  });
}

absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = ValidateCommon("paged attention", p.cache, p.cu_seqlens, p.num_seqs, p.tokens, p.num_kv_heads,
                                      p.head_dim, p.dtype);
      !s.ok()) {
    return s;
  }
  if (p.num_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: num_heads (", p.num_heads,
                                                   ") must be a positive multiple of num_kv_heads (", p.num_kv_heads,
                                                   ")"));
  }
  if (p.num_kv_heads > 65535) {
    return absl::InvalidArgumentError("paged attention: num_kv_heads must be <= 65535 (grid limit)");
  }
  if (p.window < 0 || !(p.softmax_scale > 0.f)) {
    return absl::InvalidArgumentError("paged attention: window must be >= 0 and softmax_scale positive");
  }
  const int64_t q_width = int64_t{p.num_heads} * p.head_dim;
  const int64_t kv_width = int64_t{p.num_kv_heads} * p.head_dim;
  if (!RowsOk(p.q, p.q_row_stride, q_width) || !RowsOk(p.out, p.out_row_stride, q_width) ||
      !RowsOk(p.k, p.k_row_stride, kv_width) || !RowsOk(p.v, p.v_row_stride, kv_width)) {
    return absl::InvalidArgumentError(
        "paged attention: q, k, v and out must be set and 16-byte aligned, with row strides multiples of 8 "
        "covering a row");
  }
  if (p.num_items < 0 || p.num_combines < 0 || (p.num_items > 0 && p.items == nullptr) ||
      (p.num_combines > 0 && (p.combines == nullptr || p.partial_out == nullptr || p.partial_lse == nullptr))) {
    return absl::InvalidArgumentError(
        "paged attention: the plan's items (and, with combine tasks, the tasks and the partial workspace) must be "
        "set");
  }
  if (p.tokens > 0 && p.num_items == 0) {
    return absl::InvalidArgumentError("paged attention: tokens but no work items (plan the batch first)");
  }
  if (!Aligned16(p.partial_out)) {
    return absl::InvalidArgumentError("paged attention: partial_out must be 16-byte aligned");
  }
  if (p.cache.num_blocks <= 0) {
    return absl::InvalidArgumentError("paged attention: the cache's num_blocks must be positive");
  }
  if (p.tokens == 0) return absl::OkStatus();
#if !defined(LAYERSERVE_ATTENTION_HAVE_SM90A)
  return absl::UnimplementedError("paged attention: built without sm_90a (its K/V loads are TMA)");
#else
  // The K/V boxes: runs of gcd(block_tokens, 64) keys, one cache block's or
  // the step's rows (paged_attention.cuh).
  const int box = paged::PagedKvBoxRows(p.cache.block_tokens);
  paged::PagedKvMaps maps;
  const auto make_map = [&](CUtensorMap* map, const void* base, int64_t rows, int64_t stride) -> absl::Status {
    absl::StatusOr<CUtensorMap> made =
        MakeSw128TensorMap(base, rows, kv_width, stride, box, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2);
    if (!made.ok()) return made.status();
    *map = *made;
    return absl::OkStatus();
  };
  const int64_t pool_rows = p.cache.num_blocks * p.cache.block_tokens;
  if (p.cache.fp8) {
    // The K codes in boxes of `box` rows x head_dim bytes, swizzled as
    // CodeSwizzle reads them (the V groups are plain bulk copies).
    LS_ASSIGN_OR_RETURN(maps.k_pool,
                        MakeByteTensorMap(p.cache.k, pool_rows, kv_width, kv_width, box, p.head_dim,
                                          p.head_dim == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B));
    maps.v_pool = maps.k_pool;  // unused: never prefetched from garbage
  } else {
    LS_RETURN_IF_ERROR(make_map(&maps.k_pool, p.cache.k, pool_rows, kv_width));
    LS_RETURN_IF_ERROR(make_map(&maps.v_pool, p.cache.v, pool_rows, kv_width));
  }
  LS_RETURN_IF_ERROR(make_map(&maps.k_rows, p.k, p.tokens, p.k_row_stride));
  LS_RETURN_IF_ERROR(make_map(&maps.v_rows, p.v, p.tokens, p.v_row_stride));
  return LS_HALF_DTYPE_SWITCH(p.dtype, T, [&]() -> absl::Status {
    return LS_HEAD_DIM_SWITCH(p.head_dim, kHeadDim, [&]() -> absl::Status {
      if (p.cache.fp8) return Launch<T, kHeadDim, true>(p, maps, stream);
      return Launch<T, kHeadDim, false>(p, maps, stream);
    });
  });
#endif
}

}  // namespace layerserve::kernels
