// ParseLayerctlCommandLine (see layerctl_cli.h): one CLI11 subcommand per
// layerctl command. The flag names and defaults are those of the hand-written
// parser this replaced, so scripts (bench/server/*.sh, the Dockerfile's
// HEALTHCHECK) keep working.
#include "client/layerctl_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "client/client.h"

namespace layerserve::client {
namespace {

// Checks and normalizes a number before CLI11 converts it. CLI11 reads an
// empty value ("--seed=") as 0 and "010" as octal (strtoll base 0); the
// parser before it refused the first and read the second as decimal 10, and
// so does this: leading zeros are dropped ("0x" hex and "0.5" stay).
CLI::Validator Number() {
  return CLI::Validator(
      [](std::string& value) {
        if (value.empty()) return std::string("an empty value is not a number");
        const size_t sign = (value[0] == '-' || value[0] == '+') ? 1 : 0;
        size_t first = sign;
        while (first + 1 < value.size() && value[first] == '0' &&
               std::isdigit(static_cast<unsigned char>(value[first + 1]))) {
          ++first;
        }
        value.erase(sign, first - sign);
        return std::string();
      },
      "", "number");
}

// The flags of every command: repeated flags take the last value, and help
// shows each default.
void SetOptionDefaults(CLI::App& app) {
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.get_formatter()->column_width(30);
}

}  // namespace

SequenceId ParseSequenceIdFlag(const std::string& value) {
  const size_t digits = (!value.empty() && value[0] == '-') ? 1 : 0;
  const bool integer = value.size() > digits &&
                       std::all_of(value.begin() + static_cast<std::ptrdiff_t>(digits), value.end(),
                                   [](char c) { return c >= '0' && c <= '9'; });
  int64_t parsed = 0;
  if (integer && absl::SimpleAtoi(value, &parsed)) return parsed;
  return value;
}

ParsedCommandLine ParseLayerctlCommandLine(const std::vector<std::string>& argv,
                                           std::string_view version) {
  LayerctlArgs args;
  CLI::App app("Command-line client of layerserve (Open Inference Protocol over gRPC).",
               "layerctl");
  SetOptionDefaults(app);  // before the subcommands, which copy the defaults
  const std::string version_line = "layerctl " + std::string(version);
  app.set_version_flag("--version", version_line, "Prints layerctl's version.");
  app.require_subcommand(1);
  app.footer("Exit status: 0 success, 1 failure, 2 usage error.");

  // The connection's flags, on every command.
  const auto add_url = [&args](CLI::App* command) {
    command->add_option("--url", args.url, "server address, host:port");
    const std::string security = "Connection security";
    command->add_flag("--tls", args.tls, "use TLS (implied by --tls-ca-file and --tls-cert-file)")
        ->group(security);
    command
        ->add_option("--tls-ca-file", args.tls_ca_file,
                     "PEM CA certificates the server's certificate must chain to (default: the "
                     "system's)")
        ->group(security);
    CLI::Option* cert =
        command
            ->add_option("--tls-cert-file", args.tls_cert_file,
                         "PEM client certificate, for a server that requires one (mutual TLS)")
            ->group(security);
    CLI::Option* key =
        command->add_option("--tls-key-file", args.tls_key_file, "PEM key of --tls-cert-file")
            ->group(security);
    cert->needs(key);
    key->needs(cert);
    command
        ->add_option("--auth-token-file", args.auth_token_file,
                     "file holding the bearer token the server wants (sent as 'authorization: "
                     "Bearer <token>')")
        ->group(security);
  };
  const auto add_number = [](CLI::App* command, const std::string& name, auto& value,
                             const std::string& description) {
    return command->add_option(name, value, description)->transform(Number());
  };

  CLI::App* health = app.add_subcommand(
      "health", "Checks grpc.health.v1; prints the status; exit 0 only if SERVING.");
  double health_timeout_s = 5;
  add_url(health);
  add_number(health, "--timeout-s", health_timeout_s, "deadline of the call, seconds");

  CLI::App* metadata = app.add_subcommand(
      "metadata", "Prints server metadata and a model's (--model; default: the one served).");
  double metadata_timeout_s = 10;
  std::string metadata_model;
  add_url(metadata);
  CLI::Option* metadata_model_flag = metadata->add_option(
      "--model", metadata_model, "model whose metadata to print (default: the one served)");
  add_number(metadata, "--timeout-s", metadata_timeout_s, "deadline of the calls, seconds");

  CLI::App* infer = app.add_subcommand(
      "infer",
      "Sends a .npy array as tensor \"hidden_states\" [B, T, hidden] and writes the reply as "
      ".npy. The datatype defaults to the file's: <f4 FP32, <f2 FP16, <u2 BF16 (bf16 bit "
      "patterns); with --datatype the values are converted. The output is written in the "
      "reply's datatype with the same conventions.");
  double infer_timeout_s = 60;
  std::string infer_model, infer_datatype;
  add_url(infer);
  infer->add_option("--model", infer_model, "model to run")->required();
  infer->add_option("--input", args.input_path, "input .npy file")->required();
  infer->add_option("--output", args.output_path, "output .npy file")->required();
  CLI::Option* infer_datatype_flag = infer->add_option(
      "--datatype", infer_datatype, "BF16, FP16 or FP32 on the wire (default: the file's)");
  add_number(infer, "--timeout-s", infer_timeout_s, "deadline of the call, seconds");
  std::string sequence_id;
  int64_t sequence_position = 0;
  CLI::Option* sequence_id_flag = infer->add_option(
      "--sequence-id", sequence_id,
      "session (server-side KV cache) the request is a step of: an integer, or else a string");
  infer->add_flag("--sequence-start", args.infer_options.sequence_start,
                  "open the session (or reset it) with this request");
  infer->add_flag("--sequence-end", args.infer_options.sequence_end,
                  "free the session after this request");
  CLI::Option* sequence_position_flag =
      add_number(infer, "--sequence-position", sequence_position,
                 "position of the first token (below the session's length: roll back)")
          ->check(CLI::NonNegativeNumber)
          ->default_str("");  // unset: append
  for (CLI::Option* flag : {infer->get_option("--sequence-start"),
                            infer->get_option("--sequence-end"), sequence_position_flag}) {
    flag->needs(sequence_id_flag);
  }

  CLI::App* bench = app.add_subcommand(
      "bench",
      "Random inputs. Closed loop (--concurrency C): C requests in flight, each answered one "
      "followed at once by the next. "
      "Open loop (--rate R): R requests/s whatever the latency; arrivals beyond "
      "--max-in-flight outstanding requests are skipped and reported. Sessions (--sessions N "
      "--prefill P --steps S): N sessions at once, each a prefill of P tokens with "
      "sequence_start, then S steps of --step-tokens tokens, the last with sequence_end; "
      "reports prefill and step latencies and decode tokens/s; with --streaming each session's "
      "requests go over its own ModelStreamInfer stream. --connections spreads "
      "the load over N TCP connections, as N client processes would.");
  BenchOptions& options = args.bench;
  std::string arrivals = "poisson";
  bool no_progress = false;
  add_url(bench);
  bench->add_option("--model", options.model, "model to load")->required();
  CLI::Option* tokens_flag =
      add_number(bench, "--tokens", options.tokens, "tokens T per sequence (required)")
          ->default_str("");  // required unless --sessions: no default to show
  add_number(bench, "--batch", options.batch, "sequences B per request");
  CLI::Option* concurrency_flag =
      add_number(bench, "--concurrency", options.concurrency, "closed loop: requests in flight");
  CLI::Option* rate_flag =
      add_number(bench, "--rate", options.rate_per_second, "open loop: requests per second");
  CLI::Option* arrivals_flag =
      bench->add_option("--arrivals", arrivals, "open loop: arrival process")
          ->check(CLI::IsMember({"poisson", "uniform"}));
  CLI::Option* duration_flag =
      add_number(bench, "--duration-s", options.duration_seconds, "measured time, seconds");
  CLI::Option* warmup_flag =
      add_number(bench, "--warmup-s", options.warmup_seconds,
                 "time before the measurement, seconds (sent, not recorded)");
  CLI::Option* requests_flag =
      add_number(bench, "--requests", options.requests,
                 "closed loop: stop after this many requests (or --duration-s); 0: no limit")
          ->check(CLI::NonNegativeNumber);
  bench->add_option("--datatype", options.datatype, "FP32, FP16 or BF16 on the wire");
  add_number(bench, "--hidden", options.hidden, "hidden size; 0: from the model's metadata");
  CLI::Option* max_in_flight_flag =
      add_number(bench, "--max-in-flight", options.max_in_flight,
                 "open loop: outstanding requests beyond which arrivals are skipped");
  add_number(bench, "--timeout-s", options.timeout_seconds, "deadline of each request, seconds");
  add_number(bench, "--seed", options.seed, "seed of the random inputs and arrivals");
  bench->add_option("--json", args.json_path, "also write the report to this JSON file");
  bench->add_flag("--no-progress", no_progress, "no progress line on stderr");
  add_number(bench, "--connections", args.connections, "TCP connections")
      ->check(CLI::Range(1, 256));
  add_number(bench, "--threads", options.threads,
             "closed loops (and unary sessions): client threads, each polling its own "
             "completion queue")
      ->check(CLI::Range(1, 256));
  CLI::Option* sessions_flag =
      add_number(bench, "--sessions", options.sessions, "sessions: how many run at once")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
          ->default_str("");
  CLI::Option* prefill_flag =
      add_number(bench, "--prefill", options.prefill_tokens, "sessions: prefill tokens P")
          ->check(CLI::PositiveNumber)
          ->default_str("");
  CLI::Option* steps_flag =
      add_number(bench, "--steps", options.steps, "sessions: decode steps S after the prefill")
          ->check(CLI::NonNegativeNumber)
          ->default_str("");
  CLI::Option* step_tokens_flag =
      add_number(bench, "--step-tokens", options.step_tokens, "sessions: tokens K per step")
          ->check(CLI::PositiveNumber);
  CLI::Option* streaming_flag = bench->add_flag(
      "--streaming", options.streaming,
      "sessions: each session over its own ModelStreamInfer stream, not unary calls");
  // The session load is shaped by its own flags; the request load's do not
  // apply to it.
  sessions_flag->needs(prefill_flag)->needs(steps_flag);
  for (CLI::Option* flag : {prefill_flag, steps_flag, step_tokens_flag, streaming_flag}) {
    flag->needs(sessions_flag);
  }
  requests_flag->needs(concurrency_flag);
  for (CLI::Option* flag : {tokens_flag, concurrency_flag, rate_flag, arrivals_flag, duration_flag,
                            warmup_flag, max_in_flight_flag, requests_flag}) {
    sessions_flag->excludes(flag);
  }

  CLI::App* help = app.add_subcommand("help", "Prints this text.")->allow_extras();
  CLI::App* version_command = app.add_subcommand("version", "Prints layerctl's version.");

  ParsedCommandLine parsed;
  const std::string full_help = app.help("", CLI::AppFormatMode::All);
  if (argv.size() < 2) {
    parsed.exit_status = kExitUsage;
    parsed.err = full_help;
    return parsed;
  }
  const auto is_command = [&app](const std::string& name) {
    return !app.get_subcommands([&name](CLI::App* command) { return command->check_name(name); })
                .empty();
  };
  if (argv[1].empty() || (argv[1][0] != '-' && !is_command(argv[1]))) {
    parsed.exit_status = kExitUsage;
    parsed.err = "layerctl: unknown command '" + argv[1] + "'\n\n" + full_help;
    return parsed;
  }
  // CLI11 takes the arguments last first, without the program's name.
  std::vector<std::string> reversed(argv.rbegin(), argv.rend() - 1);
  try {
    app.parse(reversed);
  } catch (const CLI::CallForVersion&) {
    parsed.out = version_line + "\n";
    return parsed;
  } catch (const CLI::ParseError& e) {
    const std::vector<CLI::App*> commands = app.get_subcommands();
    const std::string command = commands.empty() ? "" : " " + commands.front()->get_name();
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      // --help: the whole text at the top, the command's own after one.
      parsed.out = command.empty() ? full_help : app.help("", CLI::AppFormatMode::Normal);
      return parsed;
    }
    parsed.exit_status = kExitUsage;
    parsed.err =
        "layerctl: " + std::string(e.what()) + "\nrun 'layerctl" + command + " --help' for usage\n";
    return parsed;
  }

  if (help->parsed()) {
    parsed.out = full_help;
    return parsed;
  }
  if (version_command->parsed()) {
    parsed.out = version_line + "\n";
    return parsed;
  }
  if (health->parsed()) {
    args.command = Command::kHealth;
    args.timeout_seconds = health_timeout_s;
  } else if (metadata->parsed()) {
    args.command = Command::kMetadata;
    args.timeout_seconds = metadata_timeout_s;
    if (metadata_model_flag->count() > 0) args.model = metadata_model;
  } else if (infer->parsed()) {
    args.command = Command::kInfer;
    args.timeout_seconds = infer_timeout_s;
    args.model = infer_model;
    if (infer_datatype_flag->count() > 0) args.datatype = infer_datatype;
    if (sequence_id_flag->count() > 0) {
      args.infer_options.sequence_id = ParseSequenceIdFlag(sequence_id);
    }
    if (sequence_position_flag->count() > 0) {
      args.infer_options.sequence_position = sequence_position;
    }
  } else {
    if (tokens_flag->count() == 0 && sessions_flag->count() == 0) {
      parsed.exit_status = kExitUsage;
      parsed.err =
          "layerctl: --tokens is required (or --sessions N --prefill P --steps S for the "
          "session load)\nrun 'layerctl bench --help' for usage\n";
      return parsed;
    }
    args.command = Command::kBench;
    options.arrivals = arrivals == "uniform" ? Arrivals::kUniform : Arrivals::kPoisson;
    options.progress = !no_progress;
  }
  parsed.args = std::move(args);
  return parsed;
}

absl::StatusOr<ConnectOptions> ConnectOptionsFromArgs(const LayerctlArgs& args) {
  ConnectOptions options;
  if (args.tls || !args.tls_ca_file.empty() || !args.tls_cert_file.empty()) {
    TlsOptions& tls = options.tls.emplace();
    if (!args.tls_ca_file.empty()) {
      absl::StatusOr<std::string> pem = ReadPemFile(args.tls_ca_file, "--tls-ca-file");
      if (!pem.ok()) return pem.status();
      tls.root_certs_pem = *std::move(pem);
    }
    if (!args.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadPemFile(args.tls_cert_file, "--tls-cert-file");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPemFile(args.tls_key_file, "--tls-key-file");
      if (!key.ok()) return key.status();
      tls.cert_chain_pem = *std::move(cert);
      tls.private_key_pem = *std::move(key);
    }
  }
  if (!args.auth_token_file.empty()) {
    absl::StatusOr<std::string> token =
        ReadAuthTokenFile(args.auth_token_file, "--auth-token-file");
    if (!token.ok()) return token.status();
    options.auth_token = *std::move(token);
  }
  return options;
}

int ExitStatusFor(const absl::Status& status) {
  if (status.ok()) return kExitOk;
  const bool usage = absl::IsInvalidArgument(status) && !IsCallStatus(status) &&
                     absl::StrContains(status.message(), "--");
  return usage ? kExitUsage : kExitFailure;
}

}  // namespace layerserve::client
