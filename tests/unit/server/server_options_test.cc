// The option structs main.cc wires, built from a command line
// (server/server_options.h): flags in, options out, and the combinations
// start-up refuses, each with the error a user reads.
#include "server/server_options.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/grpc/completion_queues.h"
#include "server/server_flags.h"
#include "server/server_security.h"

namespace layerserve {
namespace {

using std::chrono::microseconds;

// The flags `args` parse into (ParseCommandLine, as main runs it).
ServerFlags Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "layerserve");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  ServerFlags flags;
  const std::optional<int> exit_status =
      ParseCommandLine(static_cast<int>(argv.size()), argv.data(), "test", flags);
  EXPECT_FALSE(exit_status.has_value()) << "the command line did not parse";
  return flags;
}

// CheckFlags' error for `args`, empty when they pass.
std::string Refusal(std::vector<std::string> args) {
  const absl::Status status = CheckFlags(Parse(std::move(args)));
  EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kInvalidArgument) << status;
  return std::string(status.message());
}

TEST(ServerOptionsTest, BatcherOptionsTakeTheFlags) {
  const ServerFlags flags =
      Parse({"--max-batch-tokens=64", "--max-queue-delay-us=7", "--batch-delay-when-idle",
             "--max-device-wait-us=0", "--device-lead-us=9", "--max-queue-size=5",
             "--max-queue-bytes=1000", "--reply-threads=3", "--prefill-chunk-tokens=32"});
  SessionTable* const sessions = reinterpret_cast<SessionTable*>(0x1000);  // only passed through
  const BatcherOptions options = BatcherOptionsFromFlags(flags, /*hidden_size=*/512, sessions);
  EXPECT_EQ(options.policy.max_batch_tokens, 64);
  EXPECT_EQ(options.policy.max_queue_delay, microseconds(7));
  EXPECT_TRUE(options.policy.delay_when_idle);
  EXPECT_EQ(options.policy.max_device_wait, microseconds(0));
  EXPECT_EQ(options.policy.device_lead, microseconds(9));
  EXPECT_EQ(options.max_queue_size, 5);
  EXPECT_EQ(options.max_queue_bytes, 1000);
  EXPECT_EQ(options.reply_threads, 3);
  EXPECT_EQ(options.prefill_chunk_tokens, 32);
  EXPECT_EQ(options.sessions, sessions);

  const ServingLimits limits = ServingLimitsOf(options);
  EXPECT_EQ(limits.max_queue_size, 5);
  EXPECT_EQ(limits.max_queue_bytes, 1000);
  EXPECT_EQ(limits.max_batch_tokens, 64);
  EXPECT_DOUBLE_EQ(limits.max_queue_delay_seconds, 7e-6);
}

TEST(ServerOptionsTest, DefaultsAreTheDocumentedOnes) {
  const ServerFlags flags = Parse({});
  ASSERT_TRUE(CheckFlags(flags).ok());
  const BatcherOptions options = BatcherOptionsFromFlags(flags, 4096, nullptr);
  EXPECT_EQ(options.policy.max_batch_tokens, 8192);
  EXPECT_EQ(options.policy.max_queue_delay, microseconds(500));
  EXPECT_FALSE(options.policy.delay_when_idle);
  EXPECT_EQ(options.policy.max_device_wait, microseconds(2000));
  EXPECT_EQ(options.policy.device_lead, microseconds(100));
  EXPECT_EQ(options.max_queue_size, 1024);
  EXPECT_EQ(options.reply_threads, 4);
  // --max-queue-bytes=0 is the default size for this model's hidden size.
  EXPECT_EQ(options.max_queue_bytes, DefaultMaxQueueBytes(options.policy, 4096));
  EXPECT_EQ(options.sessions, nullptr);

  EXPECT_EQ(CpuBackendOptionsFromFlags(flags).num_threads, 0);
  EXPECT_EQ(CpuBackendOptionsFromFlags(Parse({"--cpu-threads=3"})).num_threads, 3);

  const DrainOptions drain = DrainOptionsFromFlags(flags, /*sessions_on=*/true);
  EXPECT_EQ(drain.sessions_timeout, absl::Seconds(30));
  EXPECT_EQ(drain.calls_timeout, absl::Seconds(30));
  // Without sessions there is nothing to wait for before the calls.
  EXPECT_EQ(DrainOptionsFromFlags(flags, false).sessions_timeout, absl::ZeroDuration());
}

TEST(ServerOptionsTest, ModelSourceNamesTheModel) {
  absl::StatusOr<ModelSource> demo = ModelSourceFromFlags(Parse({}));
  ASSERT_TRUE(demo.ok()) << demo.status();
  EXPECT_EQ(demo->model_dir, "");
  EXPECT_EQ(demo->model_name, "demo");
  EXPECT_FALSE(demo->range.begin.has_value());
  EXPECT_FALSE(demo->range.end.has_value());
  EXPECT_EQ(demo->Description(":"), "the built-in demo model, all layers");

  absl::StatusOr<ModelSource> dir =
      ModelSourceFromFlags(Parse({"--model-dir=/m/Llama-3/", "--layers=2:4"}));
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->model_name, "Llama-3");  // the directory's name, without the slash
  EXPECT_EQ(dir->range.begin, 2);
  EXPECT_EQ(dir->range.end, 4);
  EXPECT_EQ(dir->Description("2:4"), "/m/Llama-3/ layers 2:4");

  absl::StatusOr<ModelSource> named =
      ModelSourceFromFlags(Parse({"--model-dir=/m/x", "--model-name=stage0"}));
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->model_name, "stage0");
}

TEST(ServerOptionsTest, KvCachePlan) {
  constexpr int64_t kBlockBytes = 4096;
  // A backend without a KV cache: sessions off, and the reason says which.
  absl::StatusOr<KvCachePlan> none = PlanKvCache(Parse({}), "cuda", 0, 1 << 30);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->shape.has_value());
  EXPECT_EQ(none->off_reason, "the cuda backend keeps no KV cache yet");
  EXPECT_TRUE(absl::StrContains(none->Summary(Parse({})), "sessions: off"));

  absl::StatusOr<KvCachePlan> zero =
      PlanKvCache(Parse({"--kv-cache-memory=0"}), "cpu", kBlockBytes, 1 << 30);
  ASSERT_TRUE(zero.ok());
  EXPECT_FALSE(zero->shape.has_value());
  EXPECT_EQ(zero->off_reason, "--kv-cache-memory=0");

  const ServerFlags sized = Parse({"--kv-cache-memory=1M", "--kv-block-tokens=8"});
  absl::StatusOr<KvCachePlan> plan = PlanKvCache(sized, "cpu", kBlockBytes, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(plan->shape.has_value());
  EXPECT_EQ(plan->shape->num_blocks, 256);  // 1 MiB / 4 KiB
  EXPECT_EQ(plan->shape->block_tokens, 8);
  EXPECT_TRUE(absl::StrContains(plan->Summary(sized), "256 blocks x 8 tokens = 2048 tokens"))
      << plan->Summary(sized);

  // auto: 0.9 of a device's free memory, a quarter of a host's.
  constexpr int64_t kAvailable = int64_t{1000} * kBlockBytes;
  absl::StatusOr<KvCachePlan> cuda = PlanKvCache(Parse({}), "cuda", kBlockBytes, kAvailable);
  absl::StatusOr<KvCachePlan> cpu = PlanKvCache(Parse({}), "cpu", kBlockBytes, kAvailable);
  ASSERT_TRUE(cuda.ok() && cpu.ok());
  EXPECT_EQ(cuda->shape->num_blocks, 900);
  EXPECT_EQ(cpu->shape->num_blocks, 250);

  // Less than one block is refused, saying how much it gave.
  absl::StatusOr<KvCachePlan> tiny =
      PlanKvCache(Parse({"--kv-cache-memory=1K"}), "cpu", kBlockBytes, 0);
  ASSERT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(tiny.status().message(),
                                "--kv-cache-memory=1K gives 1024 bytes, less than one KV cache "
                                "block of 16 tokens (4096 bytes for this span)"))
      << tiny.status();

  const SessionTableOptions table = SessionTableOptionsFromFlags(
      Parse({"--max-sessions=3", "--max-session-tokens=99", "--session-idle-timeout-s=5"}),
      *plan->shape);
  EXPECT_EQ(table.num_blocks, 256);
  EXPECT_EQ(table.block_tokens, 8);
  EXPECT_EQ(table.max_sessions, 3);
  EXPECT_EQ(table.max_session_tokens, 99);
  EXPECT_EQ(table.idle_timeout, std::chrono::seconds(5));
}

// --kv-cache-dtype: checked before anything starts, handed to the backend,
// advertised with the sessions.
TEST(ServerOptionsTest, KvCacheDtypeReachesTheBackendAndTheModelConfig) {
  EXPECT_EQ(Refusal({"--kv-cache-dtype=fp8"}), "");
  EXPECT_EQ(Refusal({"--kv-cache-dtype=fp8_e4m3"}), "");
  EXPECT_NE(Refusal({"--kv-cache-dtype=int8"}).find("--kv-cache-dtype=int8"), std::string::npos);
  EXPECT_EQ(CpuBackendOptionsFromFlags(Parse({})).kv_cache_dtype, KvCacheDType::kActivation);
  const ServerFlags fp8 = Parse({"--kv-cache-dtype=fp8"});
  EXPECT_EQ(CpuBackendOptionsFromFlags(fp8).kv_cache_dtype, KvCacheDType::kFp8E4M3);
  KvCachePlan kv;
  kv.shape = KvCacheShape{.num_blocks = 10, .block_tokens = 16};
  const ModelSpan span = MakeDemoModel({.begin = 0, .end = 1}, "demo");
  EXPECT_EQ(ServedModelFromFlags(fp8, span, "cpu", kv).kv_cache_dtype, KvCacheDType::kFp8E4M3);
  EXPECT_EQ(ServedModelFromFlags(Parse({}), span, "cpu", kv).kv_cache_dtype,
            KvCacheDType::kActivation);
}

TEST(ServerOptionsTest, ServedModelReportsTheSpanAndItsSessions) {
  const ServerFlags flags =
      Parse({"--max-batch-tokens=128", "--max-queue-delay-us=50", "--max-queue-size=9",
             "--max-sessions=4", "--session-idle-timeout-s=2", "--kv-block-tokens=8"});
  const ModelSpan span = MakeDemoModel({.begin = 1, .end = 3}, "demo");
  KvCachePlan kv;
  kv.shape = KvCacheShape{.num_blocks = 10, .block_tokens = 8};
  const ServedModel served = ServedModelFromFlags(flags, span, "cpu", kv);
  EXPECT_EQ(served.name, "demo");
  EXPECT_EQ(served.first_layer, 1);
  EXPECT_EQ(served.num_layers, 2);
  EXPECT_EQ(served.backend, "cpu");
  EXPECT_EQ(served.config.hidden_size, span.config.hidden_size);
  EXPECT_EQ(served.max_batch_tokens, 128);
  EXPECT_EQ(served.max_queue_delay_us, 50);
  EXPECT_EQ(served.max_queue_size, 9);
  EXPECT_TRUE(served.sessions);
  EXPECT_EQ(served.kv_blocks, 10);
  EXPECT_EQ(served.kv_block_tokens, 8);
  EXPECT_EQ(served.max_sessions, 4);
  EXPECT_EQ(served.session_idle_timeout_us, 2'000'000);

  KvCachePlan off;
  off.off_reason = "--kv-cache-memory=0";
  const ServedModel without = ServedModelFromFlags(flags, span, "cpu", off);
  EXPECT_FALSE(without.sessions);
  EXPECT_EQ(without.sessions_off_reason, "--kv-cache-memory=0");
}

TEST(ServerOptionsTest, GrpcFrontendOptions) {
  const ServerFlags flags =
      Parse({"--host=127.0.0.1", "--grpc-max-connection-age-s=60", "--grpc-max-connection-idle-s=7",
             "--drain-timeout-s=11", "--grpc-threads=3", "--grpc-max-concurrent-streams=50"});
  ServerSecurity security;
  security.auth_token = "secret";
  const GrpcFrontendOptions options = GrpcFrontendOptionsFromFlags(flags, security, 4321, "1.2.3");
  EXPECT_EQ(options.host, "127.0.0.1");
  EXPECT_EQ(options.port, 4321);
  EXPECT_EQ(options.server_version, "1.2.3");
  EXPECT_EQ(options.max_connection_age_s, 60);
  EXPECT_EQ(options.max_connection_idle_s, 7);
  // Calls in flight on a connection that reached its age get the drain's time.
  EXPECT_EQ(options.max_connection_age_grace_s, 11);
  EXPECT_EQ(options.queue_threads, 3);
  EXPECT_EQ(options.max_concurrent_streams, 50);
  EXPECT_EQ(options.auth_token, "secret");
  EXPECT_FALSE(options.tls.has_value());
  // 0: the default number of threads for this machine.
  EXPECT_EQ(GrpcFrontendOptionsFromFlags(Parse({}), security, 1, "v").queue_threads,
            DefaultQueueThreads());
  EXPECT_EQ(GrpcFrontendOptionsFromFlags(Parse({}), security, 1, "v").max_concurrent_streams, 1024);
}

TEST(ServerOptionsTest, BadValuesAndCombinationsAreRefused) {
  EXPECT_EQ(Refusal({}), "");
  EXPECT_EQ(Refusal({"--max-batch-tokens=0"}), "--max-batch-tokens must be >= 1");
  EXPECT_EQ(Refusal({"--reply-threads=0"}), "--reply-threads must be in [1, 64]");
  EXPECT_EQ(Refusal({"--grpc-port=70000"}), "port 70000 is outside [0, 65535]");
  EXPECT_TRUE(absl::StartsWith(Refusal({"--layers=x"}), "--layers=x: ")) << Refusal({"--layers=x"});
  EXPECT_EQ(Refusal({"--log-format=xml"}), "--log-format=xml is not one of text, json");
  EXPECT_TRUE(
      absl::StartsWith(Refusal({"--kv-cache-memory=lots"}), "--kv-cache-memory=lots is not"));
  // --metrics-tls serves /metrics with the gRPC port's certificate: without
  // one it is refused before anything is read.
  const absl::StatusOr<ServerSecurity> security = LoadServerSecurity(Parse({"--metrics-tls"}));
  EXPECT_EQ(security.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(security.status().message(), "--metrics-tls needs --tls-cert-file and --tls-key-file");
}

}  // namespace
}  // namespace layerserve
