// layerserve's command line (see server_flags.h): CLI11 with both spellings
// of every flag, and the range checks.
#include "server/server_flags.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "server/model/model.h"

namespace layerserve {
namespace {

// The names of a flag: the documented dashed spelling first, then the same
// with underscores, which the server accepted while its flags were Abseil's
// (identifiers) and which scripts still use (--grpc_port). Booleans also keep
// Abseil's negation, --noNAME.
std::string FlagNames(std::string dashed, bool boolean = false) {
  std::string underscored = dashed;
  std::replace(underscored.begin(), underscored.end(), '-', '_');
  std::string names = "--" + dashed;
  if (underscored != dashed) names += ",--" + underscored;
  if (boolean) {
    names += ",!--no" + dashed;
    if (underscored != dashed) names += ",!--no" + underscored;
  }
  return names;
}

// Checks and normalizes an integer flag's value before CLI11 converts it.
// CLI11 reads an empty value as 0 and "0500" as octal (strtoll base 0);
// Abseil refused the first and read the second as decimal 500, and so does
// this: leading zeros of a decimal number are dropped ("0x" hex stays).
std::string CheckInteger(std::string value) {
  if (value.empty()) throw CLI::ValidationError("an empty value is not a number");
  const size_t digits = (value[0] == '-' || value[0] == '+') ? 1 : 0;
  size_t first = digits;
  while (first + 1 < value.size() && value[first] == '0' &&
         std::isdigit(static_cast<unsigned char>(value[first + 1]))) {
    ++first;
  }
  value.erase(digits, first - digits);
  return value;
}

// Help lists each flag once, under its dashed name; the footer says that the
// underscore and --noNAME spellings exist.
class OneNameFormatter : public CLI::Formatter {
 public:
  std::string make_option_name(const CLI::Option* option, bool is_positional) const override {
    if (is_positional || option->get_lnames().empty()) {
      return CLI::Formatter::make_option_name(option, is_positional);
    }
    std::string name;
    for (const std::string& short_name : option->get_snames()) name += "-" + short_name + ",";
    return name + "--" + option->get_lnames().front();
  }
};

void AddFlags(CLI::App& app, ServerFlags& flags) {
  app.formatter(std::make_shared<OneNameFormatter>());
  app.get_formatter()->column_width(26);
  // Repeated flags: the last one wins, as with Abseil (tests and scripts put
  // their own --grpc-port after a default one).
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  const auto integer = [](CLI::Option* option) { option->transform(CheckInteger); };

  app.add_option(FlagNames("model-dir"), flags.model_dir,
                 "Hugging Face checkpoint directory (config.json + safetensors); empty serves "
                 "the built-in demo model");
  app.add_option(FlagNames("model-name"), flags.model_name,
                 "name clients address the model by; default: the directory's name, or \"demo\"");
  app.add_option(FlagNames("layers"), flags.layers,
                 "half-open layer range A:B to serve (\":4\", \"2:\", \":\" = all)");
  app.add_option(FlagNames("host"), flags.host, "address the gRPC and metrics servers bind");
  integer(
      app.add_option(FlagNames("grpc-port"), flags.grpc_port, "gRPC port (0 picks a free one)"));
  integer(app.add_option(FlagNames("metrics-port"), flags.metrics_port,
                         "Prometheus /metrics HTTP port (0 picks a free one)"));
  app.add_option(FlagNames("backend"), flags.backend, "compute backend: auto, cpu or cuda");
  integer(app.add_option(FlagNames("max-batch-tokens"), flags.max_batch_tokens,
                         "most tokens (sum of B*T) in one batch; also the per-request limit"));
  integer(app.add_option(FlagNames("max-queue-delay-us"), flags.max_queue_delay_us,
                         "longest time the oldest queued request waits for a batch to fill, "
                         "while the device is busy (an idle device runs a batch at once)"));
  app.add_flag(FlagNames("batch-delay-when-idle", /*boolean=*/true), flags.batch_delay_when_idle,
               "wait for --max-queue-delay-us even when the device is idle, as Triton's dynamic "
               "batcher does: larger batches at moderate load for up to the delay of latency");
  integer(app.add_option(FlagNames("max-device-wait-us"), flags.max_device_wait_us,
                         "just-in-time batches: longest time the oldest queued request waits for "
                         "the running batch to end rather than compute beside it (0: off)"));
  integer(app.add_option(FlagNames("device-lead-us"), flags.device_lead_us,
                         "just-in-time batches: form the next batch this long before the running "
                         "one is predicted to end, so its copies and launches overlap it"));
  integer(
      app.add_option(FlagNames("max-queue-size"), flags.max_queue_size,
                     "most requests waiting; beyond it ModelInfer fails with RESOURCE_EXHAUSTED"));
  integer(app.add_option(
      FlagNames("max-queue-bytes"), flags.max_queue_bytes,
      "most input bytes the waiting requests may hold together (an empty queue takes any legal "
      "request); beyond it RESOURCE_EXHAUSTED. 0: 8 full batches of FP32 tokens, at least 64 MiB"));
  integer(app.add_option(FlagNames("cpu-threads"), flags.cpu_threads,
                         "CPU backend threads (0 = all cores)"));
  integer(app.add_option(
      FlagNames("grpc-max-connection-age-s"), flags.grpc_max_connection_age_s,
      "close each gRPC connection (GOAWAY, then --drain-timeout-s for calls in flight) after this "
      "many seconds, so clients reconnect and spread over new replicas; 0: never"));
  integer(app.add_option(FlagNames("grpc-max-connection-idle-s"), flags.grpc_max_connection_idle_s,
                         "close a gRPC connection that has had no call for this many seconds "
                         "(clients reconnect at their next call); 0: never"));
  integer(app.add_option(FlagNames("grpc-max-concurrent-streams"),
                         flags.grpc_max_concurrent_streams,
                         "most calls one gRPC connection may hold open at once (HTTP/2 "
                         "SETTINGS_MAX_CONCURRENT_STREAMS; clients queue the rest); 0: no limit"));
  integer(app.add_option(FlagNames("grpc-threads"), flags.grpc_threads,
                         "threads receiving gRPC calls and running their handlers, each polling "
                         "its own completion queue; 0: a quarter of the cores, 2 to 8"));
  integer(app.add_option(FlagNames("reply-threads"), flags.reply_threads,
                         "threads answering the requests of finished batches (each reply costs "
                         "tens of microseconds, so a batch of a hundred waits for many; more "
                         "threads shorten that wait but take cores from gRPC and clients)"));
  integer(app.add_option(FlagNames("drain-timeout-s"), flags.drain_timeout_s,
                         "on SIGTERM/SIGINT, how long queued and open calls may take to finish"));
  integer(app.add_option(
      FlagNames("drain-sessions-timeout-s"), flags.drain_sessions_timeout_s,
      "on SIGTERM/SIGINT, how long open sessions may go on stepping (no new session is opened) "
      "before the rest are dropped, before --drain-timeout-s begins; 0: drop them at once"));
  app.add_option(FlagNames("log-format"), flags.log_format,
                 "stderr log lines: text (UTC time, level, message) or json (one object per "
                 "line: time, level, logger, msg)");

  const std::string sessions = "Sessions (server-side KV cache)";
  app.add_option(FlagNames("kv-cache-memory"), flags.kv_cache_memory,
                 "memory of the KV cache pool: bytes (\"4GiB\", \"512M\"), a fraction of what the "
                 "backend has free (\"0.5\"), auto (CUDA: 0.9 of the device memory free after "
                 "loading; CPU: 0.25 of available memory), or 0 (no "
                 "sessions)")
      ->group(sessions);
  integer(app.add_option(FlagNames("kv-block-tokens"), flags.kv_block_tokens,
                         "tokens per KV cache block (the paging granularity)")
              ->group(sessions));
  app.add_option(FlagNames("kv-cache-dtype"), flags.kv_cache_dtype,
                 "what the KV cache stores: auto (the activation dtype) or fp8 (e4m3 codes "
                 "with a scale per token and KV head: about half the bytes of bf16, so twice "
                 "the tokens; fp8_e4m3 is the same)")
      ->group(sessions);
  integer(app.add_option(FlagNames("max-sessions"), flags.max_sessions,
                         "most sessions open at once; one more is RESOURCE_EXHAUSTED")
              ->group(sessions));
  integer(app.add_option(FlagNames("max-session-tokens"), flags.max_session_tokens,
                         "most tokens one session may hold (B x length); 0: no limit beyond the "
                         "pool")
              ->group(sessions));
  integer(app.add_option(FlagNames("prefill-chunk-tokens"), flags.prefill_chunk_tokens,
                         "most tokens (B x T) of one session request computed in one batch; a "
                         "longer one runs in pieces, so it never fills a batch that other "
                         "sessions' decode steps wait for; 0: --max-batch-tokens")
              ->group(sessions));
  integer(app.add_option(FlagNames("session-idle-timeout-s"), flags.session_idle_timeout_s,
                         "free a session unused for this long (a later request gets NOT_FOUND "
                         "\"expired\"); 0: never")
              ->group(sessions));

  const std::string cuda = "CUDA backend";
  integer(app.add_option(FlagNames("streams"), flags.streams,
                         "CUDA streams, i.e. batches in flight at once")
              ->group(cuda));
  integer(
      app.add_option(FlagNames("cuda-device"), flags.cuda_device, "device ordinal")->group(cuda));
  integer(app.add_option(FlagNames("cuda-graph-max-tokens"), flags.cuda_graph_max_tokens,
                         "batches of up to this many tokens that start while no other batch "
                         "computes run as CUDA graphs, captured per batch shape on its second "
                         "such batch and replayed after; 0: never")
              ->group(cuda));
  app.add_flag(FlagNames("cuda-warmup", /*boolean=*/true), flags.cuda_warmup,
               "before serving, run a batch of zeros of every size up to 256 tokens, one per "
               "GEMM token-count bucket above, and one session step, so that no request waits "
               "for a kernel to load or a GEMM shape to be planned (default true)")
      ->group(cuda);
  app.add_option(FlagNames("cuda-wait"), flags.cuda_wait,
                 "how a stream's thread waits for its batch: spin (the quickest wake-up, a core "
                 "busy meanwhile) or block (the driver wakes it; the core is free for gRPC)")
      ->check(CLI::IsMember({"spin", "block"}))
      ->group(cuda);
  app.add_option(FlagNames("gemm"), flags.gemm,
                 "GEMMs: auto (per shape, the project's kernels where measured faster), "
                 "cublaslt, or custom (the project's kernels wherever they apply)")
      ->group(cuda);
  app.add_flag(FlagNames("gemm-autotune", /*boolean=*/true), flags.gemm_autotune,
               "--gemm=auto: time our GEMM kernels against cuBLASLt for the model's shapes at "
               "load (3.5 s for a Llama-3-8B layer on an H100) and use the faster per "
               "token-count bucket (default true); =false: built-in defaults")
      ->group(cuda);
  app.add_option(FlagNames("gemm-tune-cache"), flags.gemm_tune_cache,
                 "--gemm=auto: JSON file keeping the autotune results between starts (read if "
                 "it matches this device, driver and version; written after tuning)")
      ->group(cuda);
  app.add_option(FlagNames("gemm-override"), flags.gemm_override,
                 "--gemm=auto: pin choices, M:NxK=CONFIG[,...] with CONFIG one of v0 "
                 "(cuBLASLt), v0a1..v0a7 (its heuristic's answer of that rank), v3, v3b128, "
                 "v3b256, v4, v4s1..v4s8, v5; M:NxK/fp8=v0|v6|v6s1..v6s8 for an FP8 weight; "
                 "e.g. 16:6144x4096=v0")
      ->group(cuda);

  const std::string security = "Security (docs/security.md)";
  CLI::Option* tls_cert =
      app.add_option(FlagNames("tls-cert-file"), flags.tls_cert_file,
                     "PEM certificate chain: the gRPC port speaks TLS only (with --tls-key-file)")
          ->group(security);
  CLI::Option* tls_key = app.add_option(FlagNames("tls-key-file"), flags.tls_key_file,
                                        "PEM private key (unencrypted) of --tls-cert-file")
                             ->group(security);
  app.add_option(FlagNames("tls-client-ca-file"), flags.tls_client_ca_file,
                 "PEM CA certificates: every connection must present a client certificate they "
                 "signed (mutual TLS)")
      ->group(security)
      ->needs(tls_cert);
  tls_cert->needs(tls_key);
  tls_key->needs(tls_cert);
  app.add_flag(FlagNames("metrics-tls", /*boolean=*/true), flags.metrics_tls,
               "serve /metrics over HTTPS with --tls-cert-file's certificate (and "
               "--tls-client-ca-file's CAs)")
      ->group(security);
  CLI::Option* token =
      app.add_option(FlagNames("auth-token-file"), flags.auth_token_file,
                     "file holding a bearer token that every call needs ('authorization: Bearer "
                     "<token>'), except what --auth-open names; others are UNAUTHENTICATED")
          ->group(security);
  app.add_option(FlagNames("auth-open"), flags.auth_open,
                 "with --auth-token-file, what stays open without the token: health, live, "
                 "ready, metadata, statistics, metrics (comma-separated), or none")
      ->group(security)
      ->needs(token);
}

// Parses the command line into `flags`. Returns the exit status when the
// process should end at once: 0 after --help or --version (printed on
// stdout), 1 for a command line that does not parse (one line on stderr,
// the status Abseil's flags exited with).

}  // namespace

std::optional<int> ParseCommandLine(int argc, char** argv, std::string_view version,
                                    ServerFlags& flags) {
  CLI::App app(
      "Serves a span of Llama decoder layers over gRPC (Open Inference Protocol), with "
      "Prometheus metrics.",
      "layerserve");
  app.footer(
      "Flags take --flag=value or --flag value, and may also be spelled with underscores "
      "(--grpc_port); booleans take =true or =false, or --noNAME.");
  app.set_version_flag("--version", absl::StrCat("layerserve ", std::string(version)),
                       "print the version and exit");
  AddFlags(app, flags);
  // "--model-dir=" sets the empty string, as with Abseil; CLI11 would take
  // the next argument as the value instead, so it gets the empty value as an
  // argument of its own. "--gemm-autotune=" would be true to CLI11; Abseil
  // refused it, and so does this.
  std::vector<std::string> args;
  for (int i = argc - 1; i >= 1; --i) {  // CLI11 takes the arguments last first
    const std::string arg = argv[i];
    const std::string name = arg.substr(0, arg.size() - 1);
    const CLI::Option* option = app.get_option_no_throw(name);
    if (!arg.starts_with("--") || arg.find('=') != name.size() || option == nullptr) {
      args.push_back(arg);
    } else if (option->get_items_expected_max() > 0) {
      args.push_back("");
      args.push_back(name);
    } else {
      LogError(absl::StrCat(arg, " needs a value, true or false"));
      return 1;
    }
  }
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    LogError(absl::StrCat(e.what(), " (layerserve --help lists the flags)"));
    return 1;
  }
  return std::nullopt;
}

absl::Status CheckFlags(const ServerFlags& flags) {
  if (flags.max_batch_tokens <= 0) {
    return absl::InvalidArgumentError("--max-batch-tokens must be >= 1");
  }
  if (flags.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError("--max-queue-delay-us must be >= 0");
  }
  if (flags.max_device_wait_us < 0 || flags.device_lead_us < 0) {
    return absl::InvalidArgumentError("--max-device-wait-us and --device-lead-us must be >= 0");
  }
  if (flags.max_queue_size <= 0 || flags.max_queue_size > int64_t{UINT32_MAX}) {
    return absl::InvalidArgumentError("--max-queue-size must be in [1, 4294967295]");
  }
  if (flags.max_queue_bytes < 0) {
    return absl::InvalidArgumentError("--max-queue-bytes must be >= 0 (0: the default)");
  }
  for (const int port : {flags.grpc_port, flags.metrics_port}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("port ", port, " is outside [0, 65535]"));
    }
  }
  if (flags.streams < 1) {
    return absl::InvalidArgumentError("--streams must be >= 1");
  }
  if (flags.cuda_graph_max_tokens < 0) {
    return absl::InvalidArgumentError("--cuda-graph-max-tokens must be >= 0");
  }
  if (flags.cpu_threads < 0) {
    return absl::InvalidArgumentError("--cpu-threads must be >= 0");
  }
  if (flags.grpc_max_connection_age_s < 0 || flags.grpc_max_connection_age_s > INT32_MAX / 1000) {
    return absl::InvalidArgumentError("--grpc-max-connection-age-s must be in [0, 2147483]");
  }
  if (flags.grpc_threads < 0 || flags.grpc_threads > 64) {
    return absl::InvalidArgumentError("--grpc-threads must be in [0, 64]");
  }
  if (flags.reply_threads < 1 || flags.reply_threads > 64) {
    return absl::InvalidArgumentError("--reply-threads must be in [1, 64]");
  }
  if (flags.grpc_max_connection_idle_s < 0 || flags.grpc_max_connection_idle_s > INT32_MAX / 1000) {
    return absl::InvalidArgumentError("--grpc-max-connection-idle-s must be in [0, 2147483]");
  }
  if (flags.grpc_max_concurrent_streams < 0 || flags.grpc_max_concurrent_streams > INT32_MAX) {
    return absl::InvalidArgumentError("--grpc-max-concurrent-streams must be in [0, 2147483647]");
  }
  if (flags.drain_timeout_s < 0) {
    return absl::InvalidArgumentError("--drain-timeout-s must be >= 0");
  }
  if (flags.drain_sessions_timeout_s < 0) {
    return absl::InvalidArgumentError("--drain-sessions-timeout-s must be >= 0");
  }
  // The range's syntax before any port is bound or the load is logged; that
  // it lies inside the model is known only once config.json is read.
  if (const absl::StatusOr<LayerRange> range = ParseLayerRange(flags.layers); !range.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layers=", flags.layers, ": ", range.status().message()));
  }
  if (flags.kv_block_tokens < 1 || flags.kv_block_tokens > 65536) {
    return absl::InvalidArgumentError("--kv-block-tokens must be in [1, 65536]");
  }
  if (const absl::StatusOr<KvCacheDType> dtype = ParseKvCacheDType(flags.kv_cache_dtype);
      !dtype.ok()) {
    return dtype.status();
  }
  if (flags.max_sessions < 1) {
    return absl::InvalidArgumentError("--max-sessions must be >= 1");
  }
  if (flags.prefill_chunk_tokens < 0) {
    return absl::InvalidArgumentError(
        "--prefill-chunk-tokens must be >= 0 (0: --max-batch-tokens)");
  }
  if (flags.max_session_tokens < 0) {
    return absl::InvalidArgumentError("--max-session-tokens must be >= 0 (0: no limit)");
  }
  if (flags.session_idle_timeout_s < 0 || flags.session_idle_timeout_s > int64_t{1} << 32) {
    return absl::InvalidArgumentError(
        "--session-idle-timeout-s must be in [0, 4294967296] (0: never)");
  }
  if (!ParseLogFormat(flags.log_format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--log-format=", flags.log_format, " is not one of text, json"));
  }
  return KvCacheBytes(flags.kv_cache_memory, 0, 0).status();
}

absl::StatusOr<int64_t> KvCacheBytes(std::string_view flag, int64_t available,
                                     double auto_fraction) {
  const std::string value(flag);
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-memory=", value,
        " is not 0, auto, a byte count (4GiB, 512M, 1073741824) or a fraction in (0, 1] (0.5)"));
  };
  const auto share = [&](double fraction) {
    return static_cast<int64_t>(static_cast<double>(std::max<int64_t>(available, 0)) * fraction);
  };
  if (value == "auto") return share(auto_fraction);
  if (value.find('.') != std::string::npos) {
    double fraction = 0;
    if (!absl::SimpleAtod(value, &fraction) || !(fraction > 0 && fraction <= 1)) return bad();
    return share(fraction);
  }
  size_t digits = 0;
  while (digits < value.size() && std::isdigit(static_cast<unsigned char>(value[digits]))) {
    ++digits;
  }
  uint64_t number = 0;
  if (digits == 0 || !absl::SimpleAtoi(value.substr(0, digits), &number)) return bad();
  std::string unit = absl::AsciiStrToUpper(value.substr(digits));
  if (unit.ends_with("IB")) {
    unit.resize(unit.size() - 2);
  } else if (unit.size() > 1 && unit.ends_with("B")) {
    unit.resize(unit.size() - 1);
  }
  int shift = 0;
  if (unit == "K") {
    shift = 10;
  } else if (unit == "M") {
    shift = 20;
  } else if (unit == "G") {
    shift = 30;
  } else if (unit == "T") {
    shift = 40;
  } else if (!unit.empty() && unit != "B") {
    return bad();
  }
  if (number > (uint64_t{INT64_MAX} >> shift)) return bad();
  return static_cast<int64_t>(number << shift);
}

KvCacheDType KvCacheDTypeOf(const ServerFlags& flags) {
  return ParseKvCacheDType(flags.kv_cache_dtype).value_or(KvCacheDType::kActivation);
}

}  // namespace layerserve
