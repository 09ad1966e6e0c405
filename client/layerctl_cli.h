// The command line of layerctl (client/layerctl.cc): the subcommands health,
// metadata, infer and bench, each with its own flags and defaults, parsed by
// CLI11. Parsing is a function of the arguments alone and prints nothing, so
// tests check flags, help text and exit statuses without a server.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/bench/bench.h"
#include "client/client.h"

namespace layerserve::client {

// layerctl's exit statuses.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

enum class Command { kHealth, kMetadata, kInfer, kBench };

// What one command is to do: the flags of the chosen subcommand, defaults
// filled in. Fields of other subcommands keep their defaults.
struct LayerctlArgs {
  Command command = Command::kHealth;
  std::string url = "localhost:8001";
  // Every command's connection (docs/security.md): TLS when `tls` or any
  // --tls-* file is given, with the server's CAs (empty: the system's roots)
  // and a client certificate and key for mutual TLS; a bearer token read
  // from a file (a token on the command line would show in `ps`).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string auth_token_file;
  // The call's deadline; the default depends on the command (health 5,
  // metadata 10, infer 60). bench keeps its per-request one in
  // bench.timeout_seconds.
  double timeout_seconds = 0;

  // metadata: the model whose metadata to print too, if given. infer: the
  // model to run (required).
  std::optional<std::string> model;

  // infer.
  std::string input_path;
  std::string output_path;
  std::optional<std::string> datatype;  // unset: the .npy file's own
  // --sequence-id (ParseSequenceIdFlag), --sequence-start, --sequence-end,
  // --sequence-position: the session the request is a step of.
  InferOptions infer_options;

  // bench: model, shape, load and report options go to RunBench, or to
  // RunSessionBench when bench.sessions > 0.
  BenchOptions bench;
  int connections = 1;    // TCP connections the load is spread over
  std::string json_path;  // empty: no JSON report
};

// The outcome of parsing: a command to run, or text to print and the
// status to exit with (help: stdout and kExitOk; a usage error: stderr and
// kExitUsage).
struct ParsedCommandLine {
  std::optional<LayerctlArgs> args;
  int exit_status = kExitOk;
  std::string out;  // for stdout
  std::string err;  // for stderr
};

// The value of --sequence-id: an integer id when it is one (an optional '-'
// and decimal digits that fit int64; leading zeros are dropped, as for every
// number layerctl reads), a string id otherwise. So "42" continues a session
// tritonclient started with sequence_id=42, and "chat-7" one started with
// sequence_id="chat-7"; a string id made of digits cannot be given.
SequenceId ParseSequenceIdFlag(const std::string& value);

// The connection options the security flags of `args` ask for, with the
// files they name read: INVALID_ARGUMENT naming the flag for a file that
// cannot be read or is not what the flag wants.
absl::StatusOr<ConnectOptions> ConnectOptionsFromArgs(const LayerctlArgs& args);

// Parses `argv` (argv[0] is the program's name, as main() gets it).
// `layerctl --version` and `layerctl version` print "layerctl <version>".
ParsedCommandLine ParseLayerctlCommandLine(const std::vector<std::string>& argv,
                                           std::string_view version);

// The exit status for a command's failure: kExitUsage for an error about
// layerctl's own command line (INVALID_ARGUMENT naming a --flag: every option
// check phrases its message that way), kExitFailure for anything else,
// including a server's INVALID_ARGUMENT that names one of the server's flags
// (IsCallStatus). kExitOk for OK.
int ExitStatusFor(const absl::Status& status);

}  // namespace layerserve::client
