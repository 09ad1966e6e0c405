// The one place where core errors (absl::Status) become gRPC statuses.
//
// The core reports canonical codes (INVALID_ARGUMENT, NOT_FOUND,
// RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL, ...); absl and
// gRPC number them identically, so the conversion keeps code and message.
// The message is capped (kMaxStatusMessageBytes): it travels in the trailing
// metadata, and a status larger than the client's metadata limit reaches the
// client as RESOURCE_EXHAUSTED instead of the code the server meant.
#pragma once

#include <cstddef>

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace layerserve {

// Longest status message sent. gRPC percent-encodes bytes outside printable
// ASCII in grpc-message, so 1 KiB stays under 3 KiB on the wire, well within
// the 8 KiB metadata limit clients have by default. Messages are built to be
// far shorter (base/echo.h); this is the last guard.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

grpc::Status ToGrpcStatus(const absl::Status& status);

// The text of an error on ModelStreamInfer, which carries no status code of
// its own (ModelStreamInferResponse.error_message): "CODE: message", so a
// client can still tell UNAVAILABLE (retry) from INVALID_ARGUMENT (do not).
std::string StreamErrorMessage(const absl::Status& status);

// Canonical upper-case code name ("OK", "INVALID_ARGUMENT", ...), the label
// value metrics and statistics use for a finished request.
std::string StatusCodeName(const absl::Status& status);

}  // namespace layerserve
