// The HTTP(S) endpoint that serves PrometheusMetrics' text: GET /metrics and
// GET /healthz, on a port of its own.
//
// The endpoint is cpp-httplib + prometheus-cpp's TextSerializer rather than
// prometheus-cpp's civetweb Exposer: civetweb starts threads with 100 KB
// stacks, too small for a process that links cuBLASLt (94 KB static TLS).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace layerserve {

class PrometheusMetrics;

// What the metrics endpoint asks of its clients (README.md: Security). The
// default: plain HTTP, open to all.
struct MetricsHttpSecurity {
  // Both set: HTTPS only (TLS 1.2 or later), with this certificate chain and
  // key (PEM files, checked beforehand: server/grpc/tls_files.h).
  std::string tls_cert_file;
  std::string tls_key_file;
  // Set, with HTTPS: every connection must present a client certificate
  // that these CAs signed.
  std::string tls_client_ca_file;
  // Not empty: requests need "Authorization: Bearer <auth_token>", except
  // those the two flags leave open; others get 401.
  std::string auth_token;
  bool metrics_open = true;  // GET /metrics without a token
  bool healthz_open = true;  // GET /healthz without a token
};

// Serves GET /metrics (and GET /healthz) on its own thread.
class MetricsHttpServer {
 public:
  // Binds `host:port` (port 0 picks a free one) and starts serving.
  // `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, const PrometheusMetrics* metrics,
      const MetricsHttpSecurity& security = {});
  ~MetricsHttpServer();  // Stop()
  int port() const;
  void Stop();

 private:
  MetricsHttpServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace layerserve
