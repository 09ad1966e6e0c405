// LaunchGemm and the checks and spellings around it: which calls our
// versions take (GemmSupported), mode and configuration spellings; and the
// GEMMs' TMA descriptors (over kernels/common/tensor_map.h). The route of a
// call and every sizing rule are in gemm_heuristics.cc.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/common/tensor_map.h"
#include "kernels/gemm/gemm_heuristics.h"
#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels {
namespace gemm {

namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

absl::StatusOr<CUtensorMap> MakeBf16TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows) {
  return MakeSw128TensorMap(base, rows, cols, cols, box_rows, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2);
}

absl::StatusOr<CUtensorMap> MakeFp8TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows) {
  return MakeSw128TensorMap(base, rows, cols, cols, box_rows, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1);
}

}  // namespace gemm

std::string_view Fp8ScalingName(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::kNone:
      return "bf16";
    case Fp8Scaling::kPerRow:
      return "row";
    case Fp8Scaling::kBlock:
      return "block";
  }
  return "unknown";
}

std::string GemmConfigName(const GemmConfig& config) {
  switch (config.version) {
    case GemmVersion::kCublasLt:
      return config.cublaslt_answer > 0 ? absl::StrCat("v0-cublaslt-answer", config.cublaslt_answer) : "v0-cublaslt";
    case GemmVersion::kWarpSpecialized:
      return absl::StrCat("v3-warp-specialized", config.block_n > 0 ? absl::StrCat("-bn", config.block_n) : "",
                          config.block_m > 0 ? absl::StrCat("-bm", config.block_m) : "");
    case GemmVersion::kSmallMSplitK:
      return config.split_k > 0 ? absl::StrCat("v4-split-k", config.split_k) : "v4-split-k";
    case GemmVersion::kClusterMulticast:
      return "v5-cluster-multicast";
    case GemmVersion::kFp8:
      return config.split_k > 0 ? absl::StrCat("v6-fp8-split-k", config.split_k) : "v6-fp8";
  }
  return absl::StrCat("v?", static_cast<int>(config.version));
}

std::string GemmConfigSpec(const GemmConfig& config) {
  std::string spec = absl::StrCat("v", static_cast<int>(config.version));
  if (config.version == GemmVersion::kWarpSpecialized && config.block_n > 0) {
    absl::StrAppend(&spec, "b", config.block_n);
  } else if ((config.version == GemmVersion::kSmallMSplitK || config.version == GemmVersion::kFp8) &&
             config.split_k > 0) {
    absl::StrAppend(&spec, "s", config.split_k);
  } else if (config.version == GemmVersion::kCublasLt && config.cublaslt_answer > 0) {
    absl::StrAppend(&spec, "a", config.cublaslt_answer);
  }
  return spec;
}

absl::StatusOr<GemmConfig> ParseGemmConfigSpec(std::string_view spec) {
  const std::string text(spec);
  const auto bad = [&text] {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm configuration '", text,
                     "' is not one of v0, v0a1..v0a7, v3, v3b128, v3b256, v4, v4s1..v4s8, v5, v6, v6s1..v6s8"));
  };
  std::string_view rest = spec;
  if (!rest.empty() && rest.front() == 'v') rest.remove_prefix(1);
  if (rest.empty() || (rest.front() != '0' && (rest.front() < '3' || rest.front() > '6'))) return bad();
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
  if ((config.version == GemmVersion::kSmallMSplitK || config.version == GemmVersion::kFp8) && option == 's' &&
      value >= 1 && value <= gemm::kMaxSplitK) {
    config.split_k = value;
    return config;
  }
  if (config.version == GemmVersion::kCublasLt && option == 'a' && value >= 1 && value < gemm::kCublasLtTunedAnswers) {
    config.cublaslt_answer = value;
    return config;
  }
  return bad();
}

bool GemmBuiltWithSm90a() {
#if defined(LAYERSERVE_GEMM_HAVE_SM90A)
  return true;
#else
  return false;
#endif
}

std::string_view GemmModeName(GemmMode mode) {
  switch (mode) {
    case GemmMode::kAuto:
      return "auto";
    case GemmMode::kCublasLt:
      return "cublaslt";
    case GemmMode::kCustom:
      return "custom";
  }
  return "unknown";
}

absl::StatusOr<GemmMode> ParseGemmMode(std::string_view name) {
  for (const GemmMode mode : {GemmMode::kAuto, GemmMode::kCublasLt, GemmMode::kCustom}) {
    if (name == GemmModeName(mode)) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("gemm mode '", std::string(name), "' is not one of auto, cublaslt, custom"));
}

absl::Status GemmSupported(const GemmParams& p, const GemmConfig& config, const DeviceInfo& dev) {
  if (config.version == GemmVersion::kCublasLt) {
    return absl::InvalidArgumentError("gemm: version 0 is cuBLASLt, not one of our kernels");
  }
  if (!dev.IsHopper()) {
    return absl::UnimplementedError(absl::StrCat("gemm v3-v5 need a compute capability 9.0 (Hopper) device, got ",
                                                 dev.cc_major, ".", dev.cc_minor));
  }
  if (!GemmBuiltWithSm90a()) return absl::UnimplementedError("gemm v3-v6: library built without sm_90a");
  if (p.dtype != DType::kBF16) return absl::InvalidArgumentError("gemm v3-v6 take bf16 (out) only");
  if ((p.fp8 != Fp8Scaling::kNone) != (config.version == GemmVersion::kFp8)) {
    return absl::InvalidArgumentError("gemm: FP8 products take version 6, and version 6 takes only them");
  }
  if (p.bias != nullptr && (config.version != GemmVersion::kFp8 || p.grouped() || p.silu_mul)) {
    return absl::InvalidArgumentError(
        "gemm: of our kernels only version 6 has a bias epilogue, for dense products without silu_mul");
  }
  if (p.bias != nullptr && !gemm::Aligned16(p.bias)) return absl::InvalidArgumentError("gemm v6: unaligned bias");
  if (p.a == nullptr || p.w == nullptr || p.d == nullptr) return absl::InvalidArgumentError("gemm: null operand");
  if (p.m < 1 || p.n < 1 || p.k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: bad shape m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.lda != p.k || p.ldw != p.k || p.ldd != p.out_cols()) {
    return absl::InvalidArgumentError(
        "gemm v3-v5 take dense operands (lda = ldw = k, ldd = n, or n / 2 with silu_mul)");
  }
  if (p.silu_mul && config.version == GemmVersion::kClusterMulticast) {
    return absl::InvalidArgumentError("gemm v5 has no silu_mul epilogue");
  }
  if (p.silu_mul && (p.n % 16 != 0 || p.accumulate)) {
    return absl::InvalidArgumentError("gemm: silu_mul takes n a multiple of 16 and no accumulate");
  }
  if (p.n % 8 != 0 || p.k % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: n and k must be multiples of 8 (n=", p.n, ", k=", p.k, ")"));
  }
  if (p.m > INT32_MAX / 2 || p.n > INT32_MAX / 2 || p.k > INT32_MAX / 2) {
    return absl::InvalidArgumentError("gemm: dimension too large");
  }
  if (!gemm::Aligned16(p.a) || !gemm::Aligned16(p.w) || !gemm::Aligned16(p.d)) {
    return absl::InvalidArgumentError("gemm: operands must be 16-byte aligned");
  }
  if (p.grouped()) {
    if (p.groups < 1 || p.groups > kMaxGemmGroups) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm: a grouped product takes 1 to ", kMaxGemmGroups, " groups, got ", p.groups));
    }
    if (p.max_group_rows < 1 || p.max_group_rows > p.m) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm: max_group_rows ", p.max_group_rows, " must be in [1, m = ", p.m, "]"));
    }
    if (int64_t{p.groups} * p.n > INT32_MAX / 2) return absl::InvalidArgumentError("gemm: groups x n too large");
    if (config.version == GemmVersion::kClusterMulticast) {
      return absl::InvalidArgumentError("gemm v5 has no grouped form");
    }
  }
  switch (config.version) {
    case GemmVersion::kSmallMSplitK:
      if ((p.grouped() ? p.max_group_rows : p.m) > 64) {
        return absl::InvalidArgumentError("gemm v4 takes m (a grouped product: max_group_rows) <= 64");
      }
      if (config.split_k < 0 || config.split_k > gemm::kMaxSplitK) {
        return absl::InvalidArgumentError("gemm v4: split_k must be in [0, 8]");
      }
      return absl::OkStatus();
    case GemmVersion::kWarpSpecialized:
      if (config.block_n != 0 && config.block_n != 128 && config.block_n != 256) {
        return absl::InvalidArgumentError("gemm v3: block_n must be 0, 128 or 256");
      }
      if (config.block_m != 0 && config.block_m != 128 && (config.block_m != 64 || !p.grouped())) {
        return absl::InvalidArgumentError("gemm v3: block_m must be 0 or 128 (or 64 for a grouped product)");
      }
      return absl::OkStatus();
    case GemmVersion::kClusterMulticast:
      return absl::OkStatus();
    case GemmVersion::kFp8:
      if (p.a_scale == nullptr || p.w_scale == nullptr) return absl::InvalidArgumentError("gemm v6: null scales");
      if (!gemm::Aligned16(p.w_scale)) return absl::InvalidArgumentError("gemm v6: w_scale must be 16-byte aligned");
      if (p.n % 16 != 0 || p.k % 16 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("gemm v6: n and k must be multiples of 16 (n=", p.n, ", k=", p.k, ")"));
      }
      if (p.silu_mul && p.n % (2 * kFp8GateUpBlock) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("gemm v6: silu_mul needs n a multiple of ", 2 * kFp8GateUpBlock, ", got ", p.n));
      }
      if (config.split_k < 0 || config.split_k > gemm::kMaxSplitK) {
        return absl::InvalidArgumentError("gemm v6: split_k must be in [0, 8]");
      }
      if (config.block_m != 0 && ((config.block_m != 64 && config.block_m != 128) || !p.grouped())) {
        return absl::InvalidArgumentError("gemm v6: block_m must be 0 (or 64 or 128 for a grouped product)");
      }
      return absl::OkStatus();
    case GemmVersion::kCublasLt:
      break;
  }
  return absl::InvalidArgumentError("gemm: unknown version");
}

absl::Status LaunchGemm(const GemmParams& p, const GemmConfig& config, const DeviceInfo& dev, cudaStream_t stream) {
  if (absl::Status supported = GemmSupported(p, config, dev); !supported.ok()) return supported;
  gemm::DenseGemm dense;
  dense.a = p.a;
  dense.w = p.w;
  dense.c = p.d;
  dense.residual = p.accumulate ? p.d : nullptr;
  dense.bias = p.bias;
  dense.m = p.m;
  dense.n = p.n;
  dense.k = p.k;
  dense.group_offsets = p.group_offsets;
  dense.groups = p.groups;
  dense.max_group_rows = p.max_group_rows;
  dense.silu_mul = p.silu_mul;
  dense.fp8 = p.fp8;
  dense.a_scale = p.a_scale;
  dense.w_scale = p.w_scale;
  switch (config.version) {
    case GemmVersion::kWarpSpecialized:
      return gemm::LaunchGemmV3(dense, config.block_n, config.block_m, dev, stream);
    case GemmVersion::kSmallMSplitK:
      return gemm::LaunchGemmV4(dense, gemm::SmallMSplits(p, config, dev.num_sms), dev, stream);
    case GemmVersion::kClusterMulticast:
      return gemm::LaunchGemmV5(dense, dev, stream);
    case GemmVersion::kFp8:
      return gemm::LaunchGemmV6(dense, gemm::Fp8ResolvedSplits(dense, config, dev.num_sms), config.block_m, dev,
                                stream);
    case GemmVersion::kCublasLt:
      break;
  }
  return absl::InvalidArgumentError("gemm: version not launchable through LaunchGemm");
}

}  // namespace layerserve::kernels
