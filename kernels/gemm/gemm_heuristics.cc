// The GEMMs' launch decisions; each rule, its worked example and its design
// record are stated once, in gemm_heuristics.h (ChooseGemm's, the M buckets'
// and CublasLtTakesFp8's in layerserve/kernels/gemm.h).
#include "kernels/gemm/gemm_heuristics.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels {
namespace gemm {
namespace {

// Fraction of the last wave's SM slots that hold a tile.
double WaveEfficiency(int64_t tiles, int num_sms) {
  const int64_t waves = (tiles + num_sms - 1) / num_sms;
  return static_cast<double>(tiles) / static_cast<double>(waves * num_sms);
}

}  // namespace

int SmallMPad(int64_t m) {
  if (m <= 8) return 8;
  if (m <= 16) return 16;
  if (m <= 32) return 32;
  return 64;
}

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

int SmallMSplits(const GemmParams& p, const GemmConfig& config, int num_sms) {
  const int64_t num_kb = (p.k + 63) / 64;
  // A grouped product's CTAs: its W tiles times the groups that can have
  // rows, at most one per row.
  const int64_t w_rows = p.grouped() ? p.n * std::min<int64_t>(p.groups, p.m) : p.n;
  const int splits = config.split_k > 0 ? config.split_k : SplitKHeuristic(w_rows, p.k, num_sms);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(splits, num_kb)));
}

int64_t TileBound(const DenseGemm& p, int block_n, int block_m) {
  const int64_t tiles_n = (p.n + block_n - 1) / block_n;
  if (p.group_offsets == nullptr) return (p.m + block_m - 1) / block_m * tiles_n;
  // Each group with rows has a partial row tile at most, besides its full ones.
  return (p.m / block_m + std::min<int64_t>(p.groups, p.m)) * tiles_n;
}

int AutoBlockMV3(const DenseGemm& p) {
  // Groups of a few dozen rows (a mixture of experts at ~128 tokens) fill
  // little of a 128-row tile; 64-row tiles waste half as much but move twice
  // the W per flop: faster at a few dozen rows per group, slower from 256.
  // Design record 0009.
  return p.group_offsets != nullptr && p.m < int64_t{128} * p.groups ? 64 : 128;
}

int AutoBlockNV3(int64_t m, int64_t n, int num_sms) {
  const int64_t tiles_m = (m + 127) / 128;
  const double e256 = WaveEfficiency(tiles_m * ((n + 255) / 256), num_sms);
  const double e128 = WaveEfficiency(tiles_m * ((n + 127) / 128), num_sms);
  // The wider tile moves a third less data per flop; it wins ties.
  return e128 > e256 + 0.05 ? 128 : 256;
}

V3Tiles ResolveV3Tiles(const DenseGemm& p, int block_n, int block_m, int num_sms) {
  if (block_m == 0) block_m = AutoBlockMV3(p);
  // A grouped product's row tiles are only known on the device; its bound
  // stands in for them.
  if (block_n == 0) block_n = AutoBlockNV3(TileBound(p, 256, 128) / ((p.n + 255) / 256) * 128, p.n, num_sms);
  return {block_n, block_m};
}

int Fp8TokenTile(int64_t m) { return m <= 64 ? SmallMPad(m) : 128; }

bool Fp8DecodeKernelTakes(const DenseGemm& p, int block_m) {
  if (p.group_offsets == nullptr) return p.m <= 64;
  return block_m == 0 ? p.max_group_rows <= kFp8GroupedDecodeRows : block_m == 64;
}

int Fp8GroupedTokenTile(const DenseGemm& p) {
  const int64_t with_rows = std::max<int64_t>(1, std::min<int64_t>(p.groups, p.m));
  const int64_t average = (p.m + with_rows - 1) / with_rows;
  return Fp8TokenTile(std::min<int64_t>({p.max_group_rows, 64, 2 * average}));
}

int Fp8SplitKHeuristic(int64_t m, int64_t n, int64_t k, int num_sms) {
  if (m > 64) return 1;
  const int64_t tiles = (n + 127) / 128;
  const int64_t kblocks = (k + kFp8BlockK - 1) / kFp8BlockK;
  int splits = 1;
  while (splits < 4 && tiles * splits < num_sms && kblocks >= 4 * splits) splits *= 2;
  return splits;
}

int Fp8Splits(const DenseGemm& p, int block_m, int num_sms) {
  if (!Fp8DecodeKernelTakes(p, block_m)) return 1;
  if (p.group_offsets == nullptr) return Fp8SplitKHeuristic(p.m, p.n, p.k, num_sms);
  return Fp8SplitKHeuristic(Fp8GroupedTokenTile(p), p.n * std::min<int64_t>(p.groups, p.m), p.k, num_sms);
}

int Fp8ResolvedSplits(const DenseGemm& p, const GemmConfig& config, int num_sms) {
  const int64_t kblocks = (p.k + kFp8BlockK - 1) / kFp8BlockK;
  const int splits = config.split_k > 0 ? config.split_k : Fp8Splits(p, config.block_m, num_sms);
  return static_cast<int>(std::min<int64_t>(splits, kblocks));
}

}  // namespace gemm

int GemmMBucket(int64_t m) {
  for (size_t b = 0; b < kGemmBucketUpper.size(); ++b) {
    if (m <= kGemmBucketUpper[b]) return static_cast<int>(b);
  }
  return static_cast<int>(kGemmBucketUpper.size()) - 1;
}

int64_t GemmMBucketUpperBound(int bucket) {
  return kGemmBucketUpper[std::clamp<size_t>(bucket, 0, kGemmBucketUpper.size() - 1)];
}

namespace gemm {
int64_t GemmTunedM(int bucket) { return std::min<int64_t>(GemmMBucketUpperBound(bucket), 8192); }
}  // namespace gemm

bool CublasLtTakesFp8(const GemmParams& p) {
  // (No bias: version 6 adds it.)
  if (p.fp8 == Fp8Scaling::kNone || p.grouped() || p.dtype != DType::kBF16 || p.bias != nullptr) return false;
  if (p.n % 16 != 0 || p.k % 16 != 0 || p.a_scale == nullptr || p.w_scale == nullptr) return false;
  if (p.silu_mul && (p.scratch == nullptr || p.n % (2 * kFp8GateUpBlock) != 0)) return false;
  // Block-scaled: cuBLASLt 13.1 takes m a multiple of 4 only (gemm.h).
  return p.fp8 == Fp8Scaling::kPerRow || (p.w_scale_128 != nullptr && p.m % 4 == 0);
}

GemmConfig ChooseGemm(const GemmParams& p, GemmMode mode, const GemmTable& table, const DeviceInfo& dev) {
  GemmConfig config;  // split_k = block_n = 0: the kernels size themselves
  const GemmConfig cublaslt{GemmVersion::kCublasLt};
  const auto entry = table.find({GemmMBucket(p.m), p.n, p.k, p.fp8});
  // FP8 products: our kernel, or cuBLASLt's FP8 where it takes the call and
  // the mode or the tuned entry says so.
  if (p.fp8 != Fp8Scaling::kNone) {
    config.version = GemmVersion::kFp8;
    if (CublasLtTakesFp8(p)) {
      if (mode == GemmMode::kCublasLt) return cublaslt;
      if (mode == GemmMode::kAuto && entry != table.end()) return entry->second;
    } else if (!p.grouped() && entry != table.end() && entry->second.version == GemmVersion::kFp8) {
      return entry->second;  // a tuned or pinned split count
    }
    return config;
  }
  if (p.grouped()) {
    config.version = p.max_group_rows <= 64 ? GemmVersion::kSmallMSplitK : GemmVersion::kWarpSpecialized;
    return config;
  }
  if (mode == GemmMode::kCublasLt) return cublaslt;
  if (mode == GemmMode::kCustom) {
    config.version = p.m <= 64 ? GemmVersion::kSmallMSplitK : GemmVersion::kWarpSpecialized;
  } else if (entry != table.end()) {
    config = entry->second;
  } else {
    config.version = p.m <= 16 ? GemmVersion::kSmallMSplitK : GemmVersion::kCublasLt;
  }
  if (p.silu_mul && config.version == GemmVersion::kClusterMulticast) config = {GemmVersion::kWarpSpecialized};
  // The per-call conditions (device, dtype, bias, strides, alignment): where
  // ours do not take the call, cuBLASLt does.
  if (config.version != GemmVersion::kCublasLt && !GemmSupported(p, config, dev).ok()) return cublaslt;
  return config;
}

}  // namespace layerserve::kernels
