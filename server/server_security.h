// The security the command line asks for (docs/security.md), loaded and
// checked before anything binds a port: the gRPC port's TLS material, the
// metrics endpoint's HTTPS and token, and the bearer token with what stays
// open without it. Only main.cc uses it; a file of its own beside
// server_flags.cc to keep main.cc to the wiring.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/auth/auth_token.h"
#include "server/grpc/tls_files.h"
#include "server/metrics/metrics_http.h"
#include "server/server_flags.h"

namespace layerserve {

struct ServerSecurity {
  std::optional<TlsMaterial> grpc_tls;  // unset: plaintext gRPC
  MetricsHttpSecurity metrics;
  std::string auth_token;  // empty: no token needed
  OpenWithoutToken auth_open;

  // One line for the start-up log: what each port speaks and asks for. It
  // names files, never the token.
  std::string Summary() const;
};

// Reads the files the --tls-* and --auth-token-file flags name and checks
// them with --metrics-tls and --auth-open. INVALID_ARGUMENT naming the flag
// (and file) at fault.
absl::StatusOr<ServerSecurity> LoadServerSecurity(const ServerFlags& flags);

}  // namespace layerserve
