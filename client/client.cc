// Client implementation (see client.h): thin wrappers over the generated stubs.
#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace layerserve::client {
namespace {

// The payload that marks a status as a call's outcome; its value is unused.
constexpr char kCallStatusPayload[] = "layerserve.client/call";

// Files named by a flag: a PEM bundle or a token is kilobytes; a larger file
// is a wrong path.
constexpr size_t kMaxCredentialFileBytes = size_t{4} << 20;

absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, std::string_view flag) {
  const auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(flag.data(), flag.size()), "=",
                                                   path, " ",
                                                   absl::string_view(why.data(), why.size())));
  };
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad(absl::StrCat("cannot be read: ", std::strerror(errno)));
  std::string text(kMaxCredentialFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return bad("cannot be read");
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxCredentialFileBytes) return bad("is larger than 4 MiB");
  return text;
}

// One word of printable ASCII: what a metadata value may carry, without the
// space that would make "Bearer a b" ambiguous.
bool IsTokenText(std::string_view token) {
  return !token.empty() &&
         std::all_of(token.begin(), token.end(), [](char c) { return c >= 0x21 && c <= 0x7e; });
}

// The session a request's sequence_id parameter names, as Infer sends it
// (int64_param or string_param; uint64_param too, for hand-built requests).
SequenceId SequenceIdOf(const inference::ModelInferRequest& request) {
  const auto it = request.parameters().find("sequence_id");
  if (it == request.parameters().end()) return int64_t{0};
  const inference::InferParameter& p = it->second;
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      return static_cast<int64_t>(p.uint64_param());
    case inference::InferParameter::kStringParam:
      return p.string_param();
    default:
      return int64_t{0};
  }
}

}  // namespace

std::optional<std::string> SessionHeaderValue(const SequenceId& id) {
  if (IsNoSequence(id)) return std::nullopt;
  if (const int64_t* integer = std::get_if<int64_t>(&id)) return absl::StrCat(*integer);
  const std::string& text = std::get<std::string>(id);
  const bool printable =
      std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
  // Longer ids are refused by the server (INVALID_ARGUMENT); without the
  // header, a long one still reaches it to be told so.
  constexpr size_t kMaxStringIdBytes = 256;
  if (!printable || text.front() == ' ' || text.back() == ' ' || text.size() > kMaxStringIdBytes) {
    return std::nullopt;
  }
  return text;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path, std::string_view flag) {
  absl::StatusOr<std::string> text = ReadCredentialFile(path, flag);
  if (text.ok() && text->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(absl::string_view(flag.data(), flag.size()), "=", path, " is not PEM"));
  }
  return text;
}

absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path, std::string_view flag) {
  absl::StatusOr<std::string> token = ReadCredentialFile(path, flag);
  if (!token.ok()) return token.status();
  token->erase(token->find_last_not_of(" \t\r\n\f\v") + 1);  // npos + 1 == 0: all blank
  if (!IsTokenText(*token)) {
    return absl::InvalidArgumentError(absl::StrCat(
        absl::string_view(flag.data(), flag.size()), "=", path,
        token->empty() ? " is empty: it must hold the token"
                       : " holds a space, a control byte or non-ASCII: a token is one word of "
                         "printable ASCII"));
  }
  return token;
}

bool IsNoSequence(const SequenceId& id) {
  if (const int64_t* integer = std::get_if<int64_t>(&id)) return *integer == 0;
  return std::get<std::string>(id).empty();
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  out.SetPayload(kCallStatusPayload, absl::Cord());
  return out;
}

bool IsCallStatus(const absl::Status& status) {
  return status.GetPayload(kCallStatusPayload).has_value();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        bool dedicated_connection) {
  return Connect(target, ConnectOptions{.dedicated_connection = dedicated_connection});
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ConnectOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty server address");
  if (!options.auth_token.empty() && !IsTokenText(options.auth_token)) {
    return absl::InvalidArgumentError(
        "the auth token holds a space, a control byte or non-ASCII: a token is one word of "
        "printable ASCII");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    if (options.tls->cert_chain_pem.empty() != options.tls->private_key_pem.empty()) {
      return absl::InvalidArgumentError(
          "a client certificate needs its private key, and a key its certificate");
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_certs_pem;
    ssl.pem_cert_chain = options.tls->cert_chain_pem;
    ssl.pem_private_key = options.tls->private_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT32_MAX);
  args.SetMaxSendMessageSize(INT32_MAX);
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", target));
  }
  return std::unique_ptr<Client>(new Client(
      std::move(channel),
      options.auth_token.empty() ? std::string() : absl::StrCat("Bearer ", options.auth_token)));
}

Client::Client(std::shared_ptr<grpc::Channel> channel, std::string authorization)
    : authorization_(std::move(authorization)),
      channel_(std::move(channel)),
      inference_(inference::GRPCInferenceService::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::Status Client::WaitForConnected(absl::Time deadline) {
  if (channel_->WaitForConnected(absl::ToChronoTime(deadline))) return absl::OkStatus();
  const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
  return absl::UnavailableError(absl::StrCat("not connected by the deadline (channel ",
                                             state == GRPC_CHANNEL_TRANSIENT_FAILURE
                                                 ? "in TRANSIENT_FAILURE: its attempts failed"
                                                 : "still CONNECTING",
                                             ")"));
}

void Client::PrepareContext(grpc::ClientContext& context, absl::Time deadline) const {
  // Converting InfiniteFuture to a chrono time point would overflow; no
  // deadline is gRPC's default anyway.
  if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
  // Per-call metadata rather than gRPC call credentials, which gRPC sends
  // only over TLS: a token must also reach a server behind a proxy that
  // terminates TLS.
  if (!authorization_.empty()) context.AddMetadata("authorization", authorization_);
}

void Client::PrepareInferContext(grpc::ClientContext& context, absl::Time deadline,
                                 const inference::ModelInferRequest& request) const {
  PrepareContext(context, deadline);
  if (const std::optional<std::string> session = SessionHeaderValue(SequenceIdOf(request))) {
    context.AddMetadata(kSessionHeader, *session);
  }
}

Client::~Client() {
  // The channel and stubs must outlive every call's gRPC state; a completion
  // counts itself out only once that state is gone.
  absl::MutexLock lock(&inflight_->mu);
  inflight_->mu.Await(absl::Condition(
      +[](int* calls) { return *calls == 0; }, &inflight_->calls));
}

absl::StatusOr<bool> Client::Live(absl::Time deadline) {
  using Stub = inference::GRPCInferenceService::Stub;
  absl::StatusOr<inference::ServerLiveResponse> response =
      CallUnary(*inference_, &Stub::ServerLive, inference::ServerLiveRequest(), deadline);
  if (!response.ok()) return response.status();
  return response->live();
}

absl::StatusOr<bool> Client::Ready(absl::Time deadline) {
  using Stub = inference::GRPCInferenceService::Stub;
  absl::StatusOr<inference::ServerReadyResponse> response =
      CallUnary(*inference_, &Stub::ServerReady, inference::ServerReadyRequest(), deadline);
  if (!response.ok()) return response.status();
  return response->ready();
}

absl::StatusOr<bool> Client::ModelReady(std::string_view model, absl::Time deadline) {
  using Stub = inference::GRPCInferenceService::Stub;
  inference::ModelReadyRequest request;
  request.set_name(std::string(model));
  absl::StatusOr<inference::ModelReadyResponse> response =
      CallUnary(*inference_, &Stub::ModelReady, request, deadline);
  if (!response.ok()) return response.status();
  return response->ready();
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health(
    absl::Time deadline) {
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      CallUnary(*health_, &grpc::health::v1::Health::Stub::Check,
                grpc::health::v1::HealthCheckRequest(), deadline);
  if (!response.ok()) return response.status();
  return response->status();
}

absl::StatusOr<inference::ServerMetadataResponse> Client::ServerMetadata(absl::Time deadline) {
  return CallUnary(*inference_, &inference::GRPCInferenceService::Stub::ServerMetadata,
                   inference::ServerMetadataRequest(), deadline);
}

absl::StatusOr<inference::RepositoryIndexResponse> Client::RepositoryIndex(absl::Time deadline) {
  return CallUnary(*inference_, &inference::GRPCInferenceService::Stub::RepositoryIndex,
                   inference::RepositoryIndexRequest(), deadline);
}

absl::StatusOr<inference::ModelMetadataResponse> Client::ModelMetadata(std::string_view model,
                                                                       absl::Time deadline) {
  inference::ModelMetadataRequest request;
  request.set_name(std::string(model));
  return CallUnary(*inference_, &inference::GRPCInferenceService::Stub::ModelMetadata, request,
                   deadline);
}

inference::ModelInferRequest Client::MakeInferRequest(std::string_view model, const Tensor& input,
                                                      const InferOptions& options) {
  inference::ModelInferRequest request;
  request.set_model_name(std::string(model));
  auto& parameters = *request.mutable_parameters();
  if (!IsNoSequence(options.sequence_id)) {
    if (const int64_t* integer = std::get_if<int64_t>(&options.sequence_id)) {
      parameters["sequence_id"].set_int64_param(*integer);
    } else {
      parameters["sequence_id"].set_string_param(std::get<std::string>(options.sequence_id));
    }
    parameters["sequence_start"].set_bool_param(options.sequence_start);
    parameters["sequence_end"].set_bool_param(options.sequence_end);
  } else {
    if (options.sequence_start) parameters["sequence_start"].set_bool_param(true);
    if (options.sequence_end) parameters["sequence_end"].set_bool_param(true);
  }
  if (options.sequence_position) {
    parameters["sequence_position"].set_int64_param(*options.sequence_position);
  }
  inference::ModelInferRequest::InferInputTensor* tensor = request.add_inputs();
  tensor->set_name(std::string(kHiddenStates));
  tensor->set_datatype(input.datatype);
  for (int64_t dim : input.shape) tensor->add_shape(dim);
  request.add_outputs()->set_name(std::string(kHiddenStates));
  request.add_raw_input_contents(input.data);
  return request;
}

absl::StatusOr<int> Client::CheckOutput(const inference::ModelInferResponse& response) {
  for (int i = 0; i < response.outputs_size(); ++i) {
    const inference::ModelInferResponse::InferOutputTensor& output = response.outputs(i);
    if (output.name() != kHiddenStates) continue;
    if (i >= response.raw_output_contents_size()) {
      return absl::InternalError(absl::StrCat("reply has output '", output.name(), "' at index ", i,
                                              " but only ", response.raw_output_contents_size(),
                                              " raw_output_contents entries"));
    }
    const std::vector<int64_t> shape(output.shape().begin(), output.shape().end());
    const std::optional<int64_t> count = NumElementsOf(shape);
    const std::optional<size_t> element_size = DatatypeByteSize(output.datatype());
    const size_t bytes = response.raw_output_contents(i).size();
    if (!count || !element_size || bytes != static_cast<size_t>(*count) * *element_size) {
      return absl::InternalError(absl::StrCat("reply output '", output.name(), "' has ", bytes,
                                              " raw bytes for shape [", absl::StrJoin(shape, ","),
                                              "] of datatype ", output.datatype()));
    }
    return i;
  }
  return absl::InternalError(absl::StrCat("reply has no output named '", kHiddenStates, "'"));
}

absl::StatusOr<Tensor> Client::OutputFromResponse(inference::ModelInferResponse&& response) {
  absl::StatusOr<int> index = CheckOutput(response);
  if (!index.ok()) return index.status();
  const inference::ModelInferResponse::InferOutputTensor& output = response.outputs(*index);
  return Tensor{output.datatype(),
                {output.shape().begin(), output.shape().end()},
                std::move(*response.mutable_raw_output_contents(*index))};
}

absl::StatusOr<inference::ModelInferResponse> Client::InferRaw(
    const inference::ModelInferRequest& request, absl::Time deadline) {
  grpc::ClientContext context;
  PrepareInferContext(context, deadline, request);
  inference::ModelInferResponse response;
  absl::Status status = FromGrpcStatus(inference_->ModelInfer(&context, request, &response));
  if (!status.ok()) return status;
  return response;
}

std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> Client::StartInfer(
    grpc::ClientContext& context, const inference::ModelInferRequest& request, absl::Time deadline,
    grpc::CompletionQueue* cq) {
  PrepareInferContext(context, deadline, request);
  return inference_->AsyncModelInfer(&context, request, cq);
}

absl::StatusOr<Tensor> Client::Infer(std::string_view model, const Tensor& input,
                                     absl::Time deadline, const InferOptions& options) {
  absl::StatusOr<inference::ModelInferResponse> response =
      InferRaw(MakeInferRequest(model, input, options), deadline);
  if (!response.ok()) return response.status();
  return OutputFromResponse(*std::move(response));
}

void Client::AsyncInfer(std::string_view model, const Tensor& input, absl::Time deadline,
                        InferCallback done) {
  AsyncInfer(model, input, deadline, InferOptions{}, std::move(done));
}

void Client::AsyncInfer(std::string_view model, const Tensor& input, absl::Time deadline,
                        const InferOptions& options, InferCallback done) {
  // Everything the call refers to must live until gRPC invokes the reaction,
  // so it is owned by one heap object that the reaction deletes.
  struct Call {
    grpc::ClientContext context;
    inference::ModelInferRequest request;
    inference::ModelInferResponse response;
    InferCallback done;
  };
  auto call = std::make_unique<Call>();
  call->request = MakeInferRequest(model, input, options);
  PrepareInferContext(call->context, deadline, call->request);
  call->done = std::move(done);
  {
    absl::MutexLock lock(&inflight_->mu);
    ++inflight_->calls;
  }
  Call* raw = call.release();
  inference_->async()->ModelInfer(&raw->context, &raw->request, &raw->response,
                                  [raw, inflight = inflight_](grpc::Status status) {
                                    // Release the call's gRPC state (its ClientContext) and count
                                    // the call out before telling the caller: `done` may destroy
                                    // this Client, and with it the channel, from this thread or
                                    // another.
                                    InferCallback done;
                                    absl::StatusOr<Tensor> result;
                                    {
                                      std::unique_ptr<Call> owned(raw);
                                      const absl::Status grpc_status = FromGrpcStatus(status);
                                      result = grpc_status.ok()
                                                   ? OutputFromResponse(std::move(owned->response))
                                                   : absl::StatusOr<Tensor>(grpc_status);
                                      done = std::move(owned->done);
                                    }
                                    {
                                      absl::MutexLock lock(&inflight->mu);
                                      --inflight->calls;
                                    }
                                    done(std::move(result));
                                  });
}

std::unique_ptr<InferStream> Client::OpenStream(absl::Time deadline, const SequenceId& session) {
  std::unique_ptr<InferStream> stream(new InferStream(channel_));
  PrepareContext(stream->context_, deadline);
  if (const std::optional<std::string> value = SessionHeaderValue(session)) {
    stream->context_.AddMetadata(kSessionHeader, *value);
  }
  absl::MutexLock lock(&stream->mu_);
  stream->stream_ = inference_->ModelStreamInfer(&stream->context_);
  return stream;
}

absl::Status StreamErrorStatus(std::string_view error_message) {
  absl::Status status(absl::StatusCode::kUnknown,
                      absl::string_view(error_message.data(), error_message.size()));
  const size_t colon = error_message.find(": ");
  if (colon != std::string_view::npos) {
    const std::string_view name = error_message.substr(0, colon);
    // google.rpc.Code: 1 (CANCELLED) to 16 (UNAUTHENTICATED); OK is no error.
    for (int code = 1; code <= 16; ++code) {
      if (absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) != name) continue;
      const std::string_view message = error_message.substr(colon + 2);
      status = absl::Status(static_cast<absl::StatusCode>(code),
                            absl::string_view(message.data(), message.size()));
      break;
    }
  }
  status.SetPayload(kCallStatusPayload, absl::Cord());
  return status;
}

InferStream::~InferStream() {
  absl::MutexLock lock(&mu_);
  if (final_) return;
  // Finish after a cancellation returns at once; it releases the call.
  context_.TryCancel();
  stream_->Finish();
}

absl::Status InferStream::BreakLocked() {
  absl::Status status = FromGrpcStatus(stream_->Finish());
  if (status.ok()) {
    // The server finished the call without answering the request.
    status = FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                         "the server ended the stream before answering"));
  }
  final_ = status;
  return status;
}

absl::StatusOr<Tensor> InferStream::Infer(std::string_view model, const Tensor& input,
                                          const InferOptions& options) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("the stream is closed");
  if (final_) return *final_;
  inference::ModelInferRequest request = Client::MakeInferRequest(model, input, options);
  const std::string id = absl::StrCat(next_id_++);
  request.set_id(id);
  // A failed write means the call is over: Finish says why.
  if (!stream_->Write(request)) return BreakLocked();
  inference::ModelStreamInferResponse reply;
  if (!stream_->Read(&reply)) return BreakLocked();
  if (reply.infer_response().id() != id) {
    // Every later reply would be off by one too: end the call.
    context_.TryCancel();
    stream_->Finish();
    final_ = absl::InternalError(absl::StrCat("the stream's reply is for request id '",
                                              reply.infer_response().id(), "', expected '", id,
                                              "'; stream cancelled"));
    return *final_;
  }
  if (!reply.error_message().empty()) return StreamErrorStatus(reply.error_message());
  return Client::OutputFromResponse(std::move(*reply.mutable_infer_response()));
}

absl::Status InferStream::Close() {
  absl::MutexLock lock(&mu_);
  if (!final_) {
    // WritesDone fails only on a call that is already over; Finish says how.
    stream_->WritesDone();
    final_ = FromGrpcStatus(stream_->Finish());
  }
  closed_ = true;
  return *final_;
}

}  // namespace layerserve::client
