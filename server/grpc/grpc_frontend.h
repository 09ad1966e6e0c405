// The gRPC edge of layerserve: one grpc::Server serving
// inference.GRPCInferenceService and grpc.health.v1.Health for the one
// served model, on gRPC's completion-queue API (completion_queues.h).
//
// Life cycle (driven by main): Start() binds and serves; BeginDrain() turns
// readiness and health to NOT_SERVING and makes new inferences UNAVAILABLE
// while accepted ones finish; the caller then shuts the Batcher down (which
// answers everything queued) and calls Shutdown(deadline), which keeps
// answering (ready=false, NOT_SERVING, new inferences UNAVAILABLE) while
// ModelStreamInfer calls are open, up to the deadline, and then until clients
// stop sending (no call for 200 ms, at most 2 s), so that stopping gRPC finds
// no received call to cancel; then it stops the server, which answers the
// calls the service holds and cancels what is still open at the deadline.
//
// Security (docs/security.md): options.tls makes the port TLS only, and
// mutual TLS with client CAs; options.auth_token makes every call but those
// --auth-open names need a bearer token (call_auth.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/auth/auth_token.h"
#include "server/core/backend.h"
#include "server/core/batcher.h"
#include "server/core/observer.h"
#include "server/core/stats.h"
#include "server/grpc/served_model.h"
#include "server/grpc/tls_files.h"

namespace layerserve {

struct GrpcFrontendOptions {
  std::string host = "0.0.0.0";
  int port = 8001;             // 0: the OS picks a free port; see GrpcFrontend::port()
  std::string server_version;  // reported by ServerMetadata
  // Largest message accepted / sent, in bytes; 0: DefaultMaxMessageBytes().
  int max_receive_message_bytes = 0;
  int max_send_message_bytes = 0;
  // > 0: each connection is closed (GOAWAY) after this many seconds, calls in
  // flight getting max_connection_age_grace_s more, so that long-lived
  // clients reconnect and spread over replicas added since.
  int64_t max_connection_age_s = 0;
  int64_t max_connection_age_grace_s = 30;
  // > 0: a connection with no call for this many seconds is closed (GOAWAY);
  // a gRPC client reconnects at its next call. Bounds the descriptors and
  // memory that idle connections hold.
  int64_t max_connection_idle_s = 300;
  // > 0: the most streams (calls) a connection may hold open at once,
  // announced in the server's HTTP/2 SETTINGS (a gRPC client queues the calls
  // beyond it on its side); a client that has acknowledged the SETTINGS and
  // opens more anyway loses the connection. Bounds what one connection's open
  // calls hold (a stream that is not read holds its receive buffer and
  // backlog). 0: gRPC's default, no limit. It does not bound streams opened
  // and reset at once (a reset stream no longer counts), nor a client that
  // never acknowledges the SETTINGS (docs/security.md). The default leaves a
  // client that multiplexes its calls on one connection (layerctl bench,
  // tritonclient, perf_analyzer at a concurrency of hundreds) unthrottled:
  // past the limit a client's calls wait on its side for one to end.
  int max_concurrent_streams = 1024;
  // Set: the port speaks TLS only (with client certificates required when
  // tls->client_ca_pem is set); unset: plaintext.
  std::optional<TlsMaterial> tls;
  // Not empty: calls need "authorization: Bearer <auth_token>", except the
  // RPCs auth_open names (see call_auth.h). Refused calls are UNAUTHENTICATED
  // and reach `observer` as calls of no model.
  std::string auth_token;
  OpenWithoutToken auth_open;
  // Threads that receive calls and run their handlers, each polling its own
  // completion queue (completion_queues.h); 0: DefaultQueueThreads().
  int queue_threads = 0;
};

// Connection bounds that need no flag (besides max_connection_idle_s): a
// connection must finish its handshake (TLS, and the client's HTTP/2
// SETTINGS) within kHandshakeTimeout, or it is closed, so sockets that never
// speak hold no descriptor for long (gRPC's default is 120 s); and every
// kKeepaliveTime without traffic the server pings, closing connections whose
// peer does not answer within kKeepaliveTimeout (a vanished client, a dead
// route), where gRPC's default would wait two hours.
inline constexpr std::chrono::seconds kHandshakeTimeout(10);
inline constexpr std::chrono::seconds kKeepaliveTime(60);
inline constexpr std::chrono::seconds kKeepaliveTimeout(20);

// Room for twice the largest legal request (and its reply, which has the
// same size): 2 * max_batch_tokens * hidden * 4 bytes (FP32, the widest
// accepted datatype) plus 1 MiB for the envelope, capped at INT32_MAX
// (gRPC's limit). Twice, so that a request somewhat over the token limit
// reaches the server's validation and gets its "tokens" error in every
// datatype, rather than gRPC's "Received message larger than max" for FP32
// only (issue 37); gRPC allocates what is sent, not the limit.
// gRPC's own default of 4 MiB would reject a 2048-token BF16 request at hidden
// 1024; clients that keep that default must stay under it on their side too.
int DefaultMaxMessageBytes(const ServedModel& model);

// The gRPC port, held while the model loads, so that a port in use (or a
// host that is not a local address) is found in milliseconds, before a load
// that may take minutes. gRPC 1.51 cannot adopt a bound socket and can add no
// service after it starts, so this is a plain socket bound to every address
// of the host and not listening: a client is refused, as by no server, and
// health probes fail until the ready server binds. Without SO_REUSEADDR it
// keeps other servers off the port; Release() it just before
// GrpcFrontend::Start binds the same port. Move-only; closes on destruction.
class PortReservation {
 public:
  // `port` 0 reserves a free port, the same on every address of `host`.
  static absl::StatusOr<PortReservation> Reserve(const std::string& host, int port);
  PortReservation(PortReservation&& other) noexcept;
  PortReservation& operator=(PortReservation&& other) noexcept;
  ~PortReservation() { Release(); }

  int port() const { return port_; }
  void Release();

 private:
  PortReservation() = default;
  std::vector<int> fds_;
  int port_ = 0;
};

// True for a host that binds every interface ("0.0.0.0", "::", "[::]").
bool IsWildcardHost(const std::string& host);

class GrpcFrontend {
 public:
  // Starts serving on options.host:options.port. All pointers must outlive
  // the frontend; the Batcher must not be destroyed while requests it holds
  // could still complete into the frontend (shut it down first).
  static absl::StatusOr<std::unique_ptr<GrpcFrontend>> Start(const GrpcFrontendOptions& options,
                                                             const ServedModel& model,
                                                             Batcher* batcher, Backend* backend,
                                                             ServerObserver* observer,
                                                             const StatsRecorder* stats);
  ~GrpcFrontend();  // Shutdown(now) if not shut down yet

  GrpcFrontend(const GrpcFrontend&) = delete;
  GrpcFrontend& operator=(const GrpcFrontend&) = delete;

  // The bound port (the chosen one when options.port was 0).
  int port() const;

  // True once the port has stopped accepting connections for good (a failed
  // accept(); see GrpcAcceptFailed in protobuf_log.h). Thread-safe.
  bool AcceptFailed() const;

  // Readiness and health become NOT_SERVING and new inferences UNAVAILABLE.
  // Thread-safe, idempotent, returns at once.
  void BeginDrain();

  // Begins draining if not yet, waits until open streams close or `deadline`
  // passes, then until no call has arrived for 200 ms (at most 2 s more),
  // then stops the server (cancelling what is still open at `deadline`) and
  // returns once every call has finished. Blocks; call it from main, not from a gRPC
  // reaction. Idempotent.
  void Shutdown(absl::Time deadline);

 private:
  struct Impl;
  explicit GrpcFrontend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace layerserve
