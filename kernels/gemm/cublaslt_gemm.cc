// Version 0: C = A·Wᵀ (+R) through cuBLASLt, the yardstick every custom
// version is measured against and the dispatcher's fallback.
//
// cuBLASLt is column-major, so the row-major product is computed as its
// transpose: Cᵀ[N,M] = op_T(W as K x N) · (A as K x M), the "TN" layout
// cuBLASLt serves best. The residual enters as the C matrix with beta = 1.
// Plans (layouts + the heuristic's first algorithm) are cached per shape,
// residual use and operand alignment.
//
// In-place residual (C aliasing D): with cuBLASLt 13.0 on H100 the test suite
// saw small-M results that had the accumulator cut to bf16 before the
// residual was added (errors of ~half a bf16 ulp of the product, 4-6x the
// single-rounding bound). So the residual is first copied to a stream-ordered
// scratch buffer and cuBLASLt never sees aliased C and D.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels {
namespace {

absl::Status CublasError(cublasStatus_t status, const char* what) {
  return absl::InternalError(absl::StrCat("cuBLASLt ", what, ": ", cublasLtGetStatusName(status), " (",
                                          cublasLtGetStatusString(status), ")"));
}

#define LS_CUBLASLT_RETURN_IF_ERROR(expr)                                   \
  do {                                                                      \
    const cublasStatus_t ls_cublas_status_ = (expr);                        \
    if (ls_cublas_status_ != CUBLAS_STATUS_SUCCESS) return CublasError(ls_cublas_status_, #expr); \
  } while (0)

// Largest power of two (up to 256) dividing the address: cuBLASLt picks
// kernels by the alignment it is promised.
uint32_t Alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 2 && v % a != 0) a /= 2;
  return a;
}

constexpr size_t kWorkspaceBytes = 32u << 20;

}  // namespace

struct CublasLtGemm::Impl {
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t w_layout = nullptr;
    cublasLtMatrixLayout_t a_layout = nullptr;
    cublasLtMatrixLayout_t c_layout = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // (m, n, k, has residual, alignment of the least-aligned operand)
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, uint32_t>;

  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<Key, Plan> plans;

  ~Impl() {
    for (auto& [key, plan] : plans) Destroy(plan);
    if (workspace != nullptr) cudaFree(workspace);
    if (handle != nullptr) cublasLtDestroy(handle);
  }

  static void Destroy(Plan& plan) {
    if (plan.c_layout != nullptr) cublasLtMatrixLayoutDestroy(plan.c_layout);
    if (plan.a_layout != nullptr) cublasLtMatrixLayoutDestroy(plan.a_layout);
    if (plan.w_layout != nullptr) cublasLtMatrixLayoutDestroy(plan.w_layout);
    if (plan.op != nullptr) cublasLtMatmulDescDestroy(plan.op);
  }

  absl::Status MakePlan(const Key& key, Plan& plan) {
    const auto [m, n, k, has_residual, alignment] = key;
    LS_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans_w = CUBLAS_OP_T;
    const cublasOperation_t trans_a = CUBLAS_OP_N;
    LS_CUBLASLT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof(trans_w)));
    LS_CUBLASLT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_a, sizeof(trans_a)));
    LS_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.w_layout, CUDA_R_16BF, k, n, k));
    LS_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.a_layout, CUDA_R_16BF, k, m, k));
    LS_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.c_layout, CUDA_R_16BF, n, m, n));

    cublasLtMatmulPreference_t pref = nullptr;
    LS_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &alignment, sizeof(alignment));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = cublasLtMatmulAlgoGetHeuristic(handle, plan.op, plan.w_layout, plan.a_layout, plan.c_layout,
                                          plan.c_layout, pref, 1, &result, &returned);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError(st, "heuristic");
    if (returned == 0) {
      return absl::UnimplementedError(absl::StrCat("cuBLASLt has no algorithm for m=", m, " n=", n, " k=", k));
    }
    plan.algo = result.algo;
    return absl::OkStatus();
  }
};

CublasLtGemm::CublasLtGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CublasLtGemm::~CublasLtGemm() = default;

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create() {
  auto impl = std::make_unique<Impl>();
  LS_CUBLASLT_RETURN_IF_ERROR(cublasLtCreate(&impl->handle));
  LS_CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->workspace, kWorkspaceBytes));
  return std::unique_ptr<CublasLtGemm>(new CublasLtGemm(std::move(impl)));
}

absl::Status CublasLtGemm::Run(const GemmParams& p, cudaStream_t stream) {
  if (p.dtype != DType::kBF16) return absl::InvalidArgumentError("cuBLASLt gemm: only bf16 is wired");
  if (p.a == nullptr || p.w == nullptr || p.c == nullptr || p.m < 1 || p.n < 1 || p.k < 1) {
    return absl::InvalidArgumentError("cuBLASLt gemm: bad params");
  }
  const bool has_residual = p.residual != nullptr;
  uint32_t alignment = std::min({Alignment(p.a), Alignment(p.w), Alignment(p.c)});
  if (has_residual) alignment = std::min(alignment, Alignment(p.residual));
  const Impl::Key key{p.m, p.n, p.k, has_residual, alignment};
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) {
    Impl::Plan plan;
    const absl::Status made = impl_->MakePlan(key, plan);
    if (!made.ok()) {
      Impl::Destroy(plan);
      return made;
    }
    it = impl_->plans.emplace(key, plan).first;
  }
  const Impl::Plan& plan = it->second;
  const float alpha = 1.f;
  const float beta = has_residual ? 1.f : 0.f;
  const void* c_in = has_residual ? p.residual : p.c;
  void* residual_copy = nullptr;
  if (has_residual && p.residual == p.c) {
    const size_t bytes = static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * 2;
    LS_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&residual_copy, bytes, stream));
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(residual_copy, p.residual, bytes, cudaMemcpyDeviceToDevice, stream));
    c_in = residual_copy;
  }
  const cublasStatus_t st = cublasLtMatmul(impl_->handle, plan.op, &alpha, p.w, plan.w_layout, p.a, plan.a_layout,
                                           &beta, c_in, plan.c_layout, p.c, plan.c_layout, &plan.algo,
                                           impl_->workspace, kWorkspaceBytes, stream);
  if (residual_copy != nullptr) LS_CUDA_RETURN_IF_ERROR(cudaFreeAsync(residual_copy, stream));
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError(st, "cublasLtMatmul");
  return absl::OkStatus();
}

}  // namespace layerserve::kernels
