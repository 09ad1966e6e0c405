// The request Client::Infer sends: the tensor, and the sequence parameters of
// InferOptions spelled as tritonclient spells them (sequence_id int64_param or
// string_param, sequence_start and sequence_end bool_param) plus
// sequence_position (int64_param). And the connection's security options: the
// bearer token on every call (seen by an in-process server), the options
// refused, and the credential files. And InferStream against an in-process
// server that scripts each reply: error replies as statuses (the stream
// staying usable), broken streams as their final status. (Against the real
// server: tests/integration/sessions_test.cc.)
#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace layerserve::client {
namespace {

const Tensor kInput{"FP32", {1, 2, 4}, std::string(32, '\0')};

const inference::InferParameter* Find(const inference::ModelInferRequest& request,
                                      const std::string& name) {
  const auto it = request.parameters().find(name);
  return it == request.parameters().end() ? nullptr : &it->second;
}

TEST(ClientRequestTest, StatelessRequestCarriesNoParameters) {
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput);
  EXPECT_EQ(request.model_name(), "demo");
  ASSERT_EQ(request.inputs_size(), 1);
  EXPECT_EQ(request.inputs(0).name(), kHiddenStates);
  EXPECT_EQ(request.raw_input_contents_size(), 1);
  EXPECT_TRUE(request.parameters().empty());

  // 0 and "" are "no sequence", as in tritonclient: nothing is sent.
  for (const SequenceId& none : {SequenceId(int64_t{0}), SequenceId(std::string())}) {
    InferOptions options;
    options.sequence_id = none;
    EXPECT_TRUE(IsNoSequence(none));
    EXPECT_TRUE(Client::MakeInferRequest("demo", kInput, options).parameters().empty());
  }
}

TEST(ClientRequestTest, IntegerSequenceAsTritonclientSendsIt) {
  InferOptions options;
  options.sequence_id = int64_t{42};
  options.sequence_start = true;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  const inference::InferParameter* id = Find(request, "sequence_id");
  ASSERT_NE(id, nullptr);
  EXPECT_EQ(id->parameter_choice_case(), inference::InferParameter::kInt64Param);
  EXPECT_EQ(id->int64_param(), 42);
  // Both flags, even a false one, as tritonclient does for a sequence.
  ASSERT_NE(Find(request, "sequence_start"), nullptr);
  EXPECT_EQ(Find(request, "sequence_start")->parameter_choice_case(),
            inference::InferParameter::kBoolParam);
  EXPECT_TRUE(Find(request, "sequence_start")->bool_param());
  ASSERT_NE(Find(request, "sequence_end"), nullptr);
  EXPECT_FALSE(Find(request, "sequence_end")->bool_param());
  EXPECT_EQ(Find(request, "sequence_position"), nullptr);
}

TEST(ClientRequestTest, StringSequenceWithEndAndPosition) {
  InferOptions options;
  options.sequence_id = std::string("chat-7");
  options.sequence_end = true;
  options.sequence_position = 17;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  EXPECT_FALSE(IsNoSequence(options.sequence_id));
  ASSERT_NE(Find(request, "sequence_id"), nullptr);
  EXPECT_EQ(Find(request, "sequence_id")->parameter_choice_case(),
            inference::InferParameter::kStringParam);
  EXPECT_EQ(Find(request, "sequence_id")->string_param(), "chat-7");
  EXPECT_FALSE(Find(request, "sequence_start")->bool_param());
  EXPECT_TRUE(Find(request, "sequence_end")->bool_param());
  ASSERT_NE(Find(request, "sequence_position"), nullptr);
  EXPECT_EQ(Find(request, "sequence_position")->parameter_choice_case(),
            inference::InferParameter::kInt64Param);
  EXPECT_EQ(Find(request, "sequence_position")->int64_param(), 17);
}

TEST(ClientRequestTest, FlagsWithoutAnIdAreSentForTheServerToRefuse) {
  // tritonclient drops them silently; this client sends them, and the server
  // answers INVALID_ARGUMENT instead of computing a stateless request.
  InferOptions options;
  options.sequence_start = true;
  options.sequence_position = 0;
  const inference::ModelInferRequest request = Client::MakeInferRequest("demo", kInput, options);
  EXPECT_EQ(Find(request, "sequence_id"), nullptr);
  ASSERT_NE(Find(request, "sequence_start"), nullptr);
  EXPECT_TRUE(Find(request, "sequence_start")->bool_param());
  EXPECT_EQ(Find(request, "sequence_end"), nullptr) << "false flags are not sent without an id";
  ASSERT_NE(Find(request, "sequence_position"), nullptr);
}

// Records the authorization metadata of every call it answers.
class RecordingService final : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ServerLive(grpc::ServerContext* context, const inference::ServerLiveRequest*,
                          inference::ServerLiveResponse* response) override {
    Record(*context);
    response->set_live(true);
    return grpc::Status::OK;
  }
  grpc::Status ModelMetadata(grpc::ServerContext* context, const inference::ModelMetadataRequest*,
                             inference::ModelMetadataResponse*) override {
    Record(*context);
    return grpc::Status::OK;
  }
  grpc::Status ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest*,
                          inference::ModelInferResponse*) override {
    Record(*context);
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "recorded");
  }
  std::vector<std::string> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    std::string value = "(none)";
    const auto [begin, end] = context.client_metadata().equal_range("authorization");
    if (begin != end) value.assign(begin->second.data(), begin->second.size());
    absl::MutexLock lock(&mu_);
    seen_.push_back(value);
  }
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

// `service` on a free loopback port; *address is "127.0.0.1:PORT".
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *address = "127.0.0.1:" + std::to_string(port);
  return server;
}

TEST(ClientSecurityTest, TheTokenRidesOnEveryCall) {
  RecordingService service;
  std::string address;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&service, &address);
  ASSERT_NE(server, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(address, ConnectOptions{.auth_token = "t0ken"});
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_TRUE((*client)->Live(deadline).ok());
    EXPECT_TRUE((*client)->ModelMetadata("demo", deadline).ok());
    EXPECT_EQ((*client)->Infer("demo", kInput, deadline).status().code(),
              absl::StatusCode::kUnauthenticated);
    absl::Notification done;
    (*client)->AsyncInfer("demo", kInput, deadline,
                          [&done](absl::StatusOr<Tensor>) { done.Notify(); });
    done.WaitForNotification();
  }
  absl::StatusOr<std::unique_ptr<Client>> plain = Client::Connect(address);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE((*plain)->Live(deadline).ok());
  EXPECT_EQ(service.seen(), (std::vector<std::string>{"Bearer t0ken", "Bearer t0ken",
                                                      "Bearer t0ken", "Bearer t0ken", "(none)"}));
  server->Shutdown();
}

TEST(SessionHeaderValueTest, IntegersInDecimalStringsAsThemselves) {
  EXPECT_EQ(SessionHeaderValue(SequenceId(int64_t{42})), "42");
  EXPECT_EQ(SessionHeaderValue(SequenceId(int64_t{-7})), "-7");
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string("chat 7"))), "chat 7");
  EXPECT_EQ(SessionHeaderValue(SequenceId(int64_t{0})), std::nullopt);
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string())), std::nullopt);
  // What no header value can carry, or the server refuses anyway.
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string("a\nb"))), std::nullopt);
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string(" a"))), std::nullopt);
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string(257, 'a'))), std::nullopt);
  EXPECT_EQ(SessionHeaderValue(SequenceId(std::string(256, 'a'))), std::string(256, 'a'));
}

// Records the x-session-id header of every ModelInfer and ModelStreamInfer.
class SessionHeaderService final : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest*,
                          inference::ModelInferResponse*) override {
    Record(*context);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "recorded");
  }
  grpc::Status ModelStreamInfer(grpc::ServerContext* context,
                                grpc::ServerReaderWriter<inference::ModelStreamInferResponse,
                                                         inference::ModelInferRequest>*) override {
    Record(*context);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "recorded");
  }
  std::vector<std::string> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    std::vector<std::string> values;
    const auto [begin, end] = context.client_metadata().equal_range(kSessionHeader);
    for (auto it = begin; it != end; ++it)
      values.emplace_back(it->second.data(), it->second.size());
    absl::MutexLock lock(&mu_);
    seen_.push_back(values.empty() ? "(none)" : absl::StrJoin(values, ","));
  }
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

TEST(ClientSessionHeaderTest, EveryCallOfASessionCarriesIt) {
  SessionHeaderService service;
  std::string address;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&service, &address);
  ASSERT_NE(server, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address);
    ASSERT_TRUE(client.ok()) << client.status();
    Client& c = **client;
    c.Infer("demo", kInput, deadline).IgnoreError();
    c.Infer("demo", kInput, deadline, {.sequence_id = int64_t{7}, .sequence_start = true})
        .IgnoreError();
    c.Infer("demo", kInput, deadline, {.sequence_id = std::string("chat-9")}).IgnoreError();
    absl::Notification done;
    c.AsyncInfer("demo", kInput, deadline, {.sequence_id = int64_t{8}},
                 [&done](absl::StatusOr<Tensor>) { done.Notify(); });
    done.WaitForNotification();
    inference::ModelInferRequest raw = Client::MakeInferRequest("demo", kInput);
    (*raw.mutable_parameters())["sequence_id"].set_uint64_param(9);
    c.InferRaw(raw, deadline).IgnoreError();
    c.OpenStream(deadline, int64_t{10})->Infer("demo", kInput).IgnoreError();
    c.OpenStream(deadline)->Infer("demo", kInput).IgnoreError();
  }
  EXPECT_EQ(service.seen(),
            (std::vector<std::string>{"(none)", "7", "chat-9", "8", "9", "10", "(none)"}));
  server->Shutdown();
}

TEST(ClientSecurityTest, OptionsThatCannotWorkAreRefused) {
  EXPECT_EQ(
      Client::Connect("127.0.0.1:1", ConnectOptions{.auth_token = "two words"}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect("127.0.0.1:1",
                            ConnectOptions{.tls = TlsOptions{.cert_chain_pem = "-----BEGIN"}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument)
      << "a certificate without its key";
  EXPECT_TRUE(Client::Connect("127.0.0.1:1", ConnectOptions{.tls = TlsOptions{}}).ok())
      << "TLS with the system's roots";
}

TEST(ClientSecurityTest, CredentialFiles) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/token") << "abc-123\n";
  std::ofstream(dir + "/blank") << "\n";
  std::ofstream(dir + "/ca.pem") << "-----BEGIN CERTIFICATE-----\n...\n";
  absl::StatusOr<std::string> token = ReadAuthTokenFile(dir + "/token", "--auth-token-file");
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "abc-123");
  token = ReadAuthTokenFile(dir + "/blank", "--auth-token-file");
  EXPECT_TRUE(
      absl::StrContains(token.status().message(), "--auth-token-file=" + dir + "/blank is empty"))
      << token.status();
  token = ReadAuthTokenFile(dir + "/missing", "--auth-token-file");
  EXPECT_TRUE(absl::StrContains(token.status().message(), "cannot be read")) << token.status();
  EXPECT_TRUE(ReadPemFile(dir + "/ca.pem", "--tls-ca-file").ok());
  absl::StatusOr<std::string> pem = ReadPemFile(dir + "/token", "--tls-ca-file");
  EXPECT_TRUE(
      absl::StrContains(pem.status().message(), "--tls-ca-file=" + dir + "/token is not PEM"))
      << pem.status();
}

TEST(StreamErrorStatusTest, RecoversTheServersCode) {
  absl::Status status = StreamErrorStatus("RESOURCE_EXHAUSTED: no KV cache blocks left: 3 needed");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "no KV cache blocks left: 3 needed");
  EXPECT_TRUE(IsCallStatus(status));
  status = StreamErrorStatus("NOT_FOUND: session \"x\" not found: a: b");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "session \"x\" not found: a: b");
  EXPECT_EQ(StreamErrorStatus("UNAUTHENTICATED: no token").code(),
            absl::StatusCode::kUnauthenticated);
  // Not in the server's form: UNKNOWN, the whole text.
  for (const char* text : {"OK: fine", "Bogus: x", "RESOURCE_EXHAUSTED:no space", "plain", ""}) {
    status = StreamErrorStatus(text);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnknown) << text;
    EXPECT_EQ(status.message(), text);
    EXPECT_TRUE(IsCallStatus(status));
  }
}

// Answers each stream request as its model name says: "echo" (the input
// back), "error" (error_message "NOT_FOUND: ..."), "raw-error" (a message
// without a code), "wrong-id" (a reply for another request), "hangup" (ends
// the call UNAVAILABLE without a reply), "hangup-ok" (ends it OK without
// one). Records each stream's authorization metadata.
class ScriptedStreamService final : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ModelStreamInfer(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<inference::ModelStreamInferResponse, inference::ModelInferRequest>*
          stream) override {
    {
      std::string value = "(none)";
      const auto [begin, end] = context->client_metadata().equal_range("authorization");
      if (begin != end) value.assign(begin->second.data(), begin->second.size());
      absl::MutexLock lock(&mu_);
      authorization_.push_back(value);
    }
    inference::ModelInferRequest request;
    while (stream->Read(&request)) {
      inference::ModelStreamInferResponse reply;
      inference::ModelInferResponse& response = *reply.mutable_infer_response();
      response.set_id(request.id());
      const std::string& model = request.model_name();
      if (model == "hangup") return grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining");
      if (model == "hangup-ok") return grpc::Status::OK;
      if (model == "error") {
        reply.set_error_message("NOT_FOUND: session 7 not found");
      } else if (model == "raw-error") {
        reply.set_error_message("something went wrong");
      } else if (model == "wrong-id") {
        response.set_id("elsewhere");
      } else {
        auto* output = response.add_outputs();
        output->set_name(kHiddenStates);
        output->set_datatype(request.inputs(0).datatype());
        *output->mutable_shape() = request.inputs(0).shape();
        response.add_raw_output_contents(request.raw_input_contents(0));
      }
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }
  std::vector<std::string> authorization() {
    absl::MutexLock lock(&mu_);
    return authorization_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> authorization_ ABSL_GUARDED_BY(mu_);
};

class InferStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string address;
    server_ = ServeOnLoopback(&service_, &address);
    ASSERT_NE(server_, nullptr);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(address, ConnectOptions{.auth_token = "tok"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) server_->Shutdown();
  }
  std::unique_ptr<InferStream> Open() {
    return client_->OpenStream(absl::Now() + absl::Seconds(30));
  }

  ScriptedStreamService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(InferStreamTest, ErrorRepliesAreStatusesAndTheStreamGoesOn) {
  const Tensor input{"FP32", {1, 2, 4}, std::string(32, '\x01')};
  std::unique_ptr<InferStream> stream = Open();
  absl::StatusOr<Tensor> out = stream->Infer("echo", input);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->shape, input.shape);
  EXPECT_EQ(out->data, input.data);

  out = stream->Infer("error", input);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
  EXPECT_EQ(out.status().message(), "session 7 not found");
  EXPECT_TRUE(IsCallStatus(out.status()));
  out = stream->Infer("raw-error", input);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnknown) << out.status();
  EXPECT_EQ(out.status().message(), "something went wrong");

  out = stream->Infer("echo", input);
  EXPECT_TRUE(out.ok()) << "the stream is still usable: " << out.status();
  EXPECT_TRUE(stream->Close().ok());
  EXPECT_TRUE(stream->Close().ok()) << "the same status again";
  EXPECT_EQ(stream->Infer("echo", input).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(service_.authorization(), std::vector<std::string>{"Bearer tok"});
}

TEST_F(InferStreamTest, ABrokenStreamGivesTheCallsStatus) {
  std::unique_ptr<InferStream> stream = Open();
  ASSERT_TRUE(stream->Infer("echo", kInput).ok());
  absl::StatusOr<Tensor> out = stream->Infer("hangup", kInput);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
  EXPECT_EQ(out.status().message(), "draining");
  EXPECT_TRUE(IsCallStatus(out.status()));
  // Broken for good: the same status from every later call.
  EXPECT_EQ(stream->Infer("echo", kInput).status(), out.status());
  EXPECT_EQ(stream->Close(), out.status());

  // Ended OK without an answer: still a failure of the request.
  stream = Open();
  out = stream->Infer("hangup-ok", kInput);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
  EXPECT_TRUE(absl::StrContains(out.status().message(), "before answering")) << out.status();
}

TEST_F(InferStreamTest, AReplyForAnotherRequestCancelsTheStream) {
  std::unique_ptr<InferStream> stream = Open();
  const absl::Status status = stream->Infer("wrong-id", kInput).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "'elsewhere', expected '1'")) << status;
  EXPECT_EQ(stream->Infer("echo", kInput).status(), status);
}

TEST_F(InferStreamTest, DeadlineAndUnclosedStreams) {
  // A deadline already past: the first request gets DEADLINE_EXCEEDED.
  std::unique_ptr<InferStream> late = client_->OpenStream(absl::Now() - absl::Seconds(1));
  EXPECT_EQ(late->Infer("echo", kInput).status().code(), absl::StatusCode::kDeadlineExceeded);
  // Destroyed open, with and without a request sent: cancelled, no hang;
  // the stream may outlive its client.
  std::unique_ptr<InferStream> open = Open();
  ASSERT_TRUE(open->Infer("echo", kInput).ok());
  open.reset();
  std::unique_ptr<InferStream> unused = Open();
  std::unique_ptr<InferStream> orphan = Open();
  ASSERT_TRUE(orphan->Infer("echo", kInput).ok());
  client_.reset();
  EXPECT_TRUE(orphan->Infer("echo", kInput).ok());
  EXPECT_TRUE(orphan->Close().ok());
}

TEST(WaitForConnectedTest, UpWithAServerAndUnavailableWithout) {
  RecordingService service;
  std::string address;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&service, &address);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> up =
      Client::Connect(address, /*dedicated_connection=*/true);
  ASSERT_TRUE(up.ok());
  EXPECT_TRUE((*up)->WaitForConnected(absl::Now() + absl::Seconds(10)).ok());
  server->Shutdown();

  absl::StatusOr<std::unique_ptr<Client>> down = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(down.ok());
  const absl::Status status = (*down)->WaitForConnected(absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("not connected by the deadline"), std::string::npos) << status;
}

TEST(InferStreamNoServerTest, AnUnreachableServerIsUnavailable) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  std::unique_ptr<InferStream> stream = (*client)->OpenStream(absl::Now() + absl::Seconds(10));
  const absl::Status status = stream->Infer("demo", kInput).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_EQ(stream->Close(), status);
}

}  // namespace
}  // namespace layerserve::client
