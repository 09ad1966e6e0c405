// layerctl: command-line client for layerserve.
//
//   layerctl health    exit status 0 iff the server reports SERVING (Docker HEALTHCHECK)
//   layerctl metadata  server and model metadata
//   layerctl infer     run a .npy file through the model, write the result as .npy
//   layerctl bench     closed- or open-loop load with a latency/throughput report, or
//                      sessions (prefill, then decode steps through the KV cache)
//
// The command line (layerctl_cli.h) gives each subcommand its own flags;
// `layerctl --help` lists them all. Exit status: 0 success, 1 failure, 2 usage.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/bench/bench.h"
#include "client/bench/session_bench.h"
#include "client/client.h"
#include "client/layerctl_cli.h"
#include "client/npy.h"

namespace layerserve::client {
namespace {

// Prints the error. Errors about the command line (ExitStatusFor) exit with
// the usage status and a pointer to the help text.
int Fail(const absl::Status& status) {
  std::fprintf(stderr, "layerctl: %s\n",
               std::string(status.ToString(absl::StatusToStringMode::kWithNoExtraData)).c_str());
  const int exit_status = ExitStatusFor(status);
  if (exit_status == kExitUsage) std::fputs("run 'layerctl --help' for usage\n", stderr);
  return exit_status;
}

absl::Time Deadline(const LayerctlArgs& args) {
  return absl::Now() + absl::Seconds(args.timeout_seconds);
}

// A client of args.url with the connection's security flags applied.
absl::StatusOr<std::unique_ptr<Client>> Connect(const LayerctlArgs& args,
                                                bool dedicated_connection = false) {
  absl::StatusOr<ConnectOptions> options = ConnectOptionsFromArgs(args);
  if (!options.ok()) return options.status();
  options->dedicated_connection = dedicated_connection;
  return Client::Connect(args.url, *options);
}

int Health(const LayerctlArgs& args) {
  const absl::Time deadline = Deadline(args);
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(args);
  if (!client.ok()) return Fail(client.status());
  auto status = (*client)->Health(deadline);
  if (!status.ok()) {
    std::printf("UNREACHABLE: %s\n", std::string(status.status().ToString()).c_str());
    return kExitFailure;
  }
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitFailure;
}

std::string FormatShape(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int Metadata(const LayerctlArgs& args) {
  const absl::Time deadline = Deadline(args);
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(args);
  if (!client.ok()) return Fail(client.status());
  auto server = (*client)->ServerMetadata(deadline);
  if (!server.ok()) return Fail(server.status());
  std::printf("server:     %s %s\nextensions: %s\n", server->name().c_str(),
              server->version().c_str(), absl::StrJoin(server->extensions(), ", ").c_str());
  // Without --model: the model the server serves (its repository index).
  std::string model_name = args.model.value_or("");
  if (!args.model) {
    auto index = (*client)->RepositoryIndex(deadline);
    if (!index.ok()) return Fail(index.status());
    for (const auto& entry : index->models()) {
      std::printf("serves:     %s (version %s, %s%s%s)\n", entry.name().c_str(),
                  entry.version().c_str(), entry.state().c_str(),
                  entry.reason().empty() ? "" : ": ", entry.reason().c_str());
    }
    if (index->models_size() != 1) return kExitOk;
    model_name = index->models(0).name();
  }
  auto model = (*client)->ModelMetadata(model_name, deadline);
  if (!model.ok()) return Fail(model.status());
  std::printf("model:      %s (versions: %s, platform: %s)\n", model->name().c_str(),
              absl::StrJoin(model->versions(), ", ").c_str(), model->platform().c_str());
  for (const auto& input : model->inputs()) {
    std::printf("  input   %s %s %s\n", input.name().c_str(), input.datatype().c_str(),
                FormatShape(input.shape()).c_str());
  }
  for (const auto& output : model->outputs()) {
    std::printf("  output  %s %s %s\n", output.name().c_str(), output.datatype().c_str(),
                FormatShape(output.shape()).c_str());
  }
  return kExitOk;
}

int Infer(const LayerctlArgs& args) {
  const absl::Time deadline = Deadline(args);
  absl::StatusOr<NpyArray> array = ReadNpyFile(args.input_path);
  if (!array.ok()) return Fail(array.status());
  absl::StatusOr<Tensor> input = NpyToTensor(*array, args.datatype);
  if (!input.ok()) return Fail(input.status());
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(args);
  if (!client.ok()) return Fail(client.status());
  const absl::Time start = absl::Now();
  absl::StatusOr<Tensor> output =
      (*client)->Infer(*args.model, *input, deadline, args.infer_options);
  if (!output.ok()) return Fail(output.status());
  const double latency_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  absl::StatusOr<NpyArray> out_array = TensorToNpy(*output);
  if (!out_array.ok()) return Fail(out_array.status());
  if (absl::Status s = WriteNpyFile(args.output_path, *out_array); !s.ok()) return Fail(s);
  std::printf("wrote %s: %s [%s] (%.2f ms)\n", args.output_path.c_str(), output->datatype.c_str(),
              absl::StrJoin(output->shape, ", ").c_str(), latency_ms);
  return kExitOk;
}

int Bench(const LayerctlArgs& args) {
  // One connection: the shared channel every other command uses. More: each
  // client its own TCP connection, as that many client processes would have.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Client*> client_pointers;
  for (int i = 0; i < args.connections; ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Connect(args, /*dedicated_connection=*/args.connections > 1);
    if (!client.ok()) return Fail(client.status());
    client_pointers.push_back(client->get());
    clients.push_back(*std::move(client));
  }
  // Every connection up before the load starts (Client::WaitForConnected).
  // One that is not gets the run's first call instead, whose status says why
  // (a TLS handshake refused, nothing listening).
  const absl::Time connect_deadline =
      absl::Now() + absl::Seconds(std::min(args.bench.timeout_seconds, 10.0));
  for (size_t i = 0; i < clients.size(); ++i) {
    if (absl::Status connected = clients[i]->WaitForConnected(connect_deadline); !connected.ok()) {
      const absl::Status why = clients[i]->Live(absl::Now() + absl::Seconds(5)).status();
      return Fail(absl::UnavailableError(absl::StrCat(
          "connection ", i + 1, " of ", clients.size(), " to ", args.url, ": ", connected.message(),
          why.ok() ? "" : absl::StrCat("; a call says: ", why.ToString()))));
    }
  }
  std::string text, json;
  bool succeeded = false;
  if (args.bench.sessions > 0) {
    BenchOptions options = args.bench;
    // The progress line rewrites itself with \r: only for a terminal.
    options.progress = options.progress && isatty(STDERR_FILENO) == 1;
    absl::StatusOr<SessionBenchReport> report = RunSessionBench(client_pointers, options);
    if (!report.ok()) return Fail(report.status());
    text = FormatSessionBenchReport(*report);
    json = SessionBenchReportJson(*report);
    succeeded = report->sessions_completed > 0;
  } else {
    absl::StatusOr<BenchReport> report = RunBench(client_pointers, args.bench);
    if (!report.ok()) return Fail(report.status());
    text = FormatBenchReport(*report);
    json = BenchReportJson(*report);
    succeeded = report->requests_ok > 0;
  }
  std::fputs(text.c_str(), stdout);
  if (!args.json_path.empty()) {
    std::ofstream out(args.json_path, std::ios::trunc);
    out << json;
    out.close();
    if (!out) {
      return Fail(absl::PermissionDeniedError(absl::StrCat("cannot write ", args.json_path)));
    }
  }
  // A run where nothing succeeded is a failure for scripts.
  return succeeded ? kExitOk : kExitFailure;
}

}  // namespace

int Main(int argc, char** argv) {
  const ParsedCommandLine parsed =
      ParseLayerctlCommandLine(std::vector<std::string>(argv, argv + argc), LAYERSERVE_VERSION);
  std::fputs(parsed.out.c_str(), stdout);
  std::fputs(parsed.err.c_str(), stderr);
  if (!parsed.args) return parsed.exit_status;
  switch (parsed.args->command) {
    case Command::kHealth:
      return Health(*parsed.args);
    case Command::kMetadata:
      return Metadata(*parsed.args);
    case Command::kInfer:
      return Infer(*parsed.args);
    case Command::kBench:
      return Bench(*parsed.args);
  }
  return kExitFailure;
}

}  // namespace layerserve::client

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so by default every absl::Mutex
  // lock (gRPC's own included, several per call) also updates a global
  // lock-order graph to detect deadlocks. The server turns it off for the
  // same reason (server/main.cc); `layerctl bench` shares the machine with
  // the server it measures, so its CPU per request counts. Design record
  // 0013.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return layerserve::client::Main(argc, argv);
}
