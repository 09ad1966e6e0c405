// The one place where core errors (absl::Status) become gRPC statuses.
//
// The core reports canonical codes (INVALID_ARGUMENT, NOT_FOUND,
// RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL, ...); absl and
// gRPC number them identically, so the conversion keeps code and message.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace layerserve {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The text of an error on ModelStreamInfer, which carries no status code of
// its own (ModelStreamInferResponse.error_message): "CODE: message", so a
// client can still tell UNAVAILABLE (retry) from INVALID_ARGUMENT (do not).
std::string StreamErrorMessage(const absl::Status& status);

// Canonical upper-case code name ("OK", "INVALID_ARGUMENT", ...), the label
// value metrics and statistics use for a finished request.
std::string StatusCodeName(const absl::Status& status);

}  // namespace layerserve
