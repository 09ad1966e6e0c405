// End-to-end correctness: the real server (demo model, all layers) answers
// ModelInfer for several [B, T] in FP32, FP16 and BF16 within tolerance of the
// float64 reference, and its control endpoints (live, ready, health,
// metadata) answer as the protocol says.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>

#include "client/client.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"
#include "tests/integration/server_suite.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::Tensor;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

class CorrectnessTest
    : public ServerSuite<CorrectnessTest, ::testing::TestWithParam<std::tuple<int64_t, int64_t>>> {
 protected:
  static void SetUpTestSuite() {
    ServerSuite::SetUpTestSuite();
    reference_ = new DemoReference(0, 4);
  }
  static void TearDownTestSuite() {
    delete reference_;
    reference_ = nullptr;
    ServerSuite::TearDownTestSuite();
  }

  static DemoReference* reference_;
};

DemoReference* CorrectnessTest::reference_ = nullptr;

TEST_F(CorrectnessTest, ReadyLineNamesTheDemoModelAndAllLayers) {
  EXPECT_EQ(server_->model(), "demo");
  EXPECT_NE(server_->ready_line().find("layers=0:4"), std::string::npos) << server_->ready_line();
  // The backend asked for (scripts/gpu-run.sh passes --backend=cuda), else
  // the CPU backend: `auto` must not pick CUDA on a machine without a GPU.
  const char* server_args = std::getenv("LAYERSERVE_SERVER_ARGS");
  const bool cuda = server_args != nullptr &&
                    std::string(server_args).find("--backend=cuda") != std::string::npos;
  EXPECT_NE(server_->ready_line().find(cuda ? "backend=cuda" : "backend=cpu"), std::string::npos)
      << server_->ready_line();
}

TEST_F(CorrectnessTest, ControlEndpoints) {
  absl::StatusOr<bool> live = client_->Live(In(absl::Seconds(5)));
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_TRUE(*live);
  absl::StatusOr<bool> ready = client_->Ready(In(absl::Seconds(5)));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(*ready);
  absl::StatusOr<bool> model_ready = client_->ModelReady("demo", In(absl::Seconds(5)));
  ASSERT_TRUE(model_ready.ok()) << model_ready.status();
  EXPECT_TRUE(*model_ready);

  auto health = client_->Health(In(absl::Seconds(5)));
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);

  auto server_metadata = client_->ServerMetadata(In(absl::Seconds(5)));
  ASSERT_TRUE(server_metadata.ok()) << server_metadata.status();
  EXPECT_FALSE(server_metadata->name().empty());
  EXPECT_FALSE(server_metadata->version().empty());

  auto model_metadata = client_->ModelMetadata("demo", In(absl::Seconds(5)));
  ASSERT_TRUE(model_metadata.ok()) << model_metadata.status();
  EXPECT_EQ(model_metadata->name(), "demo");
  ASSERT_EQ(model_metadata->inputs_size(), 1);
  ASSERT_EQ(model_metadata->outputs_size(), 1);
  for (const auto& tensor : {model_metadata->inputs(0), model_metadata->outputs(0)}) {
    EXPECT_EQ(tensor.name(), "hidden_states");
    ASSERT_EQ(tensor.shape_size(), 3);
    EXPECT_EQ(tensor.shape(2), 512);
  }

  auto unknown = client_->ModelMetadata("no_such_model", In(absl::Seconds(5)));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();

  // The repository index names the served model (what a client that does
  // not know the name asks: layerctl metadata without --model).
  auto index = client_->RepositoryIndex(In(absl::Seconds(5)));
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->models_size(), 1);
  EXPECT_EQ(index->models(0).name(), "demo");
  EXPECT_EQ(index->models(0).version(), "1");
  EXPECT_EQ(index->models(0).state(), "READY");
  EXPECT_EQ(index->models(0).reason(), "");
}

TEST_F(CorrectnessTest, ResponseEchoesRequestId) {
  const std::vector<float> x = RandomBf16ExactValues(512, 5);
  absl::StatusOr<Tensor> input = client::FloatsToTensor(x, {1, 1, 512}, "FP32");
  ASSERT_TRUE(input.ok());
  inference::ModelInferRequest request = Client::MakeInferRequest("demo", *input);
  request.set_id("request-42");
  auto response = client_->InferRaw(request, In(absl::Seconds(30)));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->id(), "request-42");
  EXPECT_EQ(response->model_name(), "demo");
}

// One reference per shape; the input is exact in every datatype, so each
// datatype's reply is compared with the same float64 result.
TEST_P(CorrectnessTest, MatchesFloat64ReferenceInEveryDatatype) {
  const auto [batch, seq_len] = GetParam();
  const int64_t hidden = reference_->hidden();
  const std::vector<float> x = RandomBf16ExactValues(static_cast<size_t>(batch * seq_len * hidden),
                                                     static_cast<uint64_t>(1000 * batch + seq_len));
  const std::vector<double> expected = reference_->Run(x, batch, seq_len);
  const std::vector<int64_t> shape = {batch, seq_len, hidden};
  for (const std::string datatype : {"FP32", "FP16", "BF16"}) {
    SCOPED_TRACE(datatype);
    absl::StatusOr<Tensor> input = client::FloatsToTensor(x, shape, datatype);
    ASSERT_TRUE(input.ok()) << input.status();
    absl::StatusOr<Tensor> output = client_->Infer("demo", *input, In(absl::Seconds(60)));
    ASSERT_TRUE(output.ok()) << output.status();
    const ::testing::AssertionResult match = MatchesReference(*output, shape, datatype, expected);
    EXPECT_TRUE(match);
    std::fprintf(stderr, "[test] B=%lld T=%lld %s: %s\n", static_cast<long long>(batch),
                 static_cast<long long>(seq_len), datatype.c_str(), match.message());
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CorrectnessTest,
                         ::testing::Values(std::make_tuple(1, 1), std::make_tuple(2, 5),
                                           std::make_tuple(3, 17), std::make_tuple(1, 64)),
                         [](const auto& info) {
                           return "B" + std::to_string(std::get<0>(info.param)) + "_T" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace layerserve::integration
