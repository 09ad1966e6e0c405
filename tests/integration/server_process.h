// A real `layerserve` child process for integration tests: started on
// 127.0.0.1 with --grpc-port 0 --metrics-port 0, its ready line parsed for the
// ports, its stdout forwarded to the test's stderr afterwards, and killed at
// destruction if a test did not stop it. RunToExit runs a command that ends
// by itself (--help, a bad flag) and keeps what it printed.
//
// Also a minimal HTTP GET (to scrape /metrics) and a Prometheus text parser:
// enough for asserting on counters and histograms, without a client library.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace layerserve::integration {

class ServerProcess {
 public:
  // Starts the binary (LAYERSERVE_BINARY, from the build) with `extra_args`
  // after the host and port flags, and waits up to `ready_timeout` for its
  // ready line. The child gets SIGKILL if the test process dies. Its stderr
  // is the test's, or the file `stderr_path` (created or truncated) when set,
  // for tests that count what the server logs.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& extra_args, absl::Duration ready_timeout = absl::Seconds(30),
      const std::string& stderr_path = "");

  // SIGKILLs and reaps the child unless it already exited.
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  const std::string& model() const { return model_; }
  const std::string& ready_line() const { return ready_line_; }
  pid_t pid() const { return pid_; }

  void Signal(int signal_number);
  // Waits for the child to exit: its exit code, or an error if it was killed
  // by a signal or is still running after `timeout`.
  absl::StatusOr<int> WaitForExit(absl::Duration timeout);

 private:
  ServerProcess() = default;

  pid_t pid_ = -1;
  bool reaped_ = false;
  int stdout_fd_ = -1;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  std::string model_;
  std::string ready_line_;
  std::thread forwarder_;  // copies the child's remaining stdout to stderr
};

// The layerserve executable the tests run: $LAYERSERVE_BINARY if set, else
// the one this build made.
std::string LayerserveBinary();

struct ProcessResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs `args` (args[0] is the executable's path) with no input until it
// exits; DEADLINE_EXCEEDED (and SIGKILL) if it is still running after
// `timeout`, ABORTED if a signal ended it.
absl::StatusOr<ProcessResult> RunToExit(const std::vector<std::string>& args,
                                        absl::Duration timeout = absl::Seconds(30));

// A /proc/<pid>/status field in kB ("VmRSS", "VmHWM": peak RSS).
absl::StatusOr<int64_t> ProcStatusKb(pid_t pid, const std::string& field);

// GET http://127.0.0.1:<port><path>; the body of a 200 reply.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(5));

// Sum of the samples of `name` in Prometheus text (over all label sets whose
// labels contain every `label_filter` entry, such as code="OK"); NOT_FOUND if
// no sample matches.
absl::StatusOr<double> MetricSum(const std::string& text, const std::string& name,
                                 const std::vector<std::string>& label_filter = {});

}  // namespace layerserve::integration
