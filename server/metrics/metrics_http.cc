// MetricsHttpServer: cpp-httplib serving PrometheusMetrics' exposition text
// (and /healthz), over HTTP or HTTPS, optionally behind a bearer token.
#include "server/metrics/metrics_http.h"

#include <httplib.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/auth_token.h"
#include "server/metrics/prometheus_metrics.h"

namespace layerserve {
namespace {

// Threads that answer scrapes. More than one so that a keep-alive connection
// held open by one scraper does not stall another (e.g. curl beside Prometheus).
constexpr size_t kHttpWorkerThreads = 4;

constexpr time_t kKeepAliveSeconds = 1;

constexpr auto kStopPollInterval = std::chrono::milliseconds(1);

// False, with `res` set to 401, for a request that needs the token and does
// not carry it ("Authorization: Bearer <token>"; httplib's header map
// compares names without case).
bool Authorized(const std::string& token, bool open, const httplib::Request& req,
                httplib::Response& res) {
  if (token.empty() || open) return true;
  std::vector<std::string_view> values;
  const auto [begin, end] = req.headers.equal_range("Authorization");
  for (auto it = begin; it != end; ++it) values.push_back(it->second);
  const BearerCheck check = CheckBearer(values, token);
  if (check == BearerCheck::kOk) return true;
  res.status = 401;
  res.set_header("WWW-Authenticate", "Bearer realm=\"layerserve\"");
  res.set_content(BearerRefusalMessage(check, "header") + "\n", "text/plain");
  return false;
}

// The SSL_CTX of the HTTPS endpoint: TLS 1.2 or later, no compression or
// renegotiation, the chain and key, and with client CAs a required and
// verified client certificate. False (the endpoint does not start) when a
// file does not load.
bool SetUpTls(const MetricsHttpSecurity& security, SSL_CTX& ctx) {
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  // An encrypted key would make OpenSSL ask for a passphrase on the terminal.
  SSL_CTX_set_default_passwd_cb(&ctx, [](char*, int, int, void*) { return 0; });
  if (SSL_CTX_use_certificate_chain_file(&ctx, security.tls_cert_file.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(&ctx, security.tls_key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(&ctx) != 1) {
    return false;
  }
  if (!security.tls_client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(&ctx, security.tls_client_ca_file.c_str(), nullptr) != 1) {
      return false;
    }
    // Named in the handshake, so a client with several certificates picks.
    SSL_CTX_set_client_CA_list(&ctx, SSL_load_client_CA_file(security.tls_client_ca_file.c_str()));
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return true;
}

}  // namespace

struct MetricsHttpServer::Impl {
  std::unique_ptr<httplib::Server> server;  // an httplib::SSLServer for HTTPS
  std::thread thread;
  std::atomic<bool> listen_returned{false};
  int port = 0;
};

MetricsHttpServer::MetricsHttpServer() : impl_(std::make_unique<Impl>()) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

int MetricsHttpServer::port() const { return impl_->port; }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const PrometheusMetrics* metrics,
    const MetricsHttpSecurity& security) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics must not be null");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port out of range: ", port));
  }
  std::unique_ptr<MetricsHttpServer> self(new MetricsHttpServer());
  if (security.tls_cert_file.empty() != security.tls_key_file.empty()) {
    return absl::InvalidArgumentError("metrics: HTTPS needs both a certificate and a key");
  }
  if (security.tls_cert_file.empty()) {
    self->impl_->server = std::make_unique<httplib::Server>();
  } else {
    ERR_clear_error();
    auto https = std::make_unique<httplib::SSLServer>(
        [&security](SSL_CTX& ctx) { return SetUpTls(security, ctx); });
    if (!https->is_valid()) {
      const unsigned long error = ERR_get_error();
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(
          "metrics: cannot serve HTTPS with --tls-cert-file=", security.tls_cert_file,
          " and --tls-key-file=", security.tls_key_file,
          security.tls_client_ca_file.empty()
              ? ""
              : absl::StrCat(" and --tls-client-ca-file=", security.tls_client_ca_file),
          error == 0 ? "" : absl::StrCat(": ", ERR_reason_error_string(error))));
    }
    self->impl_->server = std::move(https);
  }
  httplib::Server& server = *self->impl_->server;
  server.new_task_queue = [] { return new httplib::ThreadPool(kHttpWorkerThreads); };
  // httplib's workers notice stop() only between requests, so an idle
  // keep-alive connection (Prometheus holds one) delays Stop() by this much;
  // scrapes come seconds apart, so a long keep-alive buys nothing.
  server.set_keep_alive_timeout(kKeepAliveSeconds);
  // httplib's default also sets SO_REUSEPORT, which lets a second process bind
  // the same port and silently take half the scrapes; keep only SO_REUSEADDR
  // (a restart may rebind while old connections sit in TIME_WAIT).
  server.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.Get("/metrics", [metrics, token = security.auth_token, open = security.metrics_open](
                             const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(token, open, req, res)) return;
    res.set_content(metrics->Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/healthz", [token = security.auth_token, open = security.healthz_open](
                             const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(token, open, req, res)) return;
    res.set_content("ok\n", "text/plain");
  });

  if (port == 0) {
    const int bound = server.bind_to_any_port(host);
    if (bound <= 0) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot bind ", host, ":<any>"));
    }
    self->impl_->port = bound;
  } else {
    if (!server.bind_to_port(host, port)) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot bind ", host, ":", port));
    }
    self->impl_->port = port;
  }

  Impl* impl = self->impl_.get();
  impl->thread = std::thread([impl] {
    impl->server->listen_after_bind();
    impl->listen_returned.store(true);
  });
  return self;
}

void MetricsHttpServer::Stop() {
  if (!impl_->thread.joinable()) return;
  // httplib's stop() does nothing until the accept loop has begun, so a Stop()
  // right after Start() first waits for the loop (or for its early return).
  while (!impl_->server->is_running() && !impl_->listen_returned.load()) {
    std::this_thread::sleep_for(kStopPollInterval);
  }
  impl_->server->stop();
  impl_->thread.join();
}

}  // namespace layerserve
