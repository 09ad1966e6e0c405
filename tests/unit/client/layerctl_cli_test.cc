// Tests of layerctl's command line (client/layerctl_cli.h): each command's
// flags and defaults, help text with the defaults, and the usage status (2)
// with a message naming the flag for everything the parser must refuse.
#include "client/layerctl_cli.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace layerserve::client {
namespace {

ParsedCommandLine Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "layerctl");
  return ParseLayerctlCommandLine(args, "9.8.7");
}

// The arguments of a command line that must parse.
LayerctlArgs MustParse(const std::vector<std::string>& args) {
  const ParsedCommandLine parsed = Parse(args);
  EXPECT_TRUE(parsed.args.has_value()) << parsed.err;
  EXPECT_EQ(parsed.err, "");
  return parsed.args.value_or(LayerctlArgs{});
}

// A command line that must fail with the usage status, naming `mention`.
void ExpectUsageError(const std::vector<std::string>& args, const std::string& mention) {
  const ParsedCommandLine parsed = Parse(args);
  std::string line;
  for (const std::string& arg : args) line += " " + arg;
  EXPECT_FALSE(parsed.args.has_value()) << line;
  EXPECT_EQ(parsed.exit_status, kExitUsage) << line;
  EXPECT_TRUE(absl::StrContains(parsed.err, mention)) << line << ": " << parsed.err;
  EXPECT_EQ(parsed.out, "") << line;
}

// `--version` and `version` print the version, exit 0 and run no command
// (issue 37: the first said "A subcommand is required", the second printed
// the whole help).
TEST(LayerctlCommandLineTest, VersionFlagAndCommandPrintTheVersion) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--version"}, {"version"}}) {
    const ParsedCommandLine parsed = Parse(args);
    EXPECT_EQ(parsed.out, "layerctl 9.8.7\n") << args[0];
    EXPECT_EQ(parsed.err, "") << args[0];
    EXPECT_EQ(parsed.exit_status, kExitOk) << args[0];
    EXPECT_FALSE(parsed.args.has_value()) << args[0];
  }
}

TEST(LayerctlCommandLineTest, HealthAndMetadataDefaults) {
  const LayerctlArgs health = MustParse({"health"});
  EXPECT_EQ(health.command, Command::kHealth);
  EXPECT_EQ(health.url, "localhost:8001");
  EXPECT_EQ(health.timeout_seconds, 5);

  const LayerctlArgs metadata = MustParse({"metadata", "--url", "10.0.0.1:9001"});
  EXPECT_EQ(metadata.command, Command::kMetadata);
  EXPECT_EQ(metadata.url, "10.0.0.1:9001");
  EXPECT_EQ(metadata.timeout_seconds, 10);
  EXPECT_FALSE(metadata.model.has_value());

  const LayerctlArgs with_model = MustParse({"metadata", "--model=demo", "--timeout-s=2.5"});
  EXPECT_EQ(with_model.model, "demo");
  EXPECT_EQ(with_model.timeout_seconds, 2.5);
}

TEST(LayerctlCommandLineTest, InferFlags) {
  const LayerctlArgs infer =
      MustParse({"infer", "--model", "demo", "--input", "in.npy", "--output=out.npy"});
  EXPECT_EQ(infer.command, Command::kInfer);
  EXPECT_EQ(infer.model, "demo");
  EXPECT_EQ(infer.input_path, "in.npy");
  EXPECT_EQ(infer.output_path, "out.npy");
  EXPECT_FALSE(infer.datatype.has_value()) << "the file's datatype unless one is given";
  EXPECT_EQ(infer.timeout_seconds, 60);

  const LayerctlArgs converted =
      MustParse({"infer", "--model=demo", "--input=a", "--output=b", "--datatype", "BF16"});
  EXPECT_EQ(converted.datatype, "BF16");

  for (const char* missing : {"--model", "--input", "--output"}) {
    std::vector<std::string> args = {"infer"};
    for (const char* flag : {"--model", "--input", "--output"}) {
      if (std::string(flag) != missing) args.insert(args.end(), {flag, "x"});
    }
    ExpectUsageError(args, missing);
  }
}

TEST(LayerctlCommandLineTest, InferSequenceFlags) {
  const LayerctlArgs stateless = MustParse({"infer", "--model=demo", "--input=a", "--output=b"});
  EXPECT_TRUE(IsNoSequence(stateless.infer_options.sequence_id));
  EXPECT_FALSE(stateless.infer_options.sequence_start);
  EXPECT_FALSE(stateless.infer_options.sequence_end);
  EXPECT_FALSE(stateless.infer_options.sequence_position.has_value());

  const LayerctlArgs start = MustParse({"infer", "--model=demo", "--input=a", "--output=b",
                                        "--sequence-id", "42", "--sequence-start"});
  EXPECT_EQ(start.infer_options.sequence_id, SequenceId(int64_t{42}));
  EXPECT_TRUE(start.infer_options.sequence_start);
  EXPECT_FALSE(start.infer_options.sequence_end);

  const LayerctlArgs step =
      MustParse({"infer", "--model=demo", "--input=a", "--output=b", "--sequence-id=chat-7",
                 "--sequence-end", "--sequence-position=012"});
  EXPECT_EQ(step.infer_options.sequence_id, SequenceId(std::string("chat-7")));
  EXPECT_FALSE(step.infer_options.sequence_start);
  EXPECT_TRUE(step.infer_options.sequence_end);
  EXPECT_EQ(step.infer_options.sequence_position, 12);

  const std::vector<std::string> base = {"infer", "--model=demo", "--input=a", "--output=b"};
  const auto with = [&base](std::initializer_list<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more);
    return args;
  };
  ExpectUsageError(with({"--sequence-id=1", "--sequence-position=-1"}), "--sequence-position");
  ExpectUsageError(with({"--sequence-id=1", "--sequence-position=x"}), "--sequence-position");
  // Flags that only make sense for a session need its id.
  ExpectUsageError(with({"--sequence-start"}), "--sequence-id");
  ExpectUsageError(with({"--sequence-end"}), "--sequence-id");
  ExpectUsageError(with({"--sequence-position=3"}), "--sequence-id");
}

TEST(LayerctlCommandLineTest, SequenceIdIsAnIntegerWhenItIsOne) {
  EXPECT_EQ(ParseSequenceIdFlag("42"), SequenceId(int64_t{42}));
  EXPECT_EQ(ParseSequenceIdFlag("-7"), SequenceId(int64_t{-7}));
  EXPECT_EQ(ParseSequenceIdFlag("007"), SequenceId(int64_t{7}));
  EXPECT_EQ(ParseSequenceIdFlag("0"), SequenceId(int64_t{0}));
  EXPECT_EQ(ParseSequenceIdFlag("9223372036854775807"), SequenceId(int64_t{9223372036854775807}));
  // Not an int64: a string id.
  for (const char* text : {"chat-7", "9223372036854775808", "-", "", "+5", " 5", "5 ", "1e3"}) {
    EXPECT_EQ(ParseSequenceIdFlag(text), SequenceId(std::string(text))) << text;
  }
}

TEST(LayerctlCommandLineTest, BenchDefaultsAreBenchOptions) {
  const LayerctlArgs bench = MustParse({"bench", "--model", "demo", "--tokens", "32"});
  EXPECT_EQ(bench.command, Command::kBench);
  EXPECT_EQ(bench.url, "localhost:8001");
  EXPECT_EQ(bench.connections, 1);
  EXPECT_EQ(bench.json_path, "");
  const BenchOptions defaults;
  const BenchOptions& options = bench.bench;
  EXPECT_EQ(options.model, "demo");
  EXPECT_EQ(options.tokens, 32);
  EXPECT_EQ(options.batch, defaults.batch);
  EXPECT_EQ(options.hidden, defaults.hidden);
  EXPECT_EQ(options.datatype, defaults.datatype);
  EXPECT_EQ(options.concurrency, defaults.concurrency);
  EXPECT_EQ(options.rate_per_second, defaults.rate_per_second);
  EXPECT_EQ(options.arrivals, Arrivals::kPoisson);
  EXPECT_EQ(options.duration_seconds, defaults.duration_seconds);
  EXPECT_EQ(options.warmup_seconds, defaults.warmup_seconds);
  EXPECT_EQ(options.max_in_flight, defaults.max_in_flight);
  EXPECT_EQ(options.timeout_seconds, defaults.timeout_seconds);
  EXPECT_EQ(options.seed, defaults.seed);
  EXPECT_TRUE(options.progress);
}

TEST(LayerctlCommandLineTest, BenchTakesEveryFlag) {
  // The spellings bench/server/*.sh use: --flag=value, and --flag value.
  const LayerctlArgs bench = MustParse({"bench",
                                        "--url=127.0.0.1:5000",
                                        "--model=m",
                                        "--tokens=4",
                                        "--batch",
                                        "2",
                                        "--rate",
                                        "250.5",
                                        "--arrivals=uniform",
                                        "--duration-s=3",
                                        "--warmup-s",
                                        "0.5",
                                        "--datatype=BF16",
                                        "--hidden=64",
                                        "--max-in-flight=9",
                                        "--timeout-s=7",
                                        "--seed=42",
                                        "--json",
                                        "out.json",
                                        "--no-progress",
                                        "--connections=8",
                                        "--threads=6",
                                        "--concurrency",
                                        "3"});
  const BenchOptions& options = bench.bench;
  EXPECT_EQ(bench.url, "127.0.0.1:5000");
  EXPECT_EQ(options.model, "m");
  EXPECT_EQ(options.tokens, 4);
  EXPECT_EQ(options.batch, 2);
  EXPECT_EQ(options.rate_per_second, 250.5);
  EXPECT_EQ(options.arrivals, Arrivals::kUniform);
  EXPECT_EQ(options.duration_seconds, 3);
  EXPECT_EQ(options.warmup_seconds, 0.5);
  EXPECT_EQ(options.datatype, "BF16");
  EXPECT_EQ(options.hidden, 64);
  EXPECT_EQ(options.max_in_flight, 9);
  EXPECT_EQ(options.timeout_seconds, 7);
  EXPECT_EQ(options.seed, 42u);
  EXPECT_EQ(options.concurrency, 3);
  EXPECT_FALSE(options.progress);
  EXPECT_EQ(bench.json_path, "out.json");
  EXPECT_EQ(bench.connections, 8);
  EXPECT_EQ(options.threads, 6);
  EXPECT_EQ(MustParse({"bench", "--model=m", "--tokens=1"}).bench.threads, kClosedLoopThreads);

  // A repeated flag: the last one wins.
  EXPECT_EQ(MustParse({"bench", "--model=m", "--tokens=1", "--tokens=5"}).bench.tokens, 5);
  // Leading zeros: decimal, not octal.
  EXPECT_EQ(MustParse({"bench", "--model=m", "--tokens=010"}).bench.tokens, 10);
  EXPECT_EQ(MustParse({"bench", "--model=m", "--tokens=1", "--rate=00.5"}).bench.rate_per_second,
            0.5);
}

TEST(LayerctlCommandLineTest, BenchSessions) {
  const LayerctlArgs bench =
      MustParse({"bench", "--model=m", "--sessions=16", "--prefill", "128", "--steps=64"});
  EXPECT_EQ(bench.command, Command::kBench);
  EXPECT_EQ(bench.bench.sessions, 16);
  EXPECT_EQ(bench.bench.prefill_tokens, 128);
  EXPECT_EQ(bench.bench.steps, 64);
  EXPECT_EQ(bench.bench.step_tokens, 1) << "one token per step by default";
  EXPECT_EQ(bench.bench.concurrency, 0);
  EXPECT_EQ(bench.bench.rate_per_second, 0);
  EXPECT_TRUE(bench.bench.session_id_prefix.empty()) << "random per run";
  EXPECT_FALSE(bench.bench.streaming) << "unary calls by default";

  const LayerctlArgs wide =
      MustParse({"bench", "--model=m", "--sessions=2", "--prefill=8", "--steps=0",
                 "--step-tokens=4", "--batch=3", "--connections=2", "--json=s.json"});
  EXPECT_EQ(wide.bench.steps, 0);
  EXPECT_EQ(wide.bench.step_tokens, 4);
  EXPECT_EQ(wide.bench.batch, 3);
  EXPECT_EQ(wide.connections, 2);
  EXPECT_EQ(wide.json_path, "s.json");
  EXPECT_TRUE(
      MustParse({"bench", "--model=m", "--sessions=2", "--prefill=8", "--steps=1", "--streaming"})
          .bench.streaming);

  const std::vector<std::string> base = {"bench", "--model=m", "--sessions=2", "--prefill=8",
                                         "--steps=4"};
  const auto with = [&base](std::initializer_list<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more);
    return args;
  };
  // The session load has its own shape; the request load's flags do not mix.
  for (const char* flag : {"--tokens=4", "--concurrency=2", "--rate=10", "--duration-s=3",
                           "--warmup-s=1", "--max-in-flight=9", "--arrivals=uniform"}) {
    const std::string name = std::string(flag).substr(0, std::string(flag).find('='));
    ExpectUsageError(with({flag}), name);
  }
  ExpectUsageError({"bench", "--model=m", "--sessions=2", "--steps=4"}, "--prefill");
  ExpectUsageError({"bench", "--model=m", "--sessions=2", "--prefill=4"}, "--steps");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--prefill=4"}, "--sessions");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--step-tokens=4"}, "--sessions");
  // Only sessions run over streams.
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--concurrency=2", "--streaming"},
                   "--streaming");
  ExpectUsageError(with({"--sessions=0"}), "--sessions");
  ExpectUsageError(with({"--prefill=0"}), "--prefill");
  ExpectUsageError(with({"--steps=-1"}), "--steps");
  ExpectUsageError(with({"--step-tokens=0"}), "--step-tokens");
}

TEST(LayerctlCommandLineTest, RefusesWithTheUsageStatus) {
  ExpectUsageError({"bench", "--model=m"}, "--tokens");
  ExpectUsageError({"bench", "--tokens=1"}, "--model");
  ExpectUsageError({"bench", "--model=m", "--tokens=many"}, "--tokens");
  ExpectUsageError({"bench", "--model=m", "--tokens="}, "--tokens");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--arrivals=bursty"}, "--arrivals");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--connections=0"}, "--connections");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--connections=257"}, "--connections");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--threads=0"}, "--threads");
  ExpectUsageError({"bench", "--model=m", "--tokens=1", "--rate"}, "--rate");
  ExpectUsageError({"health", "--timeout-s=soon"}, "--timeout-s");
  ExpectUsageError({"health", "--no-such-flag"}, "--no-such-flag");
  ExpectUsageError({"health", "--tokens=3"}, "--tokens");  // bench's flag, not health's
  ExpectUsageError({"health", "stray"}, "stray");
  ExpectUsageError({"frobnicate"}, "unknown command 'frobnicate'");
  ExpectUsageError({"--url=x"}, "subcommand");
}

TEST(LayerctlCommandLineTest, NoArgumentsPrintsHelpAsAnError) {
  const ParsedCommandLine parsed = Parse({});
  EXPECT_FALSE(parsed.args.has_value());
  EXPECT_EQ(parsed.exit_status, kExitUsage);
  EXPECT_TRUE(absl::StrContains(parsed.err, "bench")) << parsed.err;
}

TEST(LayerctlCommandLineTest, HelpListsEveryCommandsFlagsWithDefaults) {
  for (const char* help_flag : {"--help", "-h", "help"}) {
    const ParsedCommandLine parsed = Parse({help_flag});
    EXPECT_FALSE(parsed.args.has_value());
    EXPECT_EQ(parsed.exit_status, kExitOk);
    EXPECT_EQ(parsed.err, "");
    for (const char* text : {"health",
                             "metadata",
                             "infer",
                             "bench",
                             "--url",
                             "localhost:8001",
                             "--input",
                             "--datatype",
                             "--tokens",
                             "--concurrency",
                             "--rate",
                             "--max-in-flight",
                             "512",
                             "--connections",
                             "--threads",
                             "--no-progress",
                             "--json",
                             "poisson",
                             "--sessions",
                             "--prefill",
                             "--steps",
                             "--step-tokens",
                             "--streaming",
                             "--sequence-id",
                             "--sequence-position"}) {
      EXPECT_TRUE(absl::StrContains(parsed.out, text))
          << help_flag << ": " << text << " is missing from:\n"
          << parsed.out;
    }
  }
}

// Every command takes the connection's security flags; a client certificate
// comes with its key.
TEST(LayerctlCommandLineTest, EveryCommandTakesTheSecurityFlags) {
  const std::vector<std::string> security = {"--tls-ca-file=ca.pem", "--tls-cert-file", "c.pem",
                                             "--tls-key-file=k.pem", "--auth-token-file=token"};
  for (std::vector<std::string> command :
       std::vector<std::vector<std::string>>{{"health"},
                                             {"metadata"},
                                             {"infer", "--model=demo", "--input=i", "--output=o"},
                                             {"bench", "--model=demo", "--tokens=1"}}) {
    command.insert(command.end(), security.begin(), security.end());
    const LayerctlArgs args = MustParse(command);
    EXPECT_EQ(args.tls_ca_file, "ca.pem") << command[0];
    EXPECT_EQ(args.tls_cert_file, "c.pem") << command[0];
    EXPECT_EQ(args.tls_key_file, "k.pem") << command[0];
    EXPECT_EQ(args.auth_token_file, "token") << command[0];
    EXPECT_FALSE(args.tls) << command[0];
  }
  EXPECT_TRUE(MustParse({"health", "--tls"}).tls);
  ExpectUsageError({"health", "--tls-cert-file=c.pem"}, "--tls-key-file");
  ExpectUsageError({"metadata", "--tls-key-file=k.pem"}, "--tls-cert-file");
}

TEST(LayerctlCommandLineTest, ConnectOptionsReadTheFiles) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/ca.pem") << "-----BEGIN CERTIFICATE-----\nca\n";
  std::ofstream(dir + "/c.pem") << "-----BEGIN CERTIFICATE-----\nc\n";
  std::ofstream(dir + "/k.pem") << "-----BEGIN PRIVATE KEY-----\nk\n";
  std::ofstream(dir + "/token") << "tok\n";

  absl::StatusOr<ConnectOptions> plain = ConnectOptionsFromArgs(MustParse({"health"}));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->tls.has_value());
  EXPECT_EQ(plain->auth_token, "");

  absl::StatusOr<ConnectOptions> system_roots =
      ConnectOptionsFromArgs(MustParse({"health", "--tls"}));
  ASSERT_TRUE(system_roots.ok()) << system_roots.status();
  ASSERT_TRUE(system_roots->tls.has_value());
  EXPECT_EQ(system_roots->tls->root_certs_pem, "");

  absl::StatusOr<ConnectOptions> full = ConnectOptionsFromArgs(
      MustParse({"health", "--tls-ca-file", dir + "/ca.pem", "--tls-cert-file", dir + "/c.pem",
                 "--tls-key-file", dir + "/k.pem", "--auth-token-file", dir + "/token"}));
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_TRUE(full->tls.has_value());
  EXPECT_EQ(full->tls->root_certs_pem, "-----BEGIN CERTIFICATE-----\nca\n");
  EXPECT_EQ(full->tls->cert_chain_pem, "-----BEGIN CERTIFICATE-----\nc\n");
  EXPECT_EQ(full->tls->private_key_pem, "-----BEGIN PRIVATE KEY-----\nk\n");
  EXPECT_EQ(full->auth_token, "tok");

  // A file that cannot be read is a usage error naming the flag.
  absl::StatusOr<ConnectOptions> missing =
      ConnectOptionsFromArgs(MustParse({"health", "--auth-token-file", dir + "/none"}));
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "--auth-token-file="))
      << missing.status();
  EXPECT_EQ(ExitStatusFor(missing.status()), kExitUsage);
}

TEST(LayerctlCommandLineTest, CommandHelpListsItsOwnFlags) {
  const ParsedCommandLine bench = Parse({"bench", "--help"});
  EXPECT_EQ(bench.exit_status, kExitOk);
  EXPECT_FALSE(bench.args.has_value());
  for (const char* text : {"--tokens", "--max-in-flight", "512", "--duration-s", "10"}) {
    EXPECT_TRUE(absl::StrContains(bench.out, text)) << text << " missing:\n" << bench.out;
  }
  EXPECT_FALSE(absl::StrContains(bench.out, "--input")) << "infer's flag:\n" << bench.out;

  const ParsedCommandLine health = Parse({"health", "--help"});
  EXPECT_EQ(health.exit_status, kExitOk);
  EXPECT_TRUE(absl::StrContains(health.out, "--timeout-s")) << health.out;
  EXPECT_FALSE(absl::StrContains(health.out, "--tokens")) << health.out;
}

}  // namespace
}  // namespace layerserve::client
