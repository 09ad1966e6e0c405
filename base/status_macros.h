// Status propagation helpers for absl::Status / absl::StatusOr.
//
// Errors travel as values from the point of failure up to the gRPC edge (or
// main()); these macros keep that plumbing to one line per call.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include <string_view>

namespace layerserve {

// Debian's Abseil is built with ABSL_OPTION_USE_STD_STRING_VIEW=0, so
// absl::string_view is its own type and absl::StrCat / Status constructors do
// not take a std::string_view. This is the one bridge between them.
inline absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace layerserve

#define LS_CONCAT_INNER_(a, b) a##b
#define LS_CONCAT_(a, b) LS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define LS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status ls_status_ = (expr);      \
    if (!ls_status_.ok()) return ls_status_; \
  } while (0)

// `LS_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a StatusOr or returns
// its error.
#define LS_ASSIGN_OR_RETURN(lhs, expr) \
  LS_ASSIGN_OR_RETURN_IMPL_(LS_CONCAT_(ls_statusor_, __LINE__), lhs, expr)
#define LS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
