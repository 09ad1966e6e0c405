// layerctl: command-line client for layerserve.
//
//   layerctl health    exit status 0 iff the server reports SERVING (Docker HEALTHCHECK)
//   layerctl metadata  server and model metadata
//   layerctl infer     run a .npy file through the model, write the result as .npy
//   layerctl bench     closed- or open-loop load with a latency/throughput report
//
// Flags are parsed per subcommand (each has its own set), so this does not use
// the process-global absl flags. Exit status: 0 success, 1 failure, 2 usage.
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/bench.h"
#include "client/client.h"
#include "client/npy.h"

namespace layerserve::client {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

constexpr char kUsage[] = R"(usage: layerctl <command> [flags]

commands:
  health    [--url host:port] [--timeout-s S]
            Checks grpc.health.v1; prints the status; exit 0 only if SERVING.
  metadata  [--url host:port] [--model NAME] [--timeout-s S]
            Prints server metadata, and the model's when --model is given.
  infer     --model NAME --input in.npy --output out.npy [--datatype BF16|FP16|FP32]
            [--url host:port] [--timeout-s S]
            Sends the array as tensor "hidden_states" [B, T, hidden]. The datatype
            defaults to the file's: <f4 FP32, <f2 FP16, <u2 BF16 (bf16 bit patterns);
            with --datatype the values are converted. The output is written in the
            reply's datatype with the same conventions.
  bench     --model NAME --tokens T [--batch B] (--concurrency C | --rate R)
            [--arrivals poisson|uniform] [--duration-s D] [--warmup-s W]
            [--datatype FP32|FP16|BF16] [--hidden H] [--max-in-flight N]
            [--timeout-s S] [--seed N] [--json out.json] [--no-progress] [--url host:port]
            [--connections N]
            Random inputs. Closed loop: C threads, one request each at a time.
            Open loop: R requests/s whatever the latency; arrivals beyond
            --max-in-flight outstanding requests are skipped and reported.
            --connections spreads the load over N TCP connections (default 1),
            as N client processes would.
  help      Prints this text.

--url defaults to localhost:8001.
)";

// "--name value" / "--name=value" / "--switch" arguments of one subcommand.
class Flags {
 public:
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     const std::set<std::string>& valued,
                                     const std::set<std::string>& switches) {
    Flags flags;
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& arg = args[i];
      if (arg.rfind("--", 0) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
      }
      std::string name = arg.substr(2);
      std::optional<std::string> value;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name.resize(eq);
      }
      if (switches.count(name)) {
        if (value) return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
        flags.values_[name] = "";
        continue;
      }
      if (!valued.count(name)) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
      }
      if (!value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        }
        value = args[++i];
      }
      flags.values_[name] = *value;
    }
    return flags;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  absl::StatusOr<std::string> Require(const std::string& name) const {
    if (!Has(name)) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
    return Get(name);
  }
  template <typename T>
  absl::Status GetNumber(const std::string& name, T* out) const {
    if (!Has(name)) return absl::OkStatus();
    bool ok;
    if constexpr (std::is_floating_point_v<T>) {
      double v;
      ok = absl::SimpleAtod(Get(name), &v);
      *out = static_cast<T>(v);
    } else {
      ok = absl::SimpleAtoi(Get(name), out);
    }
    return ok ? absl::OkStatus()
              : absl::InvalidArgumentError(
                    absl::StrCat("--", name, ": not a number: '", Get(name), "'"));
  }

 private:
  std::map<std::string, std::string> values_;
};

// Prints the error. Errors about the command line (INVALID_ARGUMENT naming a
// --flag: every flag and option check phrases its message that way) exit
// with the usage status and a pointer to the help text.
int Fail(const absl::Status& status) {
  std::fprintf(stderr, "layerctl: %s\n", std::string(status.ToString()).c_str());
  if (absl::IsInvalidArgument(status) && absl::StrContains(status.message(), "--")) {
    std::fputs("run 'layerctl help' for usage\n", stderr);
    return kExitUsage;
  }
  return kExitFailure;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags(const Flags& flags) {
  return Client::Connect(flags.Get("url", "localhost:8001"));
}

absl::StatusOr<absl::Time> DeadlineFromFlags(const Flags& flags, double fallback_seconds) {
  double seconds = fallback_seconds;
  if (absl::Status s = flags.GetNumber("timeout-s", &seconds); !s.ok()) return s;
  return absl::Now() + absl::Seconds(seconds);
}

int Health(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, {"url", "timeout-s"}, {});
  if (!flags.ok()) return Fail(flags.status());
  absl::StatusOr<absl::Time> deadline = DeadlineFromFlags(*flags, 5);
  if (!deadline.ok()) return Fail(deadline.status());
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags(*flags);
  if (!client.ok()) return Fail(client.status());
  auto status = (*client)->Health(*deadline);
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

int Metadata(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, {"url", "model", "timeout-s"}, {});
  if (!flags.ok()) return Fail(flags.status());
  absl::StatusOr<absl::Time> deadline = DeadlineFromFlags(*flags, 10);
  if (!deadline.ok()) return Fail(deadline.status());
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags(*flags);
  if (!client.ok()) return Fail(client.status());
  auto server = (*client)->ServerMetadata(*deadline);
  if (!server.ok()) return Fail(server.status());
  std::printf("server:     %s %s\nextensions: %s\n", server->name().c_str(),
              server->version().c_str(), absl::StrJoin(server->extensions(), ", ").c_str());
  if (!flags->Has("model")) {
    std::printf("(pass --model NAME for the model's metadata)\n");
    return kExitOk;
  }
  auto model = (*client)->ModelMetadata(flags->Get("model"), *deadline);
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

int Infer(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args, {"url", "model", "input", "output", "datatype", "timeout-s"}, {});
  if (!flags.ok()) return Fail(flags.status());
  absl::StatusOr<std::string> model = flags->Require("model");
  absl::StatusOr<std::string> input_path = flags->Require("input");
  absl::StatusOr<std::string> output_path = flags->Require("output");
  for (const absl::Status& s : {model.status(), input_path.status(), output_path.status()}) {
    if (!s.ok()) return Fail(s);
  }
  absl::StatusOr<absl::Time> deadline = DeadlineFromFlags(*flags, 60);
  if (!deadline.ok()) return Fail(deadline.status());
  absl::StatusOr<NpyArray> array = ReadNpyFile(*input_path);
  if (!array.ok()) return Fail(array.status());
  std::optional<std::string> datatype;
  if (flags->Has("datatype")) datatype = flags->Get("datatype");
  absl::StatusOr<Tensor> input = NpyToTensor(*array, datatype);
  if (!input.ok()) return Fail(input.status());
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags(*flags);
  if (!client.ok()) return Fail(client.status());
  const absl::Time start = absl::Now();
  absl::StatusOr<Tensor> output = (*client)->Infer(*model, *input, *deadline);
  if (!output.ok()) return Fail(output.status());
  const double latency_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  absl::StatusOr<NpyArray> out_array = TensorToNpy(*output);
  if (!out_array.ok()) return Fail(out_array.status());
  if (absl::Status s = WriteNpyFile(*output_path, *out_array); !s.ok()) return Fail(s);
  std::printf("wrote %s: %s [%s] (%.2f ms)\n", output_path->c_str(), output->datatype.c_str(),
              absl::StrJoin(output->shape, ", ").c_str(), latency_ms);
  return kExitOk;
}

int Bench(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(
      args,
      {"url", "model", "tokens", "batch", "concurrency", "rate", "arrivals", "duration-s",
       "warmup-s", "datatype", "hidden", "max-in-flight", "timeout-s", "seed", "json",
       "connections"},
      {"no-progress"});
  if (!flags.ok()) return Fail(flags.status());
  BenchOptions options;
  absl::StatusOr<std::string> model = flags->Require("model");
  if (!model.ok()) return Fail(model.status());
  if (!flags->Has("tokens")) return Fail(absl::InvalidArgumentError("--tokens is required"));
  options.model = *model;
  options.datatype = flags->Get("datatype", "FP32");
  options.progress = !flags->Has("no-progress");
  const std::string arrivals = flags->Get("arrivals", "poisson");
  if (arrivals != "poisson" && arrivals != "uniform") {
    return Fail(absl::InvalidArgumentError("--arrivals must be poisson or uniform"));
  }
  options.arrivals = arrivals == "poisson" ? Arrivals::kPoisson : Arrivals::kUniform;
  for (const absl::Status& s :
       {flags->GetNumber("tokens", &options.tokens), flags->GetNumber("batch", &options.batch),
        flags->GetNumber("concurrency", &options.concurrency),
        flags->GetNumber("rate", &options.rate_per_second),
        flags->GetNumber("duration-s", &options.duration_seconds),
        flags->GetNumber("warmup-s", &options.warmup_seconds),
        flags->GetNumber("hidden", &options.hidden),
        flags->GetNumber("max-in-flight", &options.max_in_flight),
        flags->GetNumber("timeout-s", &options.timeout_seconds),
        flags->GetNumber("seed", &options.seed)}) {
    if (!s.ok()) return Fail(s);
  }
  int connections = 1;
  if (absl::Status s = flags->GetNumber("connections", &connections); !s.ok()) return Fail(s);
  if (connections < 1 || connections > 256) {
    return Fail(absl::InvalidArgumentError("--connections must be in [1, 256]"));
  }
  // One connection: the shared channel every other command uses. More: each
  // client its own TCP connection, as that many client processes would have.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Client*> client_pointers;
  for (int i = 0; i < connections; ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        connections == 1 ? ConnectFromFlags(*flags)
                         : Client::Connect(flags->Get("url", "localhost:8001"), true);
    if (!client.ok()) return Fail(client.status());
    client_pointers.push_back(client->get());
    clients.push_back(*std::move(client));
  }
  absl::StatusOr<BenchReport> report = RunBench(client_pointers, options);
  if (!report.ok()) return Fail(report.status());
  std::fputs(FormatBenchReport(*report).c_str(), stdout);
  if (flags->Has("json")) {
    std::ofstream out(flags->Get("json"), std::ios::trunc);
    out << BenchReportJson(*report);
    out.close();
    if (!out) {
      return Fail(absl::PermissionDeniedError(absl::StrCat("cannot write ", flags->Get("json"))));
    }
  }
  // A run where nothing succeeded is a failure for scripts.
  return report->requests_ok > 0 ? kExitOk : kExitFailure;
}

}  // namespace

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "help" || command == "--help" || command == "-h") {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (command == "health") return Health(args);
  if (command == "metadata") return Metadata(args);
  if (command == "infer") return Infer(args);
  if (command == "bench") return Bench(args);
  std::fprintf(stderr, "layerctl: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return kExitUsage;
}

}  // namespace layerserve::client

int main(int argc, char** argv) { return layerserve::client::Main(argc, argv); }
