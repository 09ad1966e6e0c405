// GemmRouter (layerserve/kernels/gemm.h): the route of each call, the
// cuBLASLt path (version 0), and the autotune pass that fills the table.
//
// A cuBLASLt plan (the three matrix layouts, the heuristic's algorithm and,
// for GEMMs without bias, the matmul descriptor) is built once per shape and
// reused by every stream. A bias GEMM gets a fresh descriptor per call
// because the bias pointer is a descriptor attribute.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/cuda/cuda_resources.h"
#include "base/status_macros.h"
#include "kernels/gemm/gemm_heuristics.h"
#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels {
namespace {

absl::Status CublasError(cublasStatus_t status, const char* what, const char* file, int line) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", what, ": ", cublasLtGetStatusName(status), " (",
                                          cublasLtGetStatusString(status), ")"));
}

#define LS_CUBLAS_RETURN_IF_ERROR(expr)                                                        \
  do {                                                                                         \
    const cublasStatus_t ls_cublas_status_ = (expr);                                           \
    if (ls_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                          \
      return ::layerserve::kernels::CublasError(ls_cublas_status_, #expr, __FILE__, __LINE__); \
    }                                                                                          \
  } while (0)

using cuda::UniqueHandle;
using LtHandle = UniqueHandle<cublasLtHandle_t, &cublasLtDestroy>;
using MatmulDesc = UniqueHandle<cublasLtMatmulDesc_t, &cublasLtMatmulDescDestroy>;
using MatrixLayout = UniqueHandle<cublasLtMatrixLayout_t, &cublasLtMatrixLayoutDestroy>;
using MatmulPreference = UniqueHandle<cublasLtMatmulPreference_t, &cublasLtMatmulPreferenceDestroy>;

cudaDataType_t CudaType(DType t) { return t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF; }

// cuBLASLt's scale modes of an FP8 product: the weight's (its A) and the
// activations' (its B). Per row: one scale per weight row and per token
// (outer vectors). Block-128: 128x128 weight blocks and a scale per token
// and 128 columns of K.
struct Fp8ScaleModes {
  int32_t weight;
  int32_t activations;
};
Fp8ScaleModes CublasLtScaleModes(Fp8Scaling scaling) {
  if (scaling == Fp8Scaling::kBlock) {
    return {CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F};
  }
  return {CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F};
}

// Column-major rows x cols with leading dimension ld.
absl::StatusOr<MatrixLayout> MakeLayout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  return MatrixLayout(layout);
}

// The weight scales cuBLASLt reads for an FP8 product: per row as they are,
// block-128 in its own layout (GemmParams::w_scale_128).
const float* CublasLtWeightScale(const GemmParams& p) {
  return p.fp8 == Fp8Scaling::kBlock ? p.w_scale_128 : p.w_scale;
}

// An FP8 product's descriptor (GemmParams::fp8): e4m3 operands scaled as
// CublasLtScaleModes says, from the call's scale pointers (which the
// heuristic wants set too).
absl::StatusOr<MatmulDesc> MakeFp8Desc(Fp8Scaling scaling, const float* w_scale, const float* a_scale) {
  cublasLtMatmulDesc_t raw = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MatmulDesc desc(raw);
  const cublasOperation_t trans_a = CUBLAS_OP_T;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const Fp8ScaleModes modes = CublasLtScaleModes(scaling);
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &modes.weight, sizeof(modes.weight)));
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &modes.activations,
                                                           sizeof(modes.activations)));
  if (w_scale != nullptr) {
    LS_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale)));
  }
  if (a_scale != nullptr) {
    LS_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  }
  return desc;
}

absl::StatusOr<MatmulDesc> MakeDesc(DType t, bool has_bias, const void* bias) {
  cublasLtMatmulDesc_t raw = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MatmulDesc desc(raw);
  const cublasOperation_t trans_a = CUBLAS_OP_T;  // W, read as column-major [k, n]
  const cublasOperation_t trans_b = CUBLAS_OP_N;  // activations, column-major [k, m]
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LS_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CudaType(t);
    LS_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    LS_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    if (bias != nullptr) {
      LS_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
  }
  return desc;
}

// The largest power of two (at most 256) dividing every address: cuBLASLt's
// fastest kernels assume 16-byte or wider aligned operands, and the heuristic
// must only offer kernels that the actual pointers satisfy.
int AlignmentOf(std::initializer_list<const void*> pointers) {
  int alignment = 256;
  for (const void* p : pointers) {
    if (p == nullptr) continue;
    const auto address = reinterpret_cast<uintptr_t>(p);
    alignment = std::min<int>(alignment, static_cast<int>(std::min<uintptr_t>(256, address & (~address + 1))));
  }
  return alignment;
}

// What cuBLASLt runs for a gated call: the plain product into the scratch
// buffer (the activation follows in its own launch).
GemmParams PlainProductOf(const GemmParams& p) {
  GemmParams plain = p;
  plain.silu_mul = false;
  plain.d = p.scratch;
  plain.ldd = p.n;
  return plain;
}

// The alignment cuBLASLt's plan for `p` (not gated) is made for: every
// operand it reads or writes, the FP8 scales included.
int CublasLtAlignment(const GemmParams& p) {
  if (p.fp8 != Fp8Scaling::kNone) return AlignmentOf({p.a, p.w, p.d, CublasLtWeightScale(p), p.a_scale});
  return AlignmentOf({p.a, p.w, p.d, p.bias});
}

absl::Status Validate(const GemmParams& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: non-positive shape m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.a == nullptr || p.w == nullptr || p.d == nullptr) return absl::InvalidArgumentError("gemm: null operand");
  if (p.lda < p.k || p.ldw < p.k || p.ldd < p.out_cols()) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: leading dimensions lda=", p.lda, " ldw=", p.ldw,
                                                   " ldd=", p.ldd, " too small for m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.dtype == DType::kF32) return absl::InvalidArgumentError("gemm: operands must be bf16 or fp16");
  if (p.silu_mul) {
    if (p.fp8 == Fp8Scaling::kNone && p.n % (2 * kGateUpBlock) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("gemm: silu_mul needs n a multiple of 16, got ", p.n));
    }
    if (p.bias != nullptr || p.accumulate) {
      return absl::InvalidArgumentError("gemm: silu_mul takes neither bias nor accumulate");
    }
    if (p.ldd != p.n / 2) return absl::InvalidArgumentError("gemm: silu_mul writes a dense output (ldd = n / 2)");
  }
  return absl::OkStatus();
}

// One candidate's launches run(0..kLaunches-1) captured into a CUDA graph:
// back to back, without host launch cost, as a layer's projections run.
class LaunchGraph {
 public:
  static constexpr int kLaunches = 10;

  template <typename Run>
  absl::Status Capture(Run& run, cudaStream_t stream) {
    LS_ASSIGN_OR_RETURN(exec_, cuda::CaptureGraph(stream, cudaStreamCaptureModeRelaxed, [&]() -> absl::Status {
                          for (int i = 0; i < kLaunches; ++i) LS_RETURN_IF_ERROR(run(i));
                          return absl::OkStatus();
                        }));
    LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_.get(), stream));  // warm-up replay
    return absl::OkStatus();
  }

  // Milliseconds per launch over one replay.
  absl::StatusOr<float> Time(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) const {
    float ms = 0;
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_.get(), stream));
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    return ms / kLaunches;
  }

 private:
  cuda::CudaGraphExec exec_;
};

// Timed replays per candidate, one per round; rounds interleave the
// candidates so clock and power drift during the pass does not favour one,
// and the median keeps a one-off stall from deciding the choice.
constexpr int kTuneRounds = 5;

}  // namespace

struct GemmRouter::CublasLt {
  struct Plan {
    MatrixLayout w_layout, a_layout, d_layout;
    MatmulDesc desc;  // used as is when the GEMM has no bias
    cublasLtMatmulAlgo_t algo{};
    size_t workspace_bytes = 0;
  };
  // (m, n, k, lda, ldw, ldd, dtype, bias, accumulate, alignment, FP8
  // scaling, the heuristic answer's rank: GemmConfig::cublaslt_answer)
  using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, bool, int, int, int>;

  LtHandle handle;
  size_t max_workspace_bytes = 0;
  mutable absl::Mutex mu;
  std::map<PlanKey, std::unique_ptr<Plan>> plans ABSL_GUARDED_BY(mu);

  // The heuristic's limits: the workspace, and operands aligned to `alignment` bytes.
  absl::StatusOr<MatmulPreference> MakePreference(int alignment) const {
    cublasLtMatmulPreference_t raw = nullptr;
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&raw));
    MatmulPreference pref(raw);
    const uint64_t max_workspace = max_workspace_bytes;
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                   &max_workspace, sizeof(max_workspace)));
    const uint32_t align_bytes = static_cast<uint32_t>(alignment);
    for (const auto attribute :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      LS_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulPreferenceSetAttribute(raw, attribute, &align_bytes, sizeof(align_bytes)));
    }
    return pref;
  }

  absl::StatusOr<const Plan*> GetPlan(const GemmParams& p, int alignment, int answer) {
    const bool has_bias = p.bias != nullptr;
    const PlanKey key{p.m,
                      p.n,
                      p.k,
                      p.lda,
                      p.ldw,
                      p.ldd,
                      static_cast<int>(p.dtype),
                      has_bias,
                      p.accumulate,
                      alignment,
                      static_cast<int>(p.fp8),
                      answer};
    absl::MutexLock lock(&mu);
    if (auto it = plans.find(key); it != plans.end()) return it->second.get();

    // Planning runs under the lock: it happens once per shape, and a second
    // thread asking for the same shape would otherwise plan it twice.
    auto plan = std::make_unique<Plan>();
    const bool fp8 = p.fp8 != Fp8Scaling::kNone;
    const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CudaType(p.dtype);
    LS_ASSIGN_OR_RETURN(plan->w_layout, MakeLayout(in_type, p.k, p.n, p.ldw));
    LS_ASSIGN_OR_RETURN(plan->a_layout, MakeLayout(in_type, p.k, p.m, p.lda));
    LS_ASSIGN_OR_RETURN(plan->d_layout, MakeLayout(CudaType(p.dtype), p.n, p.m, p.ldd));
    if (fp8) {
      LS_ASSIGN_OR_RETURN(plan->desc, MakeFp8Desc(p.fp8, CublasLtWeightScale(p), p.a_scale));
    } else {
      LS_ASSIGN_OR_RETURN(plan->desc, MakeDesc(p.dtype, has_bias, nullptr));
    }

    LS_ASSIGN_OR_RETURN(const MatmulPreference pref, MakePreference(alignment));
    cublasLtMatmulPreference_t raw_pref = pref.get();
    // Answer `answer` for the bucket's timed M, where it still runs this
    // call within the workspace; else the first answer for this M.
    std::optional<cublasLtMatmulHeuristicResult_t> chosen;
    if (answer > 0) {
      LS_ASSIGN_OR_RETURN(chosen, RankedAnswer(*plan, p, in_type, raw_pref, answer));
    }
    if (!chosen.has_value()) {
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(handle.get(), plan->desc.get(), plan->w_layout.get(),
                                                               plan->a_layout.get(), plan->d_layout.get(),
                                                               plan->d_layout.get(), raw_pref, 1, &result, &found));
      if (found == 0) {
        return absl::InternalError(absl::StrCat("gemm: cuBLASLt has no algorithm for m=", p.m, " n=", p.n, " k=", p.k,
                                                " bias=", has_bias, " alignment=", alignment, " fp8=", fp8));
      }
      chosen = result;
    }
    plan->algo = chosen->algo;
    plan->workspace_bytes = chosen->workspaceSize;
    const Plan* out = plan.get();
    plans.emplace(key, std::move(plan));
    return out;
  }

  // The heuristic's answer of rank `answer` for the bucket of p.m, taken at
  // the bucket's timed M, with the workspace it needs at p.m; nullopt where
  // it has fewer answers, or cublasLtMatmulAlgoCheck refuses that one for
  // this call or it needs more than the workspace.
  absl::StatusOr<std::optional<cublasLtMatmulHeuristicResult_t>> RankedAnswer(const Plan& plan, const GemmParams& p,
                                                                              cudaDataType_t in_type,
                                                                              cublasLtMatmulPreference_t pref,
                                                                              int answer) {
    const int64_t ranked_m = gemm::GemmTunedM(GemmMBucket(p.m));
    LS_ASSIGN_OR_RETURN(const MatrixLayout ranked_a, MakeLayout(in_type, p.k, ranked_m, p.lda));
    LS_ASSIGN_OR_RETURN(const MatrixLayout ranked_d, MakeLayout(CudaType(p.dtype), p.n, ranked_m, p.ldd));
    std::array<cublasLtMatmulHeuristicResult_t, gemm::kCublasLtTunedAnswers> ranked{};
    int found = 0;
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
        handle.get(), plan.desc.get(), plan.w_layout.get(), ranked_a.get(), ranked_d.get(), ranked_d.get(), pref,
        std::min(answer + 1, gemm::kCublasLtTunedAnswers), ranked.data(), &found));
    if (answer >= found) return std::nullopt;
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(handle.get(), plan.desc.get(), plan.w_layout.get(), plan.a_layout.get(),
                                plan.d_layout.get(), plan.d_layout.get(), &ranked[answer].algo,
                                &checked) != CUBLAS_STATUS_SUCCESS ||
        checked.workspaceSize > max_workspace_bytes) {
      return std::nullopt;
    }
    checked.algo = ranked[answer].algo;
    return checked;
  }

  // How many answers cuBLASLt's heuristic gives for `p` (at most
  // kCublasLtTunedAnswers): the ranks Autotune times.
  absl::StatusOr<int> Answers(const GemmParams& p, int alignment) {
    // The plan of answer 0 holds the call's layouts and descriptor.
    LS_ASSIGN_OR_RETURN(const Plan* plan, GetPlan(p, alignment, 0));
    LS_ASSIGN_OR_RETURN(const MatmulPreference pref, MakePreference(alignment));
    std::array<cublasLtMatmulHeuristicResult_t, gemm::kCublasLtTunedAnswers> results{};
    int found = 0;
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
        handle.get(), plan->desc.get(), plan->w_layout.get(), plan->a_layout.get(), plan->d_layout.get(),
        plan->d_layout.get(), pref.get(), gemm::kCublasLtTunedAnswers, results.data(), &found));
    return found;
  }
};

size_t CublasLtVersion() { return cublasLtGetVersion(); }

absl::StatusOr<std::unique_ptr<GemmRouter>> GemmRouter::Create(GemmMode mode, size_t workspace_bytes) {
  LS_ASSIGN_OR_RETURN(const DeviceInfo device, CurrentDeviceInfo());
  auto cublaslt = std::make_unique<CublasLt>();
  cublasLtHandle_t raw = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&raw));
  cublaslt->handle = LtHandle(raw);
  cublaslt->max_workspace_bytes = workspace_bytes;
  const bool custom = mode != GemmMode::kCublasLt && device.IsHopper() && GemmBuiltWithSm90a();
  return std::unique_ptr<GemmRouter>(new GemmRouter(mode, device, custom, workspace_bytes, std::move(cublaslt)));
}

GemmRouter::GemmRouter(GemmMode mode, DeviceInfo device, bool custom_kernels, size_t workspace_bytes,
                       std::unique_ptr<CublasLt> cublaslt)
    : mode_(mode),
      device_(device),
      custom_kernels_(custom_kernels),
      workspace_bytes_(workspace_bytes),
      cublaslt_(std::move(cublaslt)) {}

GemmRouter::~GemmRouter() = default;

size_t GemmRouter::CachedPlans() const {
  absl::MutexLock lock(&cublaslt_->mu);
  return cublaslt_->plans.size();
}

GemmConfig GemmRouter::Route(const GemmParams& p) const {
  GemmConfig config = ChooseGemm(p, custom_kernels_ ? mode_ : GemmMode::kCublasLt, table_, device_);
  if (p.grouped() && (config.version == GemmVersion::kWarpSpecialized || config.version == GemmVersion::kFp8)) {
    config.block_m = grouped_block_m_;
  }
  return config;
}

void GemmRouter::SetChoice(int64_t m, int64_t n, int64_t k, const GemmConfig& config, Fp8Scaling fp8) {
  table_[{GemmMBucket(m), n, k, fp8}] = config;
}

absl::Status GemmRouter::Run(const GemmParams& p, const GemmWorkspace& workspace, cudaStream_t stream) {
  LS_RETURN_IF_ERROR(Validate(p));
  const GemmConfig config = Route(p);
  if (config.version == GemmVersion::kCublasLt) return RunCublasLt(p, config.cublaslt_answer, workspace, stream);
  return LaunchGemm(p, config, device_, stream);
}

absl::Status GemmRouter::RunConfig(const GemmParams& p, const GemmConfig& config, const GemmWorkspace& workspace,
                                   cudaStream_t stream) {
  LS_RETURN_IF_ERROR(Validate(p));
  if (config.version == GemmVersion::kCublasLt) return RunCublasLt(p, config.cublaslt_answer, workspace, stream);
  return LaunchGemm(p, config, device_, stream);
}

absl::Status GemmRouter::RunCublasLt(const GemmParams& p, int answer, const GemmWorkspace& workspace,
                                     cudaStream_t stream) {
  const bool fp8 = p.fp8 != Fp8Scaling::kNone;
  if (fp8 && !CublasLtTakesFp8(p)) {
    return absl::InvalidArgumentError(
        "gemm: cuBLASLt's FP8 takes no grouped product, needs bf16 out, n and k multiples of 16, scales, a "
        "gated product's scratch and a block-scaled weight's w_scale_128 (with m a multiple of 4)");
  }
  if (p.silu_mul) {
    // The plain product into the scratch buffer, then the activation (over
    // the FP8 interleave for an FP8 product).
    if (p.scratch == nullptr) return absl::InvalidArgumentError("gemm: silu_mul on cuBLASLt needs a scratch buffer");
    LS_RETURN_IF_ERROR(RunCublasLt(PlainProductOf(p), answer, workspace, stream));
    SiluMulParams act;
    act.gate_up = p.scratch;
    act.out = p.d;
    act.rows = p.m;
    act.width = p.n / 2;
    act.block = fp8 ? kFp8GateUpBlock : kGateUpBlock;
    act.dtype = p.dtype;
    return LaunchSiluMul(act, stream);
  }
  if (fp8) return RunCublasLtFp8(p, answer, workspace, stream);
  const int alignment = CublasLtAlignment(p);
  if (alignment < 2) return absl::InvalidArgumentError("gemm: operand not 2-byte aligned");
  LS_ASSIGN_OR_RETURN(const CublasLt::Plan* plan, cublaslt_->GetPlan(p, alignment, answer));
  if (workspace.bytes < plan->workspace_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: workspace of ", workspace.bytes, " bytes, the plan needs ", plan->workspace_bytes));
  }
  MatmulDesc bias_desc;
  cublasLtMatmulDesc_t desc = plan->desc.get();
  if (p.bias != nullptr) {
    LS_ASSIGN_OR_RETURN(bias_desc, MakeDesc(p.dtype, true, p.bias));
    desc = bias_desc.get();
  }
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(cublaslt_->handle.get(), desc, &alpha, p.w, plan->w_layout.get(), p.a,
                                           plan->a_layout.get(), &beta, p.d, plan->d_layout.get(), p.d,
                                           plan->d_layout.get(), &plan->algo, workspace.data, workspace.bytes, stream));
  return absl::OkStatus();
}

// An FP8 product, not gated (RunCublasLt checked it and split a gated one).
absl::Status GemmRouter::RunCublasLtFp8(const GemmParams& p, int answer, const GemmWorkspace& workspace,
                                        cudaStream_t stream) {
  const float* w_scale = CublasLtWeightScale(p);
  const int alignment = CublasLtAlignment(p);
  if (alignment < 16) return absl::InvalidArgumentError("gemm: cuBLASLt's FP8 needs 16-byte aligned operands");
  LS_ASSIGN_OR_RETURN(const CublasLt::Plan* plan, cublaslt_->GetPlan(p, alignment, answer));
  if (workspace.bytes < plan->workspace_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: workspace of ", workspace.bytes, " bytes, the plan needs ", plan->workspace_bytes));
  }
  // The scale pointers are the descriptor's: one per call.
  LS_ASSIGN_OR_RETURN(const MatmulDesc desc, MakeFp8Desc(p.fp8, w_scale, p.a_scale));
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(cublaslt_->handle.get(), desc.get(), &alpha, p.w, plan->w_layout.get(), p.a,
                                           plan->a_layout.get(), &beta, p.d, plan->d_layout.get(), p.d,
                                           plan->d_layout.get(), &plan->algo, workspace.data, workspace.bytes, stream));
  return absl::OkStatus();
}

absl::StatusOr<int> GemmRouter::CublasLtAnswers(const GemmParams& p) {
  if (p.fp8 != Fp8Scaling::kNone && !CublasLtTakesFp8(p)) return 0;
  const GemmParams plain = p.silu_mul ? PlainProductOf(p) : p;  // as RunCublasLt runs it
  return cublaslt_->Answers(plain, CublasLtAlignment(plain));
}

absl::StatusOr<std::vector<GemmTuneResult>> GemmRouter::Autotune(int64_t n, int64_t k, int64_t max_m,
                                                                 const GemmWorkspace& workspace, cudaStream_t stream,
                                                                 bool gated, Fp8Scaling fp8, bool accumulate) {
  std::vector<GemmTuneResult> results;
  if (gated && accumulate) return absl::InvalidArgumentError("gemm autotune: a gated product does not accumulate");
  const int64_t multiple = fp8 != Fp8Scaling::kNone ? (gated ? 2 * kFp8GateUpBlock : 16) : (gated ? 16 : 8);
  if (!custom_kernels_ || n % multiple != 0 || k % (fp8 != Fp8Scaling::kNone ? 16 : 8) != 0 || max_m < 1) {
    return results;
  }
  const int last_bucket = GemmMBucket(max_m);
  const int64_t rows = gemm::GemmTunedM(last_bucket);
  const int64_t kblocks = (k + kFp8BlockK - 1) / kFp8BlockK;
  // Enough copies of W that timed launches stream it from HBM, as serving does.
  const size_t w_bytes = static_cast<size_t>(n * k) * (fp8 != Fp8Scaling::kNone ? 1 : 2);
  const int w_sets =
      static_cast<int>(std::max<size_t>(2, (2 * static_cast<size_t>(device_.l2_bytes) + w_bytes - 1) / w_bytes));
  LS_ASSIGN_OR_RETURN(const cuda::DeviceBuffer a, cuda::DeviceBuffer::Allocate(static_cast<size_t>(rows * k) * 2));
  LS_ASSIGN_OR_RETURN(const cuda::DeviceBuffer c, cuda::DeviceBuffer::Allocate(static_cast<size_t>(rows * n) * 2));
  // The gated output; c is then the cuBLASLt route's scratch.
  LS_ASSIGN_OR_RETURN(const cuda::DeviceBuffer act,
                      cuda::DeviceBuffer::Allocate(gated ? static_cast<size_t>(rows * n) : size_t{16}));
  LS_RETURN_IF_ERROR(gemm::FillRandomBf16(a.data(), rows * k, 1, stream));
  // (Accumulating: onto finite values, as a residual stream holds.)
  if (accumulate) LS_RETURN_IF_ERROR(gemm::FillRandomBf16(c.data(), rows * n, 5, stream));
  std::vector<cuda::DeviceBuffer> w;
  for (int i = 0; i < w_sets; ++i) {
    LS_ASSIGN_OR_RETURN(w.emplace_back(), cuda::DeviceBuffer::Allocate(w_bytes));
    if (fp8 == Fp8Scaling::kNone) LS_RETURN_IF_ERROR(gemm::FillRandomBf16(w[i].data(), n * k, 2 + i, stream));
  }
  // FP8: each set's codes are random bf16 weights quantized per row (their
  // scales then serve the per-row product); block scales are a constant.
  // The activations are quantized per bucket, as the scaling says.
  cuda::DeviceBuffer a8, a_scale, w_scale, w_scale_128;
  std::vector<cuda::DeviceBuffer> w_row_scales;
  if (fp8 != Fp8Scaling::kNone) {
    LS_ASSIGN_OR_RETURN(const cuda::DeviceBuffer bf16_w, cuda::DeviceBuffer::Allocate(static_cast<size_t>(n * k) * 2));
    for (int i = 0; i < w_sets; ++i) {
      LS_ASSIGN_OR_RETURN(w_row_scales.emplace_back(), cuda::DeviceBuffer::Allocate(static_cast<size_t>(n) * 4));
      LS_RETURN_IF_ERROR(gemm::FillRandomBf16(bf16_w.data(), n * k, 2 + i, stream));
      QuantizeFp8Params q;
      q.x = bf16_w.data();
      q.codes = w[i].data();
      q.scales = static_cast<float*>(w_row_scales[i].data());
      q.rows = n;
      q.cols = k;
      LS_RETURN_IF_ERROR(LaunchQuantizeFp8(q, stream));
    }
    LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // before bf16_w is freed
    LS_ASSIGN_OR_RETURN(a8, cuda::DeviceBuffer::Allocate(static_cast<size_t>(rows * k)));
    LS_ASSIGN_OR_RETURN(a_scale, cuda::DeviceBuffer::Allocate(static_cast<size_t>(rows * kblocks) * 4));
    const int64_t block_scales = (n + kFp8WeightScaleRows - 1) / kFp8WeightScaleRows * kblocks;
    const int64_t cublaslt_scales = (n + kFp8BlockK - 1) / kFp8BlockK * kFp8CublasLtScaleCols(k);
    LS_ASSIGN_OR_RETURN(w_scale, cuda::DeviceBuffer::Allocate(static_cast<size_t>(block_scales) * 4));
    LS_ASSIGN_OR_RETURN(w_scale_128, cuda::DeviceBuffer::Allocate(static_cast<size_t>(cublaslt_scales) * 4));
    LS_RETURN_IF_ERROR(gemm::FillFloat(static_cast<float*>(w_scale.data()), block_scales, 1.f / 448, stream));
    LS_RETURN_IF_ERROR(gemm::FillFloat(static_cast<float*>(w_scale_128.data()), cublaslt_scales, 1.f / 448, stream));
  }
  LS_ASSIGN_OR_RETURN(const cuda::CudaEvent start, cuda::CreateEvent(cudaEventDefault));
  LS_ASSIGN_OR_RETURN(const cuda::CudaEvent stop, cuda::CreateEvent(cudaEventDefault));

  for (int bucket = 0; bucket <= last_bucket; ++bucket) {
    GemmParams p;
    p.a = a.data();
    p.lda = k;
    p.d = gated ? act.data() : c.data();
    p.ldd = gated ? n / 2 : n;
    p.silu_mul = gated;
    p.scratch = gated ? c.data() : nullptr;
    p.ldw = k;
    p.m = gemm::GemmTunedM(bucket);
    p.n = n;
    p.k = k;
    p.dtype = DType::kBF16;
    p.accumulate = accumulate;
    // Launch i's weight (and its scales), rotating through the sets.
    const auto weight = [&](int i) {
      p.w = w[i % w_sets].data();
      if (fp8 == Fp8Scaling::kPerRow) p.w_scale = static_cast<const float*>(w_row_scales[i % w_sets].data());
      if (fp8 == Fp8Scaling::kBlock) p.w_scale = static_cast<const float*>(w_scale.data());
    };
    weight(0);
    std::vector<GemmConfig> candidates = {{GemmVersion::kCublasLt, 0, 0}};
    if (fp8 != Fp8Scaling::kNone) {
      QuantizeFp8Params q;
      q.x = a.data();
      q.codes = a8.data();
      q.scales = static_cast<float*>(a_scale.data());
      q.rows = p.m;
      q.cols = k;
      q.group = fp8 == Fp8Scaling::kBlock ? kFp8BlockK : 0;
      LS_RETURN_IF_ERROR(LaunchQuantizeFp8(q, stream));
      p.a = a8.data();
      p.fp8 = fp8;
      p.a_scale = static_cast<const float*>(a_scale.data());
      // (A block-scaled gate/up has no cuBLASLt scales in serving: its
      // 64-row interleave puts gate and up rows in one 128-row block.)
      if (!(gated && fp8 == Fp8Scaling::kBlock)) p.w_scale_128 = static_cast<const float*>(w_scale_128.data());
      if (!CublasLtTakesFp8(p)) candidates.clear();
      candidates.push_back({GemmVersion::kFp8, 0, 0});
      if (p.m <= 64) {
        for (int s : {1, 2, 4, 8}) candidates.push_back({GemmVersion::kFp8, s, 0});
      }
    } else {
      candidates.push_back({GemmVersion::kWarpSpecialized, 0, 256});
      candidates.push_back({GemmVersion::kWarpSpecialized, 0, 128});
      if (p.m <= 64) {
        for (int s : {1, 2, 4, 8}) candidates.push_back({GemmVersion::kSmallMSplitK, s, 0});
      } else {
        candidates.push_back({GemmVersion::kClusterMulticast, 0, 0});
      }
    }
    // cuBLASLt's further heuristic answers (its first is the candidate above).
    if (!candidates.empty() && candidates.front().version == GemmVersion::kCublasLt) {
      LS_ASSIGN_OR_RETURN(const int answers, CublasLtAnswers(p));
      for (int answer = 1; answer < answers; ++answer) {
        GemmConfig config{GemmVersion::kCublasLt};
        config.cublaslt_answer = answer;
        candidates.push_back(config);
      }
    }
    std::vector<GemmConfig> configs;
    std::vector<LaunchGraph> graphs;
    for (const GemmConfig& config : candidates) {
      weight(0);
      if (config.version != GemmVersion::kCublasLt && !GemmSupported(p, config, device_).ok()) continue;
      auto run = [&](int i) {
        weight(i);
        return RunConfig(p, config, workspace, stream);
      };
      // Plans, module load, L2 state. cuBLASLt's FP8 may have no algorithm
      // for the shape: then it is no candidate.
      if (absl::Status first = run(0); !first.ok()) {
        if (fp8 != Fp8Scaling::kNone && config.version == GemmVersion::kCublasLt) continue;
        return first;
      }
      LaunchGraph graph;
      LS_RETURN_IF_ERROR(graph.Capture(run, stream));
      configs.push_back(config);
      graphs.push_back(std::move(graph));
    }
    if (graphs.empty()) continue;
    std::vector<std::array<float, kTuneRounds>> times(graphs.size());
    for (int round = 0; round < kTuneRounds; ++round) {
      for (size_t i = 0; i < graphs.size(); ++i) {
        LS_ASSIGN_OR_RETURN(times[i][round], graphs[i].Time(stream, start.get(), stop.get()));
      }
    }
    GemmTuneResult result{bucket, p.m, n, k, gated, fp8, accumulate, configs.front(), -1.f, -1.f};
    for (size_t i = 0; i < graphs.size(); ++i) {
      std::sort(times[i].begin(), times[i].end());
      const float us = 1e3f * times[i][kTuneRounds / 2];
      if (configs[i].version == GemmVersion::kCublasLt && configs[i].cublaslt_answer == 0) result.cublaslt_us = us;
      if (result.chosen_us < 0.f || us < result.chosen_us) {
        result.chosen_us = us;
        result.chosen = configs[i];
      }
    }
    table_[{bucket, n, k, fp8}] = result.chosen;
    results.push_back(result);
  }
  LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return results;
}

}  // namespace layerserve::kernels
