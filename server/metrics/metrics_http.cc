// MetricsHttpServer: PrometheusMetrics' exposition text (and /healthz) over
// HTTP or HTTPS, optionally behind a bearer token, on a port that slow and
// hostile clients cannot take from the scrapers.
//
// How the limits hold (MetricsHttpLimits; docs/security.md):
//  - Each connection gets a thread of its own, so no number of slow clients
//    below max_connections can keep a scrape waiting for a thread (httplib's
//    pool of a few threads, each stuck on a client that drips its request,
//    answered no scrape at all).
//  - Above max_connections a new connection evicts the oldest one still
//    sending its head (shutdown(2), which wakes its thread): a scraper sends
//    its head at once, so it is never the oldest of a crowd for long, and a
//    flood of slow clients costs the scrapers nothing but the accept. Only
//    when every held connection is being answered (bounded by reply_timeout)
//    is a newcomer turned away. No cap per client address: on one host, or
//    behind a NAT, attacker and scraper share an address.
//  - A connection lives by deadlines, not per-recv timeouts: its whole head
//    (TLS handshake included) by head_timeout after accept (else 408), its
//    reply by reply_timeout; then the connection closes. One request per
//    connection: a scrape comes every few seconds, so keep-alive would save
//    little and hold a thread between scrapes.
//  - The head is read into a buffer of max_head_bytes (431 past it) before
//    httplib sees a byte, and httplib reads only that buffer (HeadStream):
//    it never buffers a body or a header block of a client's choosing.
//    Nothing here takes a body, so one announced (Content-Length other than
//    0, Transfer-Encoding, Expect: 100-continue) gets 413 unread.
#include "server/metrics/metrics_http.h"

#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/thread_name.h"
#include "server/auth/auth_token.h"
#include "server/metrics/http_connection.h"
#include "server/metrics/prometheus_metrics.h"

namespace layerserve {
namespace {

// How long a connection whose reply is out waits for the client to close its
// side (HttpConnection::FinishAndDrain) before closing anyway.
constexpr auto kDrainTime = std::chrono::seconds(1);

// How long the accept loop pauses when accept() fails for want of file
// descriptors or memory: the connection stays in the backlog, and polling
// again at once would spin.
constexpr int kAcceptBackoffMs = 100;

// The replies the endpoint gives before httplib parses anything.
constexpr std::string_view kHeadTimedOut =
    "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
constexpr std::string_view kHeadTooLarge =
    "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
    "Content-Length: 0\r\n\r\n";

// httplib's request parser and router, fed one head at a time: the endpoint
// runs its own accept loop, and process_request (what httplib's loop calls
// for each request) is protected.
class Router final : public httplib::Server {
 public:
  using httplib::Server::process_request;
};

// True for a request that announces a body, which no path here takes.
bool AnnouncesBody(const httplib::Request& req) {
  return req.has_header("Transfer-Encoding") || req.has_header("Expect") ||
         (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0");
}

void RefuseBody(httplib::Response& res) {
  res.status = 413;
  res.set_content("this endpoint takes no request body\n", "text/plain");
}

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

// A listening socket on the first address of `host` that takes `port` (port
// 0: a free one), as httplib bound. SO_REUSEADDR so that a restart may rebind
// while old connections sit in TIME_WAIT, but not SO_REUSEPORT (httplib's
// default), which would let a second process bind the same port and silently
// take half the scrapes. Non-blocking: the accept loop polls it.
absl::StatusOr<int> Listen(const std::string& host, int port) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string where = absl::StrCat(host, ":", port == 0 ? "<any>" : std::to_string(port));
  if (const int err = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
      err != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot bind ", where, ": ", gai_strerror(err)));
  }
  int listening = -1;
  int error = 0;
  for (const addrinfo* a = found; a != nullptr && listening < 0; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;  // an address family this machine lacks
    const int yes = 1;
    const int no = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    // "::" takes IPv4 clients too, whatever the system's default.
    if (a->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof(no));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
      listening = fd;
    } else {
      error = errno;
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (listening < 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot bind ", where,
                                               error == 0 ? "" : ": ",
                                               error == 0 ? "" : std::strerror(error)));
  }
  return listening;
}

struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};

}  // namespace

struct MetricsHttpServer::Impl {
  // A held connection. Its thread closes the fd, and only after it has left
  // `slots`, so that an fd the map holds is always open (never one reused by
  // a newer connection) when eviction or Stop shuts it down.
  struct Slot {
    int fd = -1;
    bool evictable = true;  // reading its head, or draining after its reply
    bool evicted = false;   // shut down to make room; its thread is ending
    std::thread thread;
  };

  ~Impl() {
    if (listen_fd >= 0) close(listen_fd);
    if (wake_fd >= 0) close(wake_fd);
  }

  void AcceptLoop();
  // Holds a new connection and starts its thread (or closes it: see the top).
  void Admit(int fd);
  // Shuts the oldest evictable connection down; false if there is none.
  bool EvictOldest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A connection's thread: reads its head and answers it.
  void Serve(uint64_t id, int fd, HttpDeadline head_deadline);
  void SetEvictable(uint64_t id, bool evictable);
  // Takes a connection out of `slots`, its thread into `finished`.
  void Release(uint64_t id);
  // Joins the threads of released connections.
  void JoinFinished();

  MetricsHttpLimits limits;
  Router router;
  std::unique_ptr<SSL_CTX, SslCtxFree> tls;  // null: plain HTTP
  int listen_fd = -1;
  int wake_fd = -1;  // an eventfd: Stop() wakes the accept loop through it
  int port = 0;
  std::thread acceptor;

  Mutex mu;
  CondVar released;  // signalled whenever a connection leaves `slots`
  std::map<uint64_t, Slot> slots ABSL_GUARDED_BY(mu);  // by id: in accept order
  int held ABSL_GUARDED_BY(mu) = 0;                    // slots not evicted
  uint64_t next_id ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::thread> finished ABSL_GUARDED_BY(mu);
};

void MetricsHttpServer::Impl::AcceptLoop() {
  NameThisThread("metrics-accept");
  pollfd fds[2] = {{.fd = listen_fd, .events = POLLIN, .revents = 0},
                   {.fd = wake_fd, .events = POLLIN, .revents = 0}};
  for (;;) {
    if (poll(fds, 2, -1) < 0) continue;  // EINTR (or a passing ENOMEM)
    if (fds[1].revents != 0) return;     // Stop()
    JoinFinished();
    if (fds[0].revents == 0) continue;
    const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Admit(fd);
    } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      poll(&fds[1], 1, kAcceptBackoffMs);
    }
  }
}

void MetricsHttpServer::Impl::Admit(int fd) {
  MutexLock lock(&mu);
  if (held >= limits.max_connections && !EvictOldest()) {
    close(fd);
    return;
  }
  const uint64_t id = next_id++;
  Slot& slot = slots[id];
  slot.fd = fd;
  try {
    slot.thread = std::thread(&Impl::Serve, this, id, fd,
                              std::chrono::steady_clock::now() + limits.head_timeout);
  } catch (const std::system_error&) {  // no thread to be had: refuse this one
    slots.erase(id);
    close(fd);
    return;
  }
  ++held;
}

bool MetricsHttpServer::Impl::EvictOldest() {
  for (auto& [id, slot] : slots) {
    if (slot.evictable && !slot.evicted) {
      shutdown(slot.fd, SHUT_RDWR);
      slot.evicted = true;
      --held;
      return true;
    }
  }
  return false;
}

void MetricsHttpServer::Impl::Serve(uint64_t id, int fd, HttpDeadline head_deadline) {
  NameThisThread("metrics-http");
  // TLS writes go through write(2), which raises SIGPIPE on a connection the
  // client has reset; blocked here, it stays pending on this thread (and goes
  // with it) while the write fails with EPIPE. (Plain writes use MSG_NOSIGNAL.)
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);

  HttpConnection connection(fd, tls.get());
  switch (connection.ReadHead(limits.max_head_bytes, head_deadline)) {
    case HttpConnection::HeadResult::kComplete: {
      SetEvictable(id, false);
      HeadStream stream(connection, std::chrono::steady_clock::now() + limits.reply_timeout);
      bool client_closes = false;  // the endpoint closes after one request anyway
      bool body = false;
      router.process_request(stream, /*close_connection=*/true, client_closes,
                             [&body](httplib::Request& req) { body = AnnouncesBody(req); });
      // The usual scrape: nothing more is coming, so close at once (the FIN
      // follows the reply, and the thread is free).
      if (!body && !connection.InputPending()) {
        Release(id);
        return;
      }
      break;
    }
    case HttpConnection::HeadResult::kTooLarge:
      connection.Write(kHeadTooLarge, std::chrono::steady_clock::now() + limits.reply_timeout);
      break;
    case HttpConnection::HeadResult::kTimedOut:
      connection.Write(kHeadTimedOut, std::chrono::steady_clock::now() + limits.reply_timeout);
      break;
    case HttpConnection::HeadResult::kClosed:
      Release(id);
      return;  // `connection` closes the fd after Release
  }
  SetEvictable(id, true);
  connection.FinishAndDrain(std::chrono::steady_clock::now() + kDrainTime);
  Release(id);
}

void MetricsHttpServer::Impl::SetEvictable(uint64_t id, bool evictable) {
  MutexLock lock(&mu);
  slots.at(id).evictable = evictable;
}

void MetricsHttpServer::Impl::Release(uint64_t id) {
  MutexLock lock(&mu);
  auto it = slots.find(id);
  if (!it->second.evicted) --held;
  finished.push_back(std::move(it->second.thread));
  slots.erase(it);
  released.SignalAll();
}

void MetricsHttpServer::Impl::JoinFinished() {
  std::vector<std::thread> threads;
  {
    MutexLock lock(&mu);
    threads.swap(finished);
  }
  for (std::thread& t : threads) t.join();
}

MetricsHttpServer::MetricsHttpServer() : impl_(std::make_unique<Impl>()) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

int MetricsHttpServer::port() const { return impl_->port; }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const PrometheusMetrics* metrics,
    const MetricsHttpSecurity& security, const MetricsHttpLimits& limits) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics must not be null");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port out of range: ", port));
  }
  if (limits.max_connections < 1 || limits.head_timeout.count() <= 0 ||
      limits.reply_timeout.count() <= 0 || limits.max_head_bytes < 64) {
    return absl::InvalidArgumentError(
        "metrics: limits need a connection, time for a head and a reply, and 64 bytes of head");
  }
  std::unique_ptr<MetricsHttpServer> self(new MetricsHttpServer());
  Impl& impl = *self->impl_;
  impl.limits = limits;
  if (security.tls_cert_file.empty() != security.tls_key_file.empty()) {
    return absl::InvalidArgumentError("metrics: HTTPS needs both a certificate and a key");
  }
  if (!security.tls_cert_file.empty()) {
    ERR_clear_error();
    impl.tls.reset(SSL_CTX_new(TLS_server_method()));
    if (impl.tls == nullptr || !SetUpTls(security, *impl.tls)) {
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
  }
  Router& router = impl.router;
  router.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!AnnouncesBody(req)) return httplib::Server::HandlerResponse::Unhandled;
    RefuseBody(res);
    return httplib::Server::HandlerResponse::Handled;
  });
  // Asked before routing, so the client learns of the 413 before it sends.
  router.set_expect_100_continue_handler([](const httplib::Request&, httplib::Response& res) {
    RefuseBody(res);
    return res.status;
  });
  router.Get("/metrics", [metrics, token = security.auth_token, open = security.metrics_open](
                             const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(token, open, req, res)) return;
    res.set_content(metrics->Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  router.Get("/healthz", [token = security.auth_token, open = security.healthz_open](
                             const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(token, open, req, res)) return;
    res.set_content("ok\n", "text/plain");
  });

  absl::StatusOr<int> listening = Listen(host, port);
  if (!listening.ok()) return listening.status();
  impl.listen_fd = *listening;
  sockaddr_storage bound = {};
  socklen_t length = sizeof(bound);
  if (getsockname(impl.listen_fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return absl::InternalError(absl::StrCat("metrics: getsockname: ", std::strerror(errno)));
  }
  impl.port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  impl.wake_fd = eventfd(0, EFD_CLOEXEC);
  if (impl.wake_fd < 0) {
    return absl::InternalError(absl::StrCat("metrics: eventfd: ", std::strerror(errno)));
  }
  impl.acceptor = std::thread(&Impl::AcceptLoop, &impl);
  return self;
}

void MetricsHttpServer::Stop() {
  Impl& impl = *impl_;
  if (!impl.acceptor.joinable()) return;
  const uint64_t one = 1;
  (void)!write(impl.wake_fd, &one, sizeof(one));
  impl.acceptor.join();
  close(impl.listen_fd);
  impl.listen_fd = -1;
  std::vector<std::thread> threads;
  {
    MutexLock lock(&impl.mu);
    for (auto& [id, slot] : impl.slots) shutdown(slot.fd, SHUT_RDWR);
    while (!impl.slots.empty()) impl.released.Wait(&impl.mu);
    threads.swap(impl.finished);
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace layerserve
