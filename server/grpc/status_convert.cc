// absl::Status -> grpc::Status (see status_convert.h).
#include "server/grpc/status_convert.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/echo.h"

namespace layerserve {

// Both enums follow google.rpc.Code; these asserts pin the numbering the cast
// below relies on.
static_assert(static_cast<int>(absl::StatusCode::kInvalidArgument) ==
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
static_assert(static_cast<int>(absl::StatusCode::kResourceExhausted) ==
              static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              static_cast<int>(grpc::StatusCode::UNAUTHENTICATED));

namespace {

// Debian's absl::string_view is not std::string_view (base/status_macros.h).
std::string CappedMessage(const absl::Status& status) {
  const absl::string_view message = status.message();
  return EchoForMessage(std::string_view(message.data(), message.size()), kMaxStatusMessageBytes);
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), CappedMessage(status));
}

std::string StreamErrorMessage(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", CappedMessage(status));
}

std::string StatusCodeName(const absl::Status& status) {
  return absl::StatusCodeToString(status.code());
}

}  // namespace layerserve
