// A C++ client for layerserve (or any Open Inference Protocol gRPC server):
// one channel, the inference and health stubs, and conversion of every
// grpc::Status into the absl::Status with the same code.
//
// Threading: a Client is thread-safe. All methods may be called concurrently
// from many threads; they share one channel (gRPC multiplexes calls over it).
// AsyncInfer callbacks run on gRPC's callback threads and must not block for
// long. An InferStream (OpenStream) is one caller's: see its own comment.
//
// Message size: the channel accepts and sends messages up to INT32_MAX bytes,
// as tritonclient does, so large [B, T, hidden] tensors are not cut off by
// gRPC's 4 MiB default.
//
// Security (docs/security.md): ConnectOptions turn on TLS (a server
// started with --tls-cert-file), a client certificate (mutual TLS,
// --tls-client-ca-file) and a bearer token sent with every call
// (--auth-token-file).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/tensor.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc_service.grpc.pb.h"

namespace layerserve::client {

class InferStream;

// Name of the single input and output tensor of a layerserve model.
inline constexpr char kHiddenStates[] = "hidden_states";

// A session's name: Triton's sequence_id, an integer or a string (two kinds
// that never name the same session: 7 is not "7"). 0 and "" mean none.
using SequenceId = std::variant<int64_t, std::string>;

// True for 0 and "": no sequence.
bool IsNoSequence(const SequenceId& id);

// The request header (gRPC metadata) that carries a call's session, so that
// an L7 proxy in front of several replicas can route every step of a
// session to the one holding its KV cache (deploy/README.md). The server
// refuses a call whose header names another session than its sequence_id.
inline constexpr char kSessionHeader[] = "x-session-id";

// The header's value for `id`: an integer in decimal, a string as itself.
// nullopt for no sequence (0, "") and for a string no header can carry (a
// byte outside printable ASCII, or a space at either end) or the server
// refuses (longer than 256 bytes): such a session is sent without the
// header, so a proxy cannot keep it on one replica.
std::optional<std::string> SessionHeaderValue(const SequenceId& id);

// Per-request options of Infer and AsyncInfer: the session (server-side KV
// cache) a request is a step of, in Triton's sequence batcher spelling.
// With a sequence_id, the request carries the request parameters
// sequence_id (int64_param or string_param), sequence_start and
// sequence_end (bool_param), as tritonclient sends them, and
// sequence_position (int64_param, layerserve's extension) when set. Without
// one (the default), only flags that are true and a set position are sent,
// so the server can refuse them (it does, INVALID_ARGUMENT) rather than the
// client dropping them silently as tritonclient does.
struct InferOptions {
  SequenceId sequence_id = int64_t{0};
  bool sequence_start = false;  // open the session (or reset it)
  bool sequence_end = false;    // free it after this request
  // Where the request's first token sits; smaller than the session's length
  // rolls the session back to it first. Unset: append.
  std::optional<int64_t> sequence_position;
};

// TLS for a connection (ConnectOptions::tls). PEM text, as gRPC takes it.
struct TlsOptions {
  // The CA certificates the server's certificate must chain to; empty:
  // gRPC's default roots (the system's bundle).
  std::string root_certs_pem;
  // Mutual TLS: the client's certificate chain and its unencrypted private
  // key, both or neither.
  std::string cert_chain_pem;
  std::string private_key_pem;
};

struct ConnectOptions {
  // gRPC shares one TCP connection between channels to the same target;
  // true gives this client its own (as separate client processes would
  // have), which load generators use to spread their streams over several
  // connections.
  bool dedicated_connection = false;
  // Set: TLS (the server's certificate must match the target's host name or
  // address); unset: plaintext.
  std::optional<TlsOptions> tls;
  // Not empty: every call carries the metadata "authorization: Bearer
  // <auth_token>" (on a plaintext channel too, for a server behind a
  // TLS-terminating proxy; anyone on the path can read it then). One word of
  // printable ASCII.
  std::string auth_token;
};

// The contents of a PEM file for TlsOptions; INVALID_ARGUMENT naming `flag`
// and the file if it cannot be read or holds no "-----BEGIN".
absl::StatusOr<std::string> ReadPemFile(const std::string& path, std::string_view flag);

// The token a token file holds, without trailing whitespace (a final
// newline); INVALID_ARGUMENT naming `flag` and the file (never its contents)
// if it cannot be read, is empty, or is not one word of printable ASCII.
// The same rules as the server's --auth-token-file.
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path, std::string_view flag);

// grpc::Status -> absl::Status (the numeric codes are the same), marked as
// the outcome of a call (see IsCallStatus).
absl::Status FromGrpcStatus(const grpc::Status& status);

// True for a status that came back from a call (the server's answer, or
// gRPC's own: unreachable, deadline), false for one this library or its
// caller made. layerctl uses it to tell a server's INVALID_ARGUMENT, whose
// message may name a server flag, from a usage error on its own command line.
bool IsCallStatus(const absl::Status& status);

class Client {
 public:
  // `target` is a gRPC target such as "localhost:8001" or "dns:///host:8001".
  // Connection is lazy: an unreachable server (or a TLS handshake that
  // fails: a plaintext server, a certificate no root signed, a client
  // certificate the server wants and does not get) shows up as UNAVAILABLE
  // on the first call, not here. INVALID_ARGUMENT for options that cannot
  // work (half a client certificate, a token with a space).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ConnectOptions& options);
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         bool dedicated_connection = false);

  // Opens the connection now and waits, through gRPC's reconnect backoff,
  // until it is up. Without it, a first connection attempt that fails fails
  // every call made meanwhile at once with UNAVAILABLE ("failed to connect to
  // all addresses"); load generators call it before they start, so that a
  // transient failure is not counted against the server (seen on a loaded
  // GPU machine: one of 8 connections' connect() failing with ENOENT, and its
  // 8 sessions lost). Not connected by `deadline`: UNAVAILABLE naming the
  // channel's state.
  absl::Status WaitForConnected(absl::Time deadline);

  // Each call fails with DEADLINE_EXCEEDED once `deadline` passes
  // (absl::InfiniteFuture(): no deadline).
  absl::StatusOr<bool> Live(absl::Time deadline);
  absl::StatusOr<bool> Ready(absl::Time deadline);
  absl::StatusOr<bool> ModelReady(std::string_view model, absl::Time deadline);
  // grpc.health.v1.Health/Check for the whole server (service "").
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(absl::Time deadline);
  absl::StatusOr<inference::ServerMetadataResponse> ServerMetadata(absl::Time deadline);
  absl::StatusOr<inference::ModelMetadataResponse> ModelMetadata(std::string_view model,
                                                                 absl::Time deadline);
  // The models the server serves (Triton's RepositoryIndex; layerserve
  // serves one), with their state.
  absl::StatusOr<inference::RepositoryIndexResponse> RepositoryIndex(absl::Time deadline);

  // Runs `input` (sent as the tensor "hidden_states" in raw_input_contents)
  // through `model` and returns the output "hidden_states". A reply without
  // that output, or whose raw bytes do not match its shape, is INTERNAL.
  absl::StatusOr<Tensor> Infer(std::string_view model, const Tensor& input, absl::Time deadline,
                               const InferOptions& options = {});

  // As Infer, but returns at once; `done` is called exactly once, on a gRPC
  // thread, with the result, after the call's gRPC state is released. The
  // Client may be destroyed on another thread as soon as the last `done` has
  // been called (its destructor waits for every completion to finish), but
  // not from inside `done`: gRPC would shut the channel's callback queue down
  // from within one of its own callbacks.
  using InferCallback = std::function<void(absl::StatusOr<Tensor>)>;
  void AsyncInfer(std::string_view model, const Tensor& input, absl::Time deadline,
                  InferCallback done);
  void AsyncInfer(std::string_view model, const Tensor& input, absl::Time deadline,
                  const InferOptions& options, InferCallback done);

  // Opens a ModelStreamInfer call: a session's requests written one after
  // another on one HTTP/2 stream, each reply read before the next request
  // is written (InferStream). `deadline` is the whole stream's: once it
  // passes, the stream breaks with DEADLINE_EXCEEDED (absl::InfiniteFuture():
  // none). `session`: the one session the stream carries, sent as the
  // stream's kSessionHeader so that a proxy routes the stream by it; every
  // request of such a stream must name it (0: none, a stream of any
  // requests). Never null. Like Connect, lazy: an unreachable server, or a
  // refused bearer token, shows up as the first Infer's status. The stream
  // shares this client's channel and may outlive the Client.
  std::unique_ptr<InferStream> OpenStream(absl::Time deadline,
                                          const SequenceId& session = int64_t{0});

  // Sends a hand-built request unchanged (with kSessionHeader when its
  // sequence_id parameter names a session, as every call of this client
  // has): for tests of the server's validation and for callers that need
  // fields Infer does not set.
  absl::StatusOr<inference::ModelInferResponse> InferRaw(
      const inference::ModelInferRequest& request, absl::Time deadline);

  // Starts a hand-built request on gRPC's completion-queue API, for load
  // generators that poll their own queues (layerctl bench's closed loop):
  // the caller calls Finish on the returned reader with its own tag, and
  // keeps `context` (fresh for each call), `request` and the reader alive
  // until that tag comes back on `cq`.
  std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> StartInfer(
      grpc::ClientContext& context, const inference::ModelInferRequest& request,
      absl::Time deadline, grpc::CompletionQueue* cq);

  // The request Infer sends.
  static inference::ModelInferRequest MakeInferRequest(std::string_view model, const Tensor& input,
                                                       const InferOptions& options = {});
  // The output tensor Infer returns from a reply, whose bytes it takes
  // (moved, not copied: a 128-token FP32 reply of Llama-3-8B is 2 MiB).
  static absl::StatusOr<Tensor> OutputFromResponse(inference::ModelInferResponse&& response);
  // The index of the reply's "hidden_states" output once checked as
  // OutputFromResponse checks it (present, with the bytes its shape and
  // datatype need), leaving the reply as it is: a caller that parses the
  // next reply into the same message keeps its buffers.
  static absl::StatusOr<int> CheckOutput(const inference::ModelInferResponse& response);

  ~Client();

 private:
  // Async calls not yet finished, shared with their completions so that the
  // count outlives the Client when the last completion destroys it.
  struct Inflight {
    absl::Mutex mu;
    int calls ABSL_GUARDED_BY(mu) = 0;
  };

  Client(std::shared_ptr<grpc::Channel> channel, std::string authorization);

  // Sets the call's deadline and, with a token, its authorization metadata.
  void PrepareContext(grpc::ClientContext& context, absl::Time deadline) const;
  // PrepareContext, plus kSessionHeader for the session `request` names.
  void PrepareInferContext(grpc::ClientContext& context, absl::Time deadline,
                           const inference::ModelInferRequest& request) const;
  // One blocking call of a unary method of `stub` (e.g.
  // &inference::GRPCInferenceService::Stub::ServerLive), prepared as above:
  // its response, or its status as an absl::Status.
  template <typename Response, typename Stub, typename Request>
  absl::StatusOr<Response> CallUnary(Stub& stub,
                                     grpc::Status (Stub::*method)(grpc::ClientContext*,
                                                                  const Request&, Response*),
                                     const Request& request, absl::Time deadline) const {
    grpc::ClientContext context;
    PrepareContext(context, deadline);
    Response response;
    absl::Status status = FromGrpcStatus((stub.*method)(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  const std::shared_ptr<Inflight> inflight_ = std::make_shared<Inflight>();
  const std::string authorization_;  // "Bearer <token>", or empty
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> inference_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// One ModelStreamInfer call used as a blocking request/reply channel
// (Client::OpenStream): Infer writes one request and reads its reply. The
// server queues a stream's requests in the order they are written, so a
// session's steps (start, steps, end) can ride on one stream; this class
// keeps one request in flight at a time, so each step is also answered
// before the next is sent.
//
// Errors: a request the server refuses or fails comes back as a reply with
// error_message set, and the stream stays open for the next request. The
// server writes that message as "CODE: message" (CODE the canonical name,
// "RESOURCE_EXHAUSTED"); Infer returns that code with the message after the
// ": ". A message without a known code in front (another server's) is
// UNKNOWN with the whole message, which is how Triton's own client raises
// it. A broken stream (deadline, cancellation, the server gone, a refused
// token) makes Infer return the call's final status (the Finish status,
// marked as a call status as every Client status is; UNAVAILABLE if the
// server ended the call OK before answering), and every later Infer and
// Close return that status again: open a new stream to go on.
//
// Threading: one request at a time. Infer and Close may be called from any
// thread, but calls are serialized (a second caller waits for the first to
// have its reply); for requests in flight at once, use several streams.
//
// Ownership: the stream holds a reference to its client's channel, not to
// the Client. Destroying a stream that was not closed cancels the call
// (the server sees CANCELLED; a request in flight may still have been
// computed, advancing its session: see docs/sessions.md).
class InferStream {
 public:
  InferStream(const InferStream&) = delete;
  InferStream& operator=(const InferStream&) = delete;
  ~InferStream();

  // Writes `input` (as Client::Infer sends it, with the request id set to a
  // counter of this stream's requests) and reads its reply: the output
  // "hidden_states", or the reply's error as a status (see above), or the
  // stream's final status if it broke. A reply for another request id is
  // INTERNAL and cancels the stream. FAILED_PRECONDITION after Close.
  absl::StatusOr<Tensor> Infer(std::string_view model, const Tensor& input,
                               const InferOptions& options = {});

  // Half-closes the stream (WritesDone) and returns its final status
  // (Finish): OK once the server has answered everything and finished. The
  // same status again on a second call.
  absl::Status Close();

 private:
  friend class Client;
  explicit InferStream(std::shared_ptr<grpc::Channel> channel) : channel_(std::move(channel)) {}

  // Ends the call (Finish) after a failed write or read and keeps its
  // status as final_.
  absl::Status BreakLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<grpc::Channel> channel_;  // keeps the call's channel alive
  absl::Mutex mu_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>>
      stream_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Set once the call has ended (Close, or a broken stream): its status.
  std::optional<absl::Status> final_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // by Close
};

// The status of a ModelStreamInfer reply's error_message (InferStream):
// "CODE: message" with CODE a canonical code name other than OK gives that
// code and the message after ": "; anything else UNKNOWN and the whole text.
// Marked as a call status (IsCallStatus).
absl::Status StreamErrorStatus(std::string_view error_message);

}  // namespace layerserve::client
