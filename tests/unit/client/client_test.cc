// The request Client::Infer sends: the tensor, and the sequence parameters of
// InferOptions spelled as tritonclient spells them (sequence_id int64_param or
// string_param, sequence_start and sequence_end bool_param) plus
// sequence_position (int64_param). And the connection's security options: the
// bearer token on every call (seen by an in-process server), the options
// refused, and the credential files.
#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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

TEST(ClientSecurityTest, TheTokenRidesOnEveryCall) {
  RecordingService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = "127.0.0.1:" + std::to_string(port);
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

}  // namespace
}  // namespace layerserve::client
