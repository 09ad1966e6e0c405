// LaunchGemm and the host helpers behind it: parameter checks per version,
// device queries, TMA descriptors (cuTensorMapEncodeTiled reached through the
// runtime's driver entry point, so nothing links libcuda; remembered per
// thread) and the split-K heuristic.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels {
namespace gemm {

absl::StatusOr<DeviceInfo> CurrentDeviceInfo() {
  int device = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  DeviceInfo info;
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  LS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return info;
}

bool BuiltWithSm90a() {
#if defined(LAYERSERVE_GEMM_HAVE_SM90A)
  return true;
#else
  return false;
#endif
}

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

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

absl::StatusOr<CUtensorMap> MakeBf16TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows) {
  // The descriptor is a pure function of these four values (device addresses
  // are unified), so a remembered one is never stale, not even for memory
  // freed and allocated again at the same address. Serving repeats a few
  // hundred (weight or activation buffer, M) combinations, so most launches
  // skip the driver call. Per thread, so the launch path takes no lock (the
  // server drives each stream from its own thread); bounded: a full memo is
  // dropped and refills.
  constexpr size_t kMaxRemembered = 1024;
  using Key = std::tuple<const void*, int64_t, int64_t, int>;
  thread_local std::map<Key, CUtensorMap> remembered;
  const Key key{base, rows, cols, box_rows};
  if (const auto it = remembered.find(key); it != remembered.end()) return it->second;

  absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> encode = TensorMapEncoder();
  if (!encode.ok()) return encode.status();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};  // bytes, of dim 1
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = (*encode)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                                 box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(res),
                                            ") for [", rows, ", ", cols, "] box ", box_rows, "x64"));
  }
  if (remembered.size() >= kMaxRemembered) remembered.clear();
  remembered.emplace(key, map);
  return map;
}

int SmallMPad(int64_t m) {
  if (m <= 8) return 8;
  if (m <= 16) return 16;
  if (m <= 32) return 32;
  return 64;
}

// Version 4 is bound by HBM, not by the SMs: what matters is that every SM
// streams (tiles x splits >= SMs) while each CTA keeps a long run of k-blocks
// and clusters stay small. Measured on H100 (docs/perf-gemm.md): 4 splits
// beat 8 on every Llama-3-8B shape with N <= 6144 (8-CTA clusters cost ~4 us
// more), and N = 28672 needs no split. So: the smallest of 1, 2, 4 that
// covers the SMs, else 4.
int SplitKHeuristic(int64_t n, int64_t k, int num_sms) {
  const int64_t tiles = (n + 127) / 128;
  const int64_t num_kb = (k + 63) / 64;
  int splits = 4;
  for (int s : {1, 2}) {
    if (tiles * s >= num_sms) {
      splits = s;
      break;
    }
  }
  return static_cast<int>(std::min<int64_t>(splits, std::max<int64_t>(1, num_kb)));
}

}  // namespace gemm

std::string GemmConfigName(const GemmConfig& config) {
  switch (config.version) {
    case GemmVersion::kCublasLt:
      return "v0-cublaslt";
    case GemmVersion::kWarpSpecialized:
      return config.block_n > 0 ? absl::StrCat("v3-warp-specialized-bn", config.block_n) : "v3-warp-specialized";
    case GemmVersion::kSmallMSplitK:
      return config.split_k > 0 ? absl::StrCat("v4-split-k", config.split_k) : "v4-split-k";
    case GemmVersion::kClusterMulticast:
      return "v5-cluster-multicast";
  }
  return absl::StrCat("v?", static_cast<int>(config.version));
}

std::string GemmConfigSpec(const GemmConfig& config) {
  std::string spec = absl::StrCat("v", static_cast<int>(config.version));
  if (config.version == GemmVersion::kWarpSpecialized && config.block_n > 0) {
    absl::StrAppend(&spec, "b", config.block_n);
  } else if (config.version == GemmVersion::kSmallMSplitK && config.split_k > 0) {
    absl::StrAppend(&spec, "s", config.split_k);
  }
  return spec;
}

absl::StatusOr<GemmConfig> ParseGemmConfigSpec(std::string_view spec) {
  const std::string text(spec);
  const auto bad = [&text] {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemm configuration '", text, "' is not one of v0, v3, v3b128, v3b256, v4, v4s1..v4s8, v5"));
  };
  std::string_view rest = spec;
  if (!rest.empty() && rest.front() == 'v') rest.remove_prefix(1);
  if (rest.empty() || (rest.front() != '0' && (rest.front() < '3' || rest.front() > '5'))) return bad();
  GemmConfig config{static_cast<GemmVersion>(rest.front() - '0'), 0, 0};
  rest.remove_prefix(1);
  if (rest.empty()) return config;
  const char option = rest.front();
  rest.remove_prefix(1);
  int value = 0;
  for (const char c : rest) {
    if (c < '0' || c > '9' || value > 1000) return bad();
    value = value * 10 + (c - '0');
  }
  if (rest.empty()) return bad();
  if (config.version == GemmVersion::kWarpSpecialized && option == 'b' && (value == 128 || value == 256)) {
    config.block_n = value;
    return config;
  }
  if (config.version == GemmVersion::kSmallMSplitK && option == 's' && value >= 1 && value <= gemm::kMaxSplitK) {
    config.split_k = value;
    return config;
  }
  return bad();
}

namespace {

absl::Status CheckCommon(const GemmParams& p) {
  if (p.dtype != DType::kBF16) return absl::InvalidArgumentError("gemm: only bf16 is supported");
  if (p.a == nullptr || p.w == nullptr || p.c == nullptr) return absl::InvalidArgumentError("gemm: null operand");
  if (p.m < 1 || p.n < 1 || p.k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: bad shape m=", p.m, " n=", p.n, " k=", p.k));
  }
  return absl::OkStatus();
}

absl::Status CheckOurs(const GemmParams& p, const GemmConfig& config, const gemm::DeviceInfo& dev) {
  LS_GEMM_RETURN_IF_ERROR(CheckCommon(p));
  if (p.n % 8 != 0 || p.k % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: n and k must be multiples of 8 (n=", p.n, ", k=", p.k, ")"));
  }
  if (p.m > INT32_MAX / 2 || p.n > INT32_MAX / 2 || p.k > INT32_MAX / 2) {
    return absl::InvalidArgumentError("gemm: dimension too large");
  }
  if (!gemm::Aligned16(p.a) || !gemm::Aligned16(p.w) || !gemm::Aligned16(p.c) ||
      (p.residual != nullptr && !gemm::Aligned16(p.residual))) {
    return absl::InvalidArgumentError("gemm: operands must be 16-byte aligned");
  }
  switch (config.version) {
    case GemmVersion::kCublasLt:
      return absl::InvalidArgumentError("gemm: version 0 runs through CublasLtGemm, not LaunchGemm");
    case GemmVersion::kWarpSpecialized:
    case GemmVersion::kSmallMSplitK:
    case GemmVersion::kClusterMulticast:
      if (dev.cc_major != 9 || dev.cc_minor != 0) {
        return absl::UnimplementedError("gemm v3-v5 need a compute capability 9.0 (Hopper) device");
      }
      if (!gemm::BuiltWithSm90a()) return absl::UnimplementedError("gemm v3-v5: library built without sm_90a");
      if (config.version == GemmVersion::kSmallMSplitK && p.m > 64) {
        return absl::InvalidArgumentError("gemm v4 takes m <= 64");
      }
      if (config.split_k < 0 || config.split_k > gemm::kMaxSplitK) {
        return absl::InvalidArgumentError("gemm v4: split_k must be in [0, 8]");
      }
      if (config.block_n != 0 && config.block_n != 128 && config.block_n != 256) {
        return absl::InvalidArgumentError("gemm v3: block_n must be 0, 128 or 256");
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("gemm: unknown version");
}

int ResolveSplits(const GemmParams& p, const GemmConfig& config, const gemm::DeviceInfo& dev) {
  const int64_t num_kb = (p.k + 63) / 64;
  const int splits = config.split_k > 0 ? config.split_k : gemm::SplitKHeuristic(p.n, p.k, dev.num_sms);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(splits, num_kb)));
}

}  // namespace

absl::Status GemmSupported(const GemmParams& p, const GemmConfig& config) {
  if (config.version == GemmVersion::kCublasLt) return CheckCommon(p);
  absl::StatusOr<gemm::DeviceInfo> dev = gemm::CurrentDeviceInfo();
  if (!dev.ok()) return dev.status();
  return CheckOurs(p, config, *dev);
}

absl::Status LaunchGemm(const GemmParams& p, const GemmConfig& config, cudaStream_t stream) {
  absl::StatusOr<gemm::DeviceInfo> dev = gemm::CurrentDeviceInfo();
  if (!dev.ok()) return dev.status();
  LS_GEMM_RETURN_IF_ERROR(CheckOurs(p, config, *dev));
  switch (config.version) {
    case GemmVersion::kWarpSpecialized:
      return gemm::LaunchGemmV3(p, config.block_n, *dev, stream);
    case GemmVersion::kSmallMSplitK:
      return gemm::LaunchGemmV4(p, ResolveSplits(p, config, *dev), *dev, stream);
    case GemmVersion::kClusterMulticast:
      return gemm::LaunchGemmV5(p, *dev, stream);
    case GemmVersion::kCublasLt:
      break;
  }
  return absl::InvalidArgumentError("gemm: version not launchable through LaunchGemm");
}

}  // namespace layerserve::kernels
