// The one GEMM call of the layer executor: D = A · Wᵀ (+ bias) (+ D), in the
// row-major layout of a PyTorch Linear.
//
// Every projection of a decoder layer goes through GemmEngine::Gemm, which
// routes each call per shape (GemmMode) between cuBLASLt and the project's
// own Hopper kernels (kernels/gemm: LaunchGemm, with GemmDispatcher's table
// deciding where ours are at least as fast). Ours take dense row-major bf16
// without bias; everything else (fp16, bias, strided operands, N or K not a
// multiple of 8, misaligned pointers, non-Hopper devices) stays on cuBLASLt.
//
// cuBLASLt is column-major. A row-major [m, k] matrix is the same memory as a
// column-major [k, m] one, so the engine computes Dᵀ[n, m] = W[n, k] · Aᵀ[k, m]
// with W read as a column-major [k, n] matrix transposed (the "TN" form the
// tensor-core kernels prefer) and A as column-major [k, m]. The bias epilogue
// then adds bias[i] to row i of Dᵀ, i.e. to output feature i, as intended.
//
// The in-place residual (accumulate) rounds differently per path: our kernels
// round A·Wᵀ + D once; cuBLASLt 13.0 with C aliasing D (beta = 1) was seen to
// round A·Wᵀ to bf16 before the add at small M (docs/perf-gemm.md), i.e. what
// an unfused `x + linear(a)` computes. The engine accepts that rather than
// copying D aside on every call as the kernel library's CublasLtGemm does (an
// extra read and write of D: about a tenth of o_proj's time at M = 8192 by
// the bandwidths in that document).
//
// Threading: Gemm may be called from several threads at once, each with its
// own stream and workspace. cuBLASLt heuristics are cached per shape in a
// mutex-guarded map; a cached plan is immutable. The routing state is fixed
// at creation, and LaunchGemm keeps no per-stream state.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "layerserve/kernels/common.h"
#include "layerserve/kernels/gemm.h"
#include "server/cuda/cuda_resources.h"
#include "server/cuda/gemm_tuning.h"

namespace layerserve::cuda {

// Which implementation the GEMMs that our kernels can take run on.
enum class GemmMode {
  // Per (M bucket, N, K), the kernel library's GemmDispatcher table, tuned
  // at creation for the model's shapes (gemm_tuning.h: timed against
  // cuBLASLt, or read from a cache, or pinned); untuned shapes get the
  // built-in defaults (v4 for M <= 16, cuBLASLt above). The serving default.
  kAuto,
  // cuBLASLt for every call: the reference path, and the way back should one
  // of our kernels misbehave on some device.
  kCublasLt,
  // Ours wherever they run (v4 for M <= 64, v3 above), even where slower: for
  // validating and profiling them inside the real server.
  kCustom,
};

// "auto", "cublaslt", "custom": the names a --gemm flag takes.
std::string_view GemmModeName(GemmMode mode);
// INVALID_ARGUMENT for any other name.
absl::StatusOr<GemmMode> ParseGemmMode(std::string_view name);

// D[m, n] = A[m, k] · W[n, k]ᵀ (+ bias[n]) (+ D when accumulate), row-major,
// bf16 or fp16 in and out, fp32 accumulation.
struct GemmParams {
  const void* a = nullptr;  // activations, row stride lda (elements)
  int64_t lda = 0;
  const void* w = nullptr;  // weights [out, in], row stride ldw
  int64_t ldw = 0;
  void* d = nullptr;  // output, row stride ldd
  int64_t ldd = 0;
  const void* bias = nullptr;  // [n] or null
  // D += A · Wᵀ, reading D as C in place (beta = 1): fuses a residual add.
  bool accumulate = false;
  int64_t m = 0;  // rows of A and D (tokens)
  int64_t n = 0;  // output features
  int64_t k = 0;  // input features
  kernels::DType dtype = kernels::DType::kBF16;
};

// Scratch memory a GEMM may use; one per stream, never shared by two streams.
struct GemmWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// What the auto mode's table is tuned for at creation (gemm_tuning.h).
struct GemmEngineTuning {
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (n, k) of the model's projections
  int64_t max_m = 1;                                // largest M a call will have
  GemmTuningOptions options;
};

class GemmEngine {
 public:
  // 32 MiB is what cuBLASLt's Hopper kernels ask for at most.
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;

  // `workspace_bytes`: the size of the workspace every call will pass. For
  // the current device. Where `mode` wants our kernels but they cannot run
  // here (not a compute capability 9.0 device, binary without sm_90a) or the
  // dispatcher cannot be created, logs one line to stderr and routes every
  // call to cuBLASLt: that is not an error. In auto mode with our kernels
  // usable, the per-shape table is tuned for `tuning` before this returns
  // (cache, autotune pass, pins; logged to stderr), so serving never times.
  static absl::StatusOr<std::unique_ptr<GemmEngine>> Create(
      size_t workspace_bytes, GemmMode mode = GemmMode::kAuto,
      const GemmEngineTuning& tuning = GemmEngineTuning{});
  ~GemmEngine();

  // Enqueues the product on `stream`; nothing synchronizes. INVALID_ARGUMENT
  // for bad shapes, null pointers or a too-small workspace; INTERNAL when
  // cuBLASLt or a kernel launch fails, or cuBLASLt finds no algorithm.
  absl::Status Gemm(const GemmParams& p, const GemmWorkspace& workspace, cudaStream_t stream);

  // What Gemm runs for valid `p`: version kCublasLt for the cuBLASLt path,
  // else the kernel configuration handed to kernels::LaunchGemm.
  kernels::GemmConfig Route(const GemmParams& p) const;

  GemmMode mode() const { return mode_; }
  // False where every call goes to cuBLASLt (mode kCublasLt, or our kernels
  // unavailable on this device or binary).
  bool custom_kernels_enabled() const { return custom_kernels_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  // Distinct shapes cuBLASLt planned so far (for tests and logs).
  size_t CachedPlans() const;

 private:
  struct Plan;
  // (m, n, k, lda, ldw, ldd, dtype, bias, accumulate, alignment)
  using PlanKey =
      std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, bool, int>;

  GemmEngine(CublasLtHandle handle, size_t workspace_bytes, GemmMode mode, bool custom_kernels,
             std::unique_ptr<kernels::GemmDispatcher> dispatcher);
  absl::StatusOr<const Plan*> GetPlan(const GemmParams& p, int alignment);
  absl::Status RunCublasLt(const GemmParams& p, const GemmWorkspace& workspace,
                           cudaStream_t stream);

  const CublasLtHandle handle_;
  const size_t workspace_bytes_;
  const GemmMode mode_;
  const bool custom_kernels_;
  // Consulted only through its const Choose(), whose table is tuned in
  // Create and never changes after, so all streams may share it. Its Run() and its own
  // cuBLASLt instance serve one stream at a time and stay unused: cuBLASLt
  // runs here, on the caller's workspace. Null unless mode_ is kAuto and
  // custom_kernels_.
  const std::unique_ptr<kernels::GemmDispatcher> dispatcher_;
  mutable Mutex mu_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layerserve::cuda
