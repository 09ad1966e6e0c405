// The command lines of the real binaries: `layerserve --help` documents every
// flag of docs/flags.md's table with its default, --version names the
// project's version, an unknown flag or bad value ends the process with one
// line naming it, and every spelling the project's scripts and deploy files
// use (dashes or underscores, --flag=value or --flag value, booleans) reaches
// the flag it names, as the served model's config shows. Also layerctl's exit
// statuses for help and usage errors, end to end through its main(), and its
// session bench against a server, over unary calls and over streams, with
// the failures' first messages in the report.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/server_process.h"

#if !defined(LAYERSERVE_VERSION) || !defined(LAYERSERVE_SOURCE_DIR) || !defined(LAYERCTL_BINARY)
#error "LAYERSERVE_VERSION, LAYERSERVE_SOURCE_DIR and LAYERCTL_BINARY must be defined by the build"
#endif

namespace layerserve::integration {
namespace {

// The build's paths, which the environment may override where the tests run
// from a bundle on another machine (scripts/gpu-run.sh).
std::string PathFromEnv(const char* name, const char* built) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : built;
}
std::string SourceDir() { return PathFromEnv("LAYERSERVE_SOURCE_DIR", LAYERSERVE_SOURCE_DIR); }
std::string LayerctlBinary() { return PathFromEnv("LAYERCTL_BINARY", LAYERCTL_BINARY); }

// The flag names in the first column of docs/flags.md's "## Flags" table
// ("| `--model-dir DIR` | ..." gives "--model-dir").
std::vector<std::string> DocumentedFlagNames() {
  std::ifstream readme(SourceDir() + "/docs/flags.md");
  std::vector<std::string> names;
  bool in_flags = false;
  for (std::string line; std::getline(readme, line);) {
    if (absl::StartsWith(line, "## ")) in_flags = line == "## Flags";
    if (!in_flags || !absl::StartsWith(line, "| `--")) continue;
    const std::string cell = line.substr(3);
    names.push_back(cell.substr(0, cell.find_first_of(" `")));
  }
  return names;
}

ProcessResult RunLayerserve(const std::vector<std::string>& flags) {
  std::vector<std::string> args = {LayerserveBinary()};
  args.insert(args.end(), flags.begin(), flags.end());
  absl::StatusOr<ProcessResult> result = RunToExit(args);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : ProcessResult{};
}

TEST(LayerserveCommandLineTest, HelpListsEveryDocumentedFlagWithItsDefault) {
  const std::vector<std::string> documented = DocumentedFlagNames();
  ASSERT_GE(documented.size(), 18u) << "docs/flags.md's table was not found or has changed shape";
  const ProcessResult help = RunLayerserve({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  for (const std::string& flag : documented) {
    EXPECT_TRUE(absl::StrContains(help.out, flag)) << flag << " is missing from:\n" << help.out;
  }
  // Defaults are shown: --max-batch-tokens' 8192, --grpc-port's 8001.
  EXPECT_TRUE(absl::StrContains(help.out, "8192")) << help.out;
  EXPECT_TRUE(absl::StrContains(help.out, "8001")) << help.out;
  EXPECT_TRUE(absl::StrContains(help.out, "--version")) << help.out;
}

TEST(LayerserveCommandLineTest, VersionPrintsTheProjectVersion) {
  const ProcessResult version = RunLayerserve({"--version"});
  EXPECT_EQ(version.exit_code, 0) << version.err;
  EXPECT_EQ(version.out, "layerserve " LAYERSERVE_VERSION "\n");
}

TEST(LayerserveCommandLineTest, UnknownFlagFailsNamingIt) {
  for (const std::string& flag : {"--no-such-flag=1", "--helpfull", "stray"}) {
    const ProcessResult result = RunLayerserve({flag});
    EXPECT_NE(result.exit_code, 0) << flag;
    EXPECT_TRUE(absl::StrContains(result.err, flag)) << result.err;
    EXPECT_EQ(result.out, "") << "no ready line may follow a bad flag";
  }
}

// One error line naming the flag, exit status 1, whichever spelling.
TEST(LayerserveCommandLineTest, BadValuesFailWithOneLine) {
  const struct {
    std::vector<std::string> flags;
    std::string message;
  } cases[] = {
      {{"--max-batch-tokens=0"}, "--max-batch-tokens must be >= 1"},
      {{"--max_batch_tokens", "0"}, "--max-batch-tokens must be >= 1"},
      {{"--max-queue-delay-us", "-1"}, "--max-queue-delay-us must be >= 0"},
      {{"--max-device-wait-us=-1"}, "--max-device-wait-us and --device-lead-us must be >= 0"},
      {{"--device-lead-us=-5"}, "--max-device-wait-us and --device-lead-us must be >= 0"},
      {{"--grpc-max-connection-idle-s=-1"}, "--grpc-max-connection-idle-s must be in [0, 2147483]"},
      {{"--grpc-max-concurrent-streams=-1"},
       "--grpc-max-concurrent-streams must be in [0, 2147483647]"},
      {{"--max-queue-size=4294967296"}, "--max-queue-size must be in [1, 4294967295]"},
      {{"--max-queue-bytes=-1"}, "--max-queue-bytes must be >= 0"},
      {{"--grpc_port=65536"}, "port 65536 is outside [0, 65535]"},
      {{"--cpu-threads=-1"}, "--cpu-threads must be >= 0"},
      {{"--streams=0"}, "--streams must be >= 1"},
      {{"--drain-timeout-s=-1"}, "--drain-timeout-s must be >= 0"},
      {{"--reply-threads=0"}, "--reply-threads must be in [1, 64]"},
      {{"--backend=tpu"}, "--backend=tpu is not one of auto, cpu, cuda"},
      {{"--grpc-port=abc"}, "--grpc-port"},
      {{"--grpc-port="}, "--grpc-port"},
      {{"--metrics-port"}, "--metrics-port"},
      {{"--gemm-autotune=maybe"}, "--gemm-autotune"},
      {{"--log-format=xml"}, "--log-format=xml is not one of text, json"},
      {{"--log-format", "json", "--streams=0"}, "--streams must be >= 1"},
      // Refused before any port is bound or the load is logged (issue 37).
      {{"--layers=0-2"}, "--layers=0-2: layer range '0-2'"},
      // The model's config and range are checked first too: start-up's only
      // line, not the third after the bind warning and the security summary.
      {{"--layers=3:9"}, "layer range [3, 9) is empty or outside the 4 layers of the demo model"},
      {{"--model-dir=/nonexistent-layerserve-model"},
       "/nonexistent-layerserve-model/config.json: cannot be read: No such file or directory"},
  };
  for (const auto& c : cases) {
    const ProcessResult result = RunLayerserve(c.flags);
    EXPECT_EQ(result.exit_code, 1) << c.flags[0] << ": " << result.err;
    EXPECT_TRUE(absl::StrContains(result.err, c.message)) << c.flags[0] << ": " << result.err;
    const std::vector<std::string> lines = absl::StrSplit(result.err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << c.flags[0] << ": " << result.err;
  }
}

// The served model's config reports what the batching flags were set to.
TEST(LayerserveCommandLineTest, EverySpellingReachesItsFlag) {
  // Underscores or dashes, values apart or joined, an empty value (the demo
  // model), booleans in each form, the CUDA flags (which every build
  // accepts), and a repeated flag whose last value, decimal despite its
  // leading zero, wins.
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
      {"--max_batch_tokens", "64", "--max-queue-delay-us", "1234", "--max_queue_size=77",
       "--layers", "1:3", "--model-dir=", "--model_name=spelled", "--gemm-autotune=false",
       "--nogemm_autotune", "--gemm_autotune", "--streams", "1", "--cuda_device=0",
       "--cpu-threads=1", "--drain_timeout_s=5", "--max-queue-delay-us=0100",
       "--batch_delay_when_idle"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->model(), "spelled");
  EXPECT_TRUE(absl::StrContains((*server)->ready_line(), "layers=1:3")) << (*server)->ready_line();

  auto stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel((*server)->grpc_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  inference::ModelConfigRequest request;
  request.set_name("spelled");
  inference::ModelConfigResponse response;
  const grpc::Status status = stub->ModelConfig(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const auto& config = response.config();
  EXPECT_EQ(config.parameters().at("max_batch_tokens").string_value(), "64");
  // Sessions served (a backend with a KV cache): the sequence batcher's
  // fields; otherwise the dynamic batcher's.
  if (config.has_sequence_batching()) {
    EXPECT_EQ(config.sequence_batching().oldest().max_queue_delay_microseconds(), 100u);
    EXPECT_EQ(config.parameters().at("max_queue_size").string_value(), "77");
  } else {
    EXPECT_EQ(config.dynamic_batching().max_queue_delay_microseconds(), 100u);
    EXPECT_EQ(config.dynamic_batching().default_queue_policy().max_queue_size(), 77u);
  }
}

ProcessResult RunLayerctl(const std::vector<std::string>& flags) {
  std::vector<std::string> args = {LayerctlBinary()};
  args.insert(args.end(), flags.begin(), flags.end());
  absl::StatusOr<ProcessResult> result = RunToExit(args);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : ProcessResult{};
}

TEST(LayerctlBinaryTest, HelpAndUsageErrorsExitAsDocumented) {
  const ProcessResult help = RunLayerctl({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  for (const char* text : {"health", "metadata", "infer", "bench", "--max-in-flight", "512"}) {
    EXPECT_TRUE(absl::StrContains(help.out, text)) << text << " is missing from:\n" << help.out;
  }
  const ProcessResult bench_help = RunLayerctl({"bench", "--help"});
  EXPECT_EQ(bench_help.exit_code, 0) << bench_help.err;
  EXPECT_TRUE(absl::StrContains(bench_help.out, "--connections")) << bench_help.out;

  for (const char* version : {"--version", "version"}) {
    const ProcessResult printed = RunLayerctl({version});
    EXPECT_EQ(printed.exit_code, 0) << version << ": " << printed.err;
    EXPECT_EQ(printed.out, "layerctl " LAYERSERVE_VERSION "\n") << version;
  }
  EXPECT_EQ(RunLayerctl({}).exit_code, 2);
  EXPECT_EQ(RunLayerctl({"frobnicate"}).exit_code, 2);
  const ProcessResult unknown = RunLayerctl({"health", "--no-such-flag"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(unknown.err, "--no-such-flag")) << unknown.err;
  const ProcessResult missing = RunLayerctl({"bench", "--model", "demo"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(missing.err, "--tokens")) << missing.err;
  const ProcessResult streaming =
      RunLayerctl({"bench", "--model=demo", "--tokens=1", "--concurrency=1", "--streaming"});
  EXPECT_EQ(streaming.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(streaming.err, "--streaming")) << streaming.err;
}

// `layerctl bench --sessions 4` against a server that allows 2 sessions, over
// unary calls and over a stream per session: either way 2 sessions complete,
// 2 are refused at their prefill, and the report and its JSON give the
// transport and the refusal's message.
TEST(LayerctlBinaryTest, SessionBenchOverEitherTransportKeepsTheFirstError) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start({"--kv-cache-memory=8MiB", "--max-sessions=2"});
  ASSERT_TRUE(server.ok()) << server.status();
  for (const bool streaming : {false, true}) {
    SCOPED_TRACE(streaming ? "stream" : "unary");
    const std::string json_path =
        ::testing::TempDir() + (streaming ? "/bench_stream.json" : "/bench_unary.json");
    std::vector<std::string> flags = {"bench",         "--url=" + (*server)->grpc_target(),
                                      "--model=demo",  "--sessions=4",
                                      "--prefill=5",   "--steps=3",
                                      "--no-progress", "--json=" + json_path};
    if (streaming) flags.push_back("--streaming");
    const ProcessResult bench = RunLayerctl(flags);
    EXPECT_EQ(bench.exit_code, 0) << bench.out << bench.err;
    for (const std::string& text :
         {std::string(streaming ? "a stream per session" : "unary calls"),
          std::string("sessions: 2 completed, 2 failed"),
          std::string("errors RESOURCE_EXHAUSTED: 2 (first: cannot start session"),
          std::string("the most allowed is 2)")}) {
      EXPECT_TRUE(absl::StrContains(bench.out, text)) << text << " is missing from:\n" << bench.out;
    }
    std::stringstream json;
    json << std::ifstream(json_path).rdbuf();
    for (const std::string& text :
         {std::string(streaming ? "\"transport\": \"stream\"" : "\"transport\": \"unary\""),
          std::string("\"first_error_by_code\": {\n    \"RESOURCE_EXHAUSTED\": \"cannot start "
                      "session"),
          std::string("\"steps_ok\": 6")}) {
      EXPECT_TRUE(absl::StrContains(json.str(), text)) << text << " is missing from:\n"
                                                       << json.str();
    }
  }
}

}  // namespace
}  // namespace layerserve::integration
