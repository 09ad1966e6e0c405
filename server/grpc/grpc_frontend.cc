// The gRPC server, its health service, its credentials (TLS, bearer token)
// and its life cycle (see grpc_frontend.h).
#include "server/grpc/grpc_frontend.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/health_service.h"
#include "server/grpc/infer_handler.h"
#include "server/grpc/inference_service.h"
#include "server/grpc/protobuf_log.h"
#include "server/grpc/serving_state.h"

namespace layerserve {
namespace {

// A ModelStreamInferResponse wraps the ModelInferResponse in a few bytes of
// framing (tag and length); the reply-size check leaves room for it.
constexpr size_t kStreamEnvelopeBytes = 16;

// Notes the arrival of every call, of every method, in the serving state,
// for the drain's quiet period (see serving_state.h). It adds no interceptor
// to the call: noting is all it does.
class CallArrivalNoter final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallArrivalNoter(ServingState* state) : state_(state) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    state_->CallArrived();
    return nullptr;
  }

 private:
  ServingState* const state_;
};

// How long the drain keeps refusing (UNAVAILABLE, NOT_SERVING) before it
// stops gRPC: until no call has arrived for kQuietPeriod, so that refused
// clients have gone and gRPC holds no call it would cancel, but no longer
// than kMaxRefusalPeriod, for clients that keep sending on the same
// connection whatever they are told (only the GOAWAY of the stop moves
// those; a call that crosses it is still cancelled).
constexpr absl::Duration kQuietPeriod = absl::Milliseconds(200);
constexpr absl::Duration kMaxRefusalPeriod = absl::Seconds(2);

// TLS on the whole port when asked for: gRPC's SSL credentials (TLS 1.2 or
// later, ALPN h2), asking for and verifying a client certificate against
// the client CAs when there are any (mutual TLS: a connection without one,
// or with one no client CA signed, fails its handshake before any call).
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const std::optional<TlsMaterial>& tls) {
  if (!tls) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tls->client_ca_pem.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = tls->client_ca_pem;
  ssl.pem_key_cert_pairs.push_back({tls->private_key_pem, tls->cert_chain_pem});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

bool IsWildcardHost(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::StatusOr<PortReservation> PortReservation::Reserve(const std::string& host, int port) {
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int err = getaddrinfo(name.c_str(), "0", &hints, &found); err != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host=", host, " does not resolve: ", gai_strerror(err)));
  }
  PortReservation reservation;
  reservation.port_ = port;
  absl::Status status;
  for (const addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;  // an address family this machine lacks
    reservation.fds_.push_back(fd);
    sockaddr_storage address = {};
    std::memcpy(&address, a->ai_addr, a->ai_addrlen);
    // Every address gets the same port: the first one's, when 0 asked the
    // kernel to choose.
    const uint16_t port_be = htons(static_cast<uint16_t>(reservation.port_));
    if (a->ai_family == AF_INET6) {
      reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = port_be;
    } else {
      reinterpret_cast<sockaddr_in*>(&address)->sin_port = port_be;
    }
    if (bind(fd, reinterpret_cast<const sockaddr*>(&address), a->ai_addrlen) != 0) {
      const int err = errno;
      status = absl::UnavailableError(absl::StrCat(
          "cannot bind the gRPC port ", reservation.port_, " on ", host, ": ", std::strerror(err),
          err == EADDRINUSE ? " (another process holds it; --grpc-port picks another)" : ""));
      continue;
    }
    if (reservation.port_ == 0) {
      sockaddr_storage bound = {};
      socklen_t length = sizeof(bound);
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
        reservation.port_ =
            ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      }
    }
  }
  freeaddrinfo(found);
  if (status.ok() && reservation.fds_.empty()) {
    status = absl::UnavailableError(absl::StrCat("cannot open a socket for ", host));
  }
  if (!status.ok()) return status;
  return reservation;
}

PortReservation::PortReservation(PortReservation&& other) noexcept
    : fds_(std::exchange(other.fds_, {})), port_(other.port_) {}

PortReservation& PortReservation::operator=(PortReservation&& other) noexcept {
  if (this != &other) {
    Release();
    fds_ = std::exchange(other.fds_, {});
    port_ = other.port_;
  }
  return *this;
}

void PortReservation::Release() {
  for (const int fd : fds_) close(fd);
  fds_.clear();
}

int DefaultMaxMessageBytes(const ServedModel& model) {
  constexpr int64_t kHeadroomBytes = int64_t{1} << 20;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(model.max_batch_tokens, model.config.hidden_size, &bytes) ||
      __builtin_mul_overflow(bytes, int64_t{2 * 4}, &bytes) ||
      __builtin_add_overflow(bytes, kHeadroomBytes, &bytes)) {
    return INT_MAX;
  }
  return static_cast<int>(std::min<int64_t>(bytes, INT_MAX));
}

struct GrpcFrontend::Impl {
  Impl(const ServedModel& model, const GrpcFrontendOptions& options, Batcher* batcher,
       Backend* backend, ServerObserver* observer, const StatsRecorder* stats)
      : model(model),
        state(backend),
        auth(options.auth_token, options.auth_open, observer),
        infer(this->model, batcher, observer, &state,
              static_cast<size_t>(options.max_send_message_bytes) - kStreamEnvelopeBytes),
        queues(options.queue_threads > 0 ? options.queue_threads : DefaultQueueThreads()),
        service(this->model, options.server_version, &state, &infer, stats, &auth, &queues),
        health(&state, &auth, &queues) {}

  const ServedModel model;
  ServingState state;
  const CallAuthenticator auth;
  InferHandler infer;
  // Declared before the services that request calls on them and before the
  // server: shut down (explicitly, or here by the destructor) after the
  // server is, and destroyed after it.
  CompletionQueues queues;
  InferenceService service;
  HealthService health;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  bool shut_down = false;  // touched only by the owner's thread
};

absl::StatusOr<std::unique_ptr<GrpcFrontend>> GrpcFrontend::Start(
    const GrpcFrontendOptions& options, const ServedModel& model, Batcher* batcher,
    Backend* backend, ServerObserver* observer, const StatsRecorder* stats) {
  GrpcFrontendOptions resolved = options;
  if (resolved.max_receive_message_bytes <= 0) {
    resolved.max_receive_message_bytes = DefaultMaxMessageBytes(model);
  }
  if (resolved.max_send_message_bytes <= 0) {
    resolved.max_send_message_bytes = DefaultMaxMessageBytes(model);
  }
  if (static_cast<size_t>(resolved.max_send_message_bytes) <= kStreamEnvelopeBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max send message size of ", resolved.max_send_message_bytes, " bytes is too small"));
  }
  auto impl = std::make_unique<Impl>(model, resolved, batcher, backend, observer, stats);
  // Requests with invalid UTF-8 in a string field each make protobuf log a
  // line; a client must not be able to fill the log at its request rate.
  InstallRateLimitedProtobufLog();
  // gRPC core's lines go to the server's log; those of failed TLS
  // handshakes, which any client can cause at its connection rate, limited.
  InstallGrpcCoreLog();

  // IPv6 literals need brackets in a gRPC target ("[::]:8001").
  const std::string address = absl::StrContains(resolved.host, ':')
                                  ? absl::StrCat("[", resolved.host, "]:", resolved.port)
                                  : absl::StrCat(resolved.host, ":", resolved.port);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, ServerCredentials(resolved.tls), &impl->port);
  // gRPC sets SO_REUSEPORT by default on Linux, which would let a second
  // server bind the same port and silently take half the connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Identity encoding only. gRPC 1.51 inflates a compressed message whole
  // before the receive limit sees it (a 0.5 MB gzip body took the server from
  // 113 to 658 MiB), while a disabled algorithm is refused from the request's
  // grpc-encoding header, UNIMPLEMENTED, before any byte is inflated. Tensors
  // of hidden states hardly compress anyway.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  if (options.max_connection_age_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(options.max_connection_age_s * 1000));
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
        static_cast<int>(std::min<int64_t>(options.max_connection_age_grace_s, INT32_MAX / 1000) *
                         1000));
  }
  if (options.max_connection_idle_s > 0) {
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_IDLE_MS,
        static_cast<int>(std::min<int64_t>(options.max_connection_idle_s, INT32_MAX / 1000) *
                         1000));
  }
  if (options.max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  }
  const auto ms = [](std::chrono::seconds s) {
    return static_cast<int>(std::chrono::milliseconds(s).count());
  };
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, ms(kHandshakeTimeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(kKeepaliveTime));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(kKeepaliveTimeout));
  builder.SetMaxReceiveMessageSize(resolved.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(resolved.max_send_message_bytes);
  builder.RegisterService(impl->service.service());
  builder.RegisterService(impl->health.service());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> noters;
  noters.push_back(std::make_unique<CallArrivalNoter>(&impl->state));
  builder.experimental().SetInterceptorCreators(std::move(noters));
  impl->queues.AddTo(builder);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not start the gRPC server on ", address,
                     " (is the port in use, or the host not a local address?)"));
  }
  impl->queues.Start([&impl](int q) {
    impl->service.RequestCalls(q);
    impl->health.RequestCalls(q);
  });
  return std::unique_ptr<GrpcFrontend>(new GrpcFrontend(std::move(impl)));
}

GrpcFrontend::GrpcFrontend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcFrontend::~GrpcFrontend() { Shutdown(absl::Now()); }

int GrpcFrontend::port() const { return impl_->port; }

bool GrpcFrontend::AcceptFailed() const { return GrpcAcceptFailed(); }

void GrpcFrontend::BeginDrain() { impl_->state.BeginDrain(); }

void GrpcFrontend::Shutdown(absl::Time deadline) {
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  impl_->state.BeginDrain();
  // Streams stay open as long as their clients want; until they close (or
  // the deadline) the server keeps answering, so health checks and readiness
  // probes read NOT_SERVING / ready=false rather than "connection refused".
  impl_->state.AwaitNoStreams(deadline);
  // Then refuse until clients stop sending (see kQuietPeriod): stopping gRPC
  // with calls in its queues would cancel them.
  impl_->state.AwaitQuiet(kQuietPeriod, std::min(deadline, absl::Now() + kMaxRefusalPeriod));
  impl_->server->Shutdown(absl::ToChronoTime(deadline));
  impl_->server->Wait();
  // Only now, with no call open, may the completion queues close.
  impl_->queues.Shutdown();
}

}  // namespace layerserve
