// GemmEngine (see gemm.h): the per-call route between our kernels and
// cuBLASLt, and the cuBLASLt path itself.
//
// A cuBLASLt plan (the three matrix layouts, the heuristic's algorithm and,
// for GEMMs without bias, the matmul descriptor) is built once per shape and
// reused. A bias GEMM gets a fresh descriptor per call because the bias
// pointer is a descriptor attribute and plans are shared between streams.
#include "server/cuda/gemm.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/cuda/cuda_check.h"

namespace layerserve::cuda {
namespace {

using MatmulDesc = UniqueHandle<cublasLtMatmulDesc_t, &cublasLtMatmulDescDestroy>;
using MatrixLayout = UniqueHandle<cublasLtMatrixLayout_t, &cublasLtMatrixLayoutDestroy>;
using MatmulPreference = UniqueHandle<cublasLtMatmulPreference_t, &cublasLtMatmulPreferenceDestroy>;

cudaDataType_t CudaType(kernels::DType t) {
  return t == kernels::DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

// Column-major rows x cols with leading dimension ld.
absl::StatusOr<MatrixLayout> MakeLayout(kernels::DType t, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      &layout, CudaType(t), static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  return MatrixLayout(layout);
}

absl::StatusOr<MatmulDesc> MakeDesc(kernels::DType t, bool has_bias, const void* bias) {
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
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                             &epilogue, sizeof(epilogue)));
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    if (bias != nullptr) {
      LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
          raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
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
    alignment = std::min<int>(alignment,
                              static_cast<int>(std::min<uintptr_t>(256, address & (~address + 1))));
  }
  return alignment;
}

// Version 4 (the small-M kernel) takes at most this many rows
// (kernels::GemmVersion::kSmallMSplitK); custom mode gives larger M to v3.
constexpr int64_t kSmallMMaxRows = 64;

kernels::GemmParams KernelParams(const GemmParams& p) {
  kernels::GemmParams k;
  k.a = p.a;
  k.w = p.w;
  k.c = p.d;
  // Our kernels read each residual element and write its output in the same
  // thread, so the residual may be the output itself.
  k.residual = p.accumulate ? p.d : nullptr;
  k.m = p.m;
  k.n = p.n;
  k.k = p.k;
  k.dtype = p.dtype;
  return k;
}

// OK if our Hopper kernels (v3, v4) can run on the current device with this
// binary, else why not (UNIMPLEMENTED: not compute capability 9.0, or built
// without sm_90a). GemmSupported checks the shape, the alignment of the
// addresses and the device, and never dereferences, so an aligned placeholder
// address stands in for the operands.
absl::Status CustomKernelsUsable() {
  kernels::GemmParams probe;
  probe.c = reinterpret_cast<void*>(uintptr_t{256});
  probe.a = probe.w = probe.c;
  probe.m = 1;
  probe.n = probe.k = 64;
  for (const kernels::GemmVersion version :
       {kernels::GemmVersion::kSmallMSplitK, kernels::GemmVersion::kWarpSpecialized}) {
    LS_RETURN_IF_ERROR(kernels::GemmSupported(probe, kernels::GemmConfig{version}));
  }
  return absl::OkStatus();
}

absl::Status Validate(const GemmParams& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: non-positive shape m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.a == nullptr || p.w == nullptr || p.d == nullptr) {
    return absl::InvalidArgumentError("gemm: null operand");
  }
  if (p.lda < p.k || p.ldw < p.k || p.ldd < p.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: leading dimensions lda=", p.lda, " ldw=", p.ldw, " ldd=", p.ldd,
                     " too small for m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.dtype == kernels::DType::kF32) {
    return absl::InvalidArgumentError("gemm: operands must be bf16 or fp16");
  }
  return absl::OkStatus();
}

}  // namespace

struct GemmEngine::Plan {
  MatrixLayout w_layout, a_layout, d_layout;
  MatmulDesc desc;  // used as is when the GEMM has no bias
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
};

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
      absl::StrCat("gemm mode '", ToAbsl(name), "' is not one of auto, cublaslt, custom"));
}

absl::StatusOr<std::unique_ptr<GemmEngine>> GemmEngine::Create(size_t workspace_bytes,
                                                               GemmMode mode,
                                                               const GemmEngineTuning& tuning) {
  LS_ASSIGN_OR_RETURN(CublasLtHandle handle, CreateCublasLtHandle());
  bool custom_kernels = false;
  std::unique_ptr<kernels::GemmDispatcher> dispatcher;
  if (mode != GemmMode::kCublasLt) {
    absl::Status usable = CustomKernelsUsable();
    if (usable.ok() && mode == GemmMode::kAuto) {
      absl::StatusOr<std::unique_ptr<kernels::GemmDispatcher>> made =
          kernels::GemmDispatcher::Create();
      if (made.ok()) {
        dispatcher = *std::move(made);
        LS_RETURN_IF_ERROR(TuneGemmDispatcher(*dispatcher, tuning.shapes, tuning.max_m,
                                              tuning.options, std::cerr));
      } else {
        usable = made.status();
      }
    }
    custom_kernels = usable.ok();
    if (!custom_kernels) {
      // A failed runtime call stays in the thread's last-error slot, where the
      // next kernel launch check would find it and blame that kernel.
      static_cast<void>(cudaGetLastError());
      std::cerr << "layerserve: gemm: mode " << GemmModeName(mode)
                << ": our GEMM kernels are unavailable (" << usable.message()
                << "); every GEMM runs on cuBLASLt" << std::endl;
    }
  }
  return std::unique_ptr<GemmEngine>(new GemmEngine(std::move(handle), workspace_bytes, mode,
                                                    custom_kernels, std::move(dispatcher)));
}

GemmEngine::GemmEngine(CublasLtHandle handle, size_t workspace_bytes, GemmMode mode,
                       bool custom_kernels, std::unique_ptr<kernels::GemmDispatcher> dispatcher)
    : handle_(std::move(handle)),
      workspace_bytes_(workspace_bytes),
      mode_(mode),
      custom_kernels_(custom_kernels),
      dispatcher_(std::move(dispatcher)) {}

GemmEngine::~GemmEngine() = default;

size_t GemmEngine::CachedPlans() const {
  MutexLock lock(&mu_);
  return plans_.size();
}

absl::StatusOr<const GemmEngine::Plan*> GemmEngine::GetPlan(const GemmParams& p, int alignment) {
  const bool has_bias = p.bias != nullptr;
  const PlanKey key{
      p.m,      p.n,          p.k,      p.lda, p.ldw, p.ldd, static_cast<int>(p.dtype),
      has_bias, p.accumulate, alignment};
  MutexLock lock(&mu_);
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();

  // Planning runs under the lock: it happens once per shape, and a second
  // thread asking for the same shape would otherwise plan it twice.
  auto plan = std::make_unique<Plan>();
  LS_ASSIGN_OR_RETURN(plan->w_layout, MakeLayout(p.dtype, p.k, p.n, p.ldw));
  LS_ASSIGN_OR_RETURN(plan->a_layout, MakeLayout(p.dtype, p.k, p.m, p.lda));
  LS_ASSIGN_OR_RETURN(plan->d_layout, MakeLayout(p.dtype, p.n, p.m, p.ldd));
  LS_ASSIGN_OR_RETURN(plan->desc, MakeDesc(p.dtype, has_bias, nullptr));

  cublasLtMatmulPreference_t raw_pref = nullptr;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&raw_pref));
  MatmulPreference pref(raw_pref);
  const uint64_t max_workspace = workspace_bytes_;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace)));
  const uint32_t align_bytes = static_cast<uint32_t>(alignment);
  for (const auto attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        raw_pref, attribute, &align_bytes, sizeof(align_bytes)));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
      handle_.get(), plan->desc.get(), plan->w_layout.get(), plan->a_layout.get(),
      plan->d_layout.get(), plan->d_layout.get(), raw_pref, 1, &result, &found));
  if (found == 0) {
    return absl::InternalError(absl::StrCat("gemm: cuBLASLt has no algorithm for m=", p.m,
                                            " n=", p.n, " k=", p.k, " bias=", has_bias,
                                            " alignment=", alignment));
  }
  plan->algo = result.algo;
  plan->workspace_bytes = result.workspaceSize;
  const Plan* out = plan.get();
  plans_.emplace(key, std::move(plan));
  return out;
}

kernels::GemmConfig GemmEngine::Route(const GemmParams& p) const {
  const kernels::GemmConfig cublaslt{kernels::GemmVersion::kCublasLt};
  // Our kernels read dense row-major bf16 and have no bias epilogue.
  if (!custom_kernels_ || p.dtype != kernels::DType::kBF16 || p.bias != nullptr ||
      p.lda != p.k || p.ldw != p.k || p.ldd != p.n) {
    return cublaslt;
  }
  kernels::GemmConfig config;  // split_k = block_n = 0: the kernels size themselves
  if (mode_ == GemmMode::kCustom) {
    config.version = p.m <= kSmallMMaxRows ? kernels::GemmVersion::kSmallMSplitK
                                           : kernels::GemmVersion::kWarpSpecialized;
  } else {
    config = dispatcher_->Choose(p.m, p.n, p.k);
  }
  // The per-call conditions (N and K multiples of 8, 16-byte aligned
  // operands): where they fail, cuBLASLt, as GemmDispatcher::Run does.
  if (config.version != kernels::GemmVersion::kCublasLt &&
      !kernels::GemmSupported(KernelParams(p), config).ok()) {
    return cublaslt;
  }
  return config;
}

absl::Status GemmEngine::Gemm(const GemmParams& p, const GemmWorkspace& workspace,
                              cudaStream_t stream) {
  LS_RETURN_IF_ERROR(Validate(p));
  const kernels::GemmConfig config = Route(p);
  if (config.version == kernels::GemmVersion::kCublasLt) {
    return RunCublasLt(p, workspace, stream);
  }
  return kernels::LaunchGemm(KernelParams(p), config, stream);
}

absl::Status GemmEngine::RunCublasLt(const GemmParams& p, const GemmWorkspace& workspace,
                                     cudaStream_t stream) {
  const int alignment = AlignmentOf({p.a, p.w, p.d, p.bias});
  if (alignment < 2) return absl::InvalidArgumentError("gemm: operand not 2-byte aligned");
  LS_ASSIGN_OR_RETURN(const Plan* plan, GetPlan(p, alignment));
  if (workspace.bytes < plan->workspace_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemm: workspace of ", workspace.bytes, " bytes, the plan needs ", plan->workspace_bytes));
  }
  MatmulDesc bias_desc;
  cublasLtMatmulDesc_t desc = plan->desc.get();
  if (p.bias != nullptr) {
    LS_ASSIGN_OR_RETURN(bias_desc, MakeDesc(p.dtype, true, p.bias));
    desc = bias_desc.get();
  }
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  LS_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle_.get(), desc, &alpha, p.w, plan->w_layout.get(),
                                           p.a, plan->a_layout.get(), &beta, p.d,
                                           plan->d_layout.get(), p.d, plan->d_layout.get(),
                                           &plan->algo, workspace.data, workspace.bytes, stream));
  return absl::OkStatus();
}

}  // namespace layerserve::cuda
