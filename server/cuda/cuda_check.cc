// cuBLASLt status conversion and the sticky-error classification.
#include "server/cuda/cuda_check.h"

#include "absl/strings/str_cat.h"

namespace layerserve::cuda {

absl::Status CublasError(cublasStatus_t status, const char* what, const char* file, int line) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", what, ": ",
                                          cublasLtGetStatusName(status), " (",
                                          cublasLtGetStatusString(status), ")"));
}

bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace layerserve::cuda
