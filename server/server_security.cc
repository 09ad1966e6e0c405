// Loading the security flags (see server_security.h).
#include "server/server_security.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace layerserve {

absl::StatusOr<ServerSecurity> LoadServerSecurity(const ServerFlags& flags) {
  ServerSecurity security;
  // CLI11 makes --tls-cert-file and --tls-key-file come together, and
  // --tls-client-ca-file come with them; --metrics-tls is a boolean it
  // cannot tie to them (--metrics-tls=false needs nothing).
  if (flags.metrics_tls && flags.tls_cert_file.empty()) {
    return absl::InvalidArgumentError("--metrics-tls needs --tls-cert-file and --tls-key-file");
  }
  if (!flags.tls_cert_file.empty()) {
    LS_ASSIGN_OR_RETURN(TlsMaterial tls, LoadTlsMaterial(flags.tls_cert_file, flags.tls_key_file,
                                                         flags.tls_client_ca_file));
    security.grpc_tls = std::move(tls);
  }
  if (flags.metrics_tls) {
    security.metrics.tls_cert_file = flags.tls_cert_file;
    security.metrics.tls_key_file = flags.tls_key_file;
    security.metrics.tls_client_ca_file = flags.tls_client_ca_file;
  }
  LS_ASSIGN_OR_RETURN(security.auth_open, ParseAuthOpen(flags.auth_open));
  if (!flags.auth_token_file.empty()) {
    LS_ASSIGN_OR_RETURN(security.auth_token, ReadAuthTokenFile(flags.auth_token_file));
    security.metrics.auth_token = security.auth_token;
    security.metrics.metrics_open = security.auth_open.metrics;
    security.metrics.healthz_open = security.auth_open.health;
  }
  return security;
}

std::string ServerSecurity::Summary() const {
  std::string grpc = "plaintext";
  if (grpc_tls) {
    grpc = grpc_tls->client_ca_pem.empty() ? "TLS" : "TLS with client certificates (mutual TLS)";
  }
  std::string metrics_transport = "plain HTTP";
  if (!metrics.tls_cert_file.empty()) {
    metrics_transport =
        metrics.tls_client_ca_file.empty() ? "HTTPS" : "HTTPS with client certificates";
  }
  const std::string token =
      auth_token.empty()
          ? "no token: any client that reaches the gRPC port can run inference"
          : absl::StrCat("bearer token required except for ", FormatAuthOpen(auth_open));
  return absl::StrCat("security: gRPC ", grpc, ", /metrics ", metrics_transport, "; ", token,
                      " (docs/security.md)");
}

}  // namespace layerserve
