// Dense projection GEMM of a decoder layer: C[M,N] = A[M,K] · W[N,K]ᵀ (+ R[M,N]),
// bf16 in, fp32 accumulate, bf16 out, all row-major (W is the nn.Linear weight
// as stored). M is the number of batched tokens; N, K are model dimensions.
//
// Three entry points, all launching on the caller's stream without
// synchronizing:
//   - LaunchGemm: one of our numbered kernel versions (3..5), for tests, the
//     benchmark and the dispatcher;
//   - CublasLtGemm: version 0, the cuBLASLt yardstick and fallback;
//   - GemmDispatcher: what production calls; picks per (M bucket, N, K)
//     between our versions and cuBLASLt (defaults, a short autotune pass, or
//     explicit overrides) and falls back to cuBLASLt wherever ours do not apply
//     (non-Hopper device, binary built without sm_90a, N or K not multiples
//     of 8, misaligned pointers).
// Plain C++ header: compiles without nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

struct GemmParams {
  const void* a = nullptr;         // [m, k], row-major
  const void* w = nullptr;         // [n, k], row-major
  const void* residual = nullptr;  // [m, n] or null; may alias c (in-place residual add)
  void* c = nullptr;               // [m, n]
  int64_t m = 0;                   // tokens, >= 1
  int64_t n = 0;                   // multiple of 8 for our kernels
  int64_t k = 0;                   // multiple of 8 for our kernels
  DType dtype = DType::kBF16;      // bf16 only for now
};

// Numbered kernel versions; the benchmark and docs/perf-gemm.md use the same
// numbers. Only versions serving can choose are built: v1 (mma.sync, for
// pre-Hopper GPUs, where serving uses cuBLASLt) and v2 (TMA + wgmma without
// warp specialization, superseded by v3) were removed after commit 92d9569;
// docs/perf-gemm.md keeps their measurements.
enum class GemmVersion : int {
  kCublasLt = 0,          // cuBLASLt (CublasLtGemm); not launchable through LaunchGemm
  kWarpSpecialized = 3,   // producer warpgroup + 2 consumer warpgroups, 128x256 or 128x128 tiles (sm_90a)
  kSmallMSplitK = 4,      // M <= 64: weight streaming, split-K reduced in a cluster, tokens as wgmma N (sm_90a)
  kClusterMulticast = 5,  // v3 in 2-CTA clusters along M sharing each W tile by TMA multicast (sm_90a)
};

struct GemmConfig {
  GemmVersion version = GemmVersion::kWarpSpecialized;
  // Version 4 only: K splits, 1..8 (one thread block cluster per W tile);
  // 0 picks from the shape and the SM count.
  int split_k = 0;
  // Version 3 only: tile width 128 or 256; 0 picks from the shape.
  int block_n = 0;
};

std::string GemmConfigName(const GemmConfig& config);

// Short spelling of a configuration, as flags, the benchmark and the autotune
// cache write it: "v0" (cuBLASLt), "v3", "v3b128", "v3b256", "v4",
// "v4s1".."v4s8", "v5". ParseGemmConfigSpec is its inverse (INVALID_ARGUMENT for
// anything else); the leading "v" is optional there.
std::string GemmConfigSpec(const GemmConfig& config);
absl::StatusOr<GemmConfig> ParseGemmConfigSpec(std::string_view spec);

// OK if `config` can run `p` on the current device with this binary, else the
// reason (UNIMPLEMENTED for a missing arch/feature, INVALID_ARGUMENT for a
// shape or alignment the version does not take).
absl::Status GemmSupported(const GemmParams& p, const GemmConfig& config);

// Launches version 1..5 on `stream`.
absl::Status LaunchGemm(const GemmParams& p, const GemmConfig& config, cudaStream_t stream);

// Version 0: cuBLASLt with one cached plan (layouts + heuristic algorithm) per
// shape. Owns a handle and a workspace; serves one stream at a time.
class CublasLtGemm {
 public:
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  absl::Status Run(const GemmParams& p, cudaStream_t stream);

 private:
  struct Impl;
  explicit CublasLtGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One M bucket's autotune outcome for (n, k): the configuration chosen and
// the measured time of it and of cuBLASLt (microseconds per launch, launches
// back to back) at m_timed, the bucket's largest M (capped at 8192).
struct GemmTuneResult {
  int bucket = 0;
  int64_t m_timed = 0;
  int64_t n = 0;
  int64_t k = 0;
  GemmConfig chosen;
  float chosen_us = 0;
  float cublaslt_us = 0;
};

// Chooses and runs a GEMM per (M bucket, N, K). Owns a CublasLtGemm (and its
// workspace), so it serves one stream at a time (the server keeps one per
// stream). Not thread-safe.
class GemmDispatcher {
 public:
  // For the current device.
  static absl::StatusOr<std::unique_ptr<GemmDispatcher>> Create();
  ~GemmDispatcher();
  GemmDispatcher(const GemmDispatcher&) = delete;
  GemmDispatcher& operator=(const GemmDispatcher&) = delete;

  // Runs C = A·Wᵀ (+R) with the configuration Choose() names. Falls back to
  // cuBLASLt when the chosen version does not support `p`.
  absl::Status Run(const GemmParams& p, cudaStream_t stream);

  // Times every candidate (cuBLASLt, v3 at both tile widths, v4 at 1/2/4/8
  // splits for M <= 64, v5 for M > 64) for each M bucket on synthetic random
  // data of shape (bucket's largest M capped at 8192, n, k), launches back to
  // back in a CUDA graph with W rotating through enough copies to miss in L2,
  // and caches the fastest. Buckets that hold no M <= max_m are skipped
  // (they keep their default). Allocates (and frees) min(max_m, 8192) * (k + n) bf16
  // elements plus those copies of W; call at start-up, not on the serving
  // path. Synchronizes `stream`. Where our kernels cannot run (see Create),
  // nothing is timed and the result is empty.
  absl::StatusOr<std::vector<GemmTuneResult>> Autotune(int64_t n, int64_t k, cudaStream_t stream,
                                                       int64_t max_m = int64_t{1} << 40);

  // Pins the configuration of m's bucket for (n, k), replacing any tuned one.
  void SetOverride(int64_t m, int64_t n, int64_t k, const GemmConfig& config);

  // Tuned or overridden choice, else a default from the shape.
  GemmConfig Choose(int64_t m, int64_t n, int64_t k) const;

  // False where every call goes to cuBLASLt (not a compute capability 9.0
  // device, or this binary has no sm_90a code).
  bool custom_kernels_available() const { return custom_kernels_available_; }

  // M buckets: 1-8, 9-16, 17-32, 33-64, then powers of two up to 8192, then
  // everything larger. Returns the bucket's index.
  static int MBucket(int64_t m);
  static int64_t MBucketUpperBound(int bucket);  // largest M of the bucket (16384 for the last)

 private:
  GemmDispatcher(std::unique_ptr<CublasLtGemm> cublaslt, bool custom_kernels_available);

  std::unique_ptr<CublasLtGemm> cublaslt_;
  bool custom_kernels_available_;
  std::map<std::tuple<int, int64_t, int64_t>, GemmConfig> choices_;  // (bucket, n, k)
};

}  // namespace layerserve::kernels
