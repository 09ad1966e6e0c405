// The HTTP(S) endpoint that serves PrometheusMetrics' text: GET /metrics and
// GET /healthz, on a port of its own.
//
// The endpoint is cpp-httplib + prometheus-cpp's TextSerializer rather than
// prometheus-cpp's civetweb Exposer: civetweb starts threads with 100 KB
// stacks, too small for a process that links cuBLASLt (94 KB static TLS).
//
// httplib only parses and routes: the endpoint accepts connections itself and
// bounds what each client gets (MetricsHttpLimits), because httplib 0.11.4
// serves each connection on a thread of a small pool with a timeout per
// recv() only, so a few clients that drip their requests a byte at a time
// would hold every thread, and it buffers whatever body or header block a
// client sends (metrics_http.cc says how the limits hold).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace layerserve {

class PrometheusMetrics;

// What the metrics endpoint asks of its clients (docs/security.md). The
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

// What the endpoint gives any one connection (docs/security.md). The
// defaults suit Prometheus (one short GET a scrape interval, never a body)
// and hold against clients that send slowly, send nothing or send too much;
// tests shrink them.
struct MetricsHttpLimits {
  // Connections held at once. One more evicts the oldest connection that has
  // not yet sent its whole request head (or that is being closed), so that
  // slow clients cannot lock a scraper out; when every held connection is
  // being answered the new one is closed unanswered.
  int max_connections = 64;
  // From accept to the end of the request head, TLS handshake included; a
  // client still sending by then gets 408 and is closed.
  std::chrono::milliseconds head_timeout{5000};
  // For writing a reply; a client that does not read it by then is closed.
  std::chrono::milliseconds reply_timeout{10000};
  // The request line and headers together; a longer head gets 431.
  size_t max_head_bytes = 16 * 1024;
};

// Serves GET /metrics (and GET /healthz): one thread accepts, and each
// connection is served, one request only, on a thread of its own.
class MetricsHttpServer {
 public:
  // Binds `host:port` (port 0 picks a free one) and starts serving.
  // `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, const PrometheusMetrics* metrics,
      const MetricsHttpSecurity& security = {}, const MetricsHttpLimits& limits = {});
  ~MetricsHttpServer();  // Stop()
  int port() const;
  // Closes the port and every connection, and returns once their threads
  // have ended. Idempotent.
  void Stop();

 private:
  MetricsHttpServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace layerserve
