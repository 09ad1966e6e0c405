// ServerProcess, HttpGet and MetricSum (see server_process.h).
#include "tests/integration/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

#ifndef LAYERSERVE_BINARY
#error "LAYERSERVE_BINARY (path of the layerserve executable) must be defined by the build"
#endif

namespace layerserve::integration {
namespace {

constexpr char kReadyPrefix[] = "layerserve ready:";

// "key=value" fields of the ready line.
absl::Status ParseReadyLine(const std::string& line, int* grpc_port, int* metrics_port,
                            std::string* model) {
  bool have_grpc = false, have_metrics = false;
  for (absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&field, "grpc_port=")) have_grpc = absl::SimpleAtoi(field, grpc_port);
    if (absl::ConsumePrefix(&field, "metrics_port=")) {
      have_metrics = absl::SimpleAtoi(field, metrics_port);
    }
    if (absl::ConsumePrefix(&field, "model=")) *model = std::string(field);
  }
  if (!have_grpc || !have_metrics || *grpc_port <= 0 || *metrics_port <= 0 || model->empty()) {
    return absl::InternalError(absl::StrCat("cannot parse the ready line: '", line, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string LayerserveBinary() {
  const char* binary = std::getenv("LAYERSERVE_BINARY");
  return binary != nullptr ? binary : LAYERSERVE_BINARY;
}

absl::StatusOr<ProcessResult> RunToExit(const std::vector<std::string>& args,
                                        absl::Duration timeout) {
  if (args.empty()) return absl::InvalidArgumentError("no program to run");
  std::vector<std::string> arg_copies = args;
  std::vector<char*> argv;
  for (std::string& arg : arg_copies) argv.push_back(arg.data());
  argv.push_back(nullptr);
  int out_fds[2], err_fds[2];
  if (pipe2(out_fds, O_CLOEXEC) != 0 || pipe2(err_fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    dup2(null_fd, STDIN_FILENO);
    dup2(out_fds[1], STDOUT_FILENO);
    dup2(err_fds[1], STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out_fds[1]);
  close(err_fds[1]);

  // Both pipes are read as they fill, so a child printing a lot never blocks.
  ProcessResult result;
  pollfd fds[2] = {{out_fds[0], POLLIN, 0}, {err_fds[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  const absl::Time deadline = absl::Now() + timeout;
  int open_pipes = 2;
  while (open_pipes > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    const int ready = poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_pipes;
        continue;
      }
      sinks[i]->append(buffer, static_cast<size_t>(n));
    }
  }
  for (const pollfd& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      if (WIFEXITED(status)) {
        result.exit_code = WEXITSTATUS(status);
        return result;
      }
      return absl::AbortedError(absl::StrCat(args[0], " was killed by signal ", WTERMSIG(status)));
    }
    if (done < 0) return absl::InternalError(absl::StrCat("waitpid: ", strerror(errno)));
    if (absl::Now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return absl::DeadlineExceededError(absl::StrCat(
          absl::StrJoin(args, " "), " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& extra_args, absl::Duration ready_timeout,
    const std::string& stderr_path) {
  // The same suite runs against another build or backend without rebuilding
  // (scripts/gpu-run.sh: LAYERSERVE_BINARY=... LAYERSERVE_SERVER_ARGS=--backend=cuda).
  std::vector<std::string> args = {LayerserveBinary(), "--host=127.0.0.1", "--grpc-port=0",
                                   "--metrics-port=0"};
  if (const char* server_args = std::getenv("LAYERSERVE_SERVER_ARGS")) {
    for (absl::string_view arg : absl::StrSplit(server_args, ' ', absl::SkipEmpty())) {
      args.emplace_back(arg);
    }
  }
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  // argv is built before fork: the child may only make async-signal-safe calls.
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  int stderr_fd = -1;
  if (!stderr_path.empty()) {
    stderr_fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (stderr_fd < 0) {
      return absl::InternalError(absl::StrCat("open ", stderr_path, ": ", strerror(errno)));
    }
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    if (stderr_fd >= 0) dup2(stderr_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  if (stderr_fd >= 0) close(stderr_fd);
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->pid_ = pid;
  server->stdout_fd_ = fds[0];
  std::fprintf(stderr, "[test] started %s (pid %d)\n", absl::StrJoin(args, " ").c_str(), pid);

  const absl::Time deadline = absl::Now() + ready_timeout;
  std::string pending;
  while (true) {
    const size_t newline = pending.find('\n');
    if (newline != std::string::npos) {
      std::string line = pending.substr(0, newline);
      pending.erase(0, newline + 1);
      if (absl::StartsWith(line, kReadyPrefix)) {
        absl::Status parsed =
            ParseReadyLine(line, &server->grpc_port_, &server->metrics_port_, &server->model_);
        if (!parsed.ok()) return parsed;
        server->ready_line_ = line;
        std::fprintf(stderr, "[test] %s\n", line.c_str());
        break;
      }
      std::fprintf(stderr, "[layerserve stdout] %s\n", line.c_str());
      continue;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("layerserve printed no ready line within ",
                                                      absl::FormatDuration(ready_timeout)));
    }
    pollfd pfd{server->stdout_fd_, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno != EINTR)
      return absl::InternalError(absl::StrCat("poll: ", strerror(errno)));
    if (ready <= 0) continue;
    char buffer[4096];
    const ssize_t n = read(server->stdout_fd_, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::StatusOr<int> code = server->WaitForExit(absl::Seconds(5));
      return absl::InternalError(absl::StrCat(
          "layerserve exited before its ready line (",
          code.ok() ? absl::StrCat("exit code ", *code) : std::string(code.status().message()),
          "); its stderr is above"));
    }
    pending.append(buffer, static_cast<size_t>(n));
  }

  // The child must never block on a full stdout pipe once tests run.
  const int fd = server->stdout_fd_;
  server->forwarder_ = std::thread([fd, rest = std::move(pending)] {
    if (!rest.empty()) std::fprintf(stderr, "[layerserve stdout] %s", rest.c_str());
    char buffer[4096];
    while (true) {
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      std::fwrite(buffer, 1, static_cast<size_t>(n), stderr);
    }
  });
  return server;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
  // The pipe reaches EOF once the child is gone, which ends the forwarder.
  if (forwarder_.joinable()) forwarder_.join();
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

void ServerProcess::Signal(int signal_number) {
  if (pid_ > 0 && !reaped_) kill(pid_, signal_number);
}

absl::StatusOr<int> ServerProcess::WaitForExit(absl::Duration timeout) {
  if (reaped_) return absl::FailedPreconditionError("the server was already reaped");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      reaped_ = true;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return absl::AbortedError(absl::StrCat("layerserve was killed by signal ", WTERMSIG(status)));
    }
    if (done < 0) return absl::InternalError(absl::StrCat("waitpid: ", strerror(errno)));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("layerserve still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<int64_t> ProcStatusKb(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, field + ":")) continue;
    int64_t kb = 0;
    const std::string value(absl::StripAsciiWhitespace(
        absl::StripSuffix(absl::string_view(line).substr(field.size() + 1), "kB")));
    if (absl::SimpleAtoi(value, &kb)) return kb;
  }
  return absl::NotFoundError(absl::StrCat("no ", field, " in /proc/", pid, "/status"));
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ", strerror(errno)));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
  }
  std::string reply;
  char buffer[8192];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DeadlineExceededError(absl::StrCat("recv: ", strerror(errno)));
    if (n == 0) break;
    reply.append(buffer, static_cast<size_t>(n));
  }
  const size_t body = reply.find("\r\n\r\n");
  if (body == std::string::npos) return absl::DataLossError("HTTP reply without a header end");
  const std::string status_line = reply.substr(0, reply.find("\r\n"));
  if (!absl::StrContains(status_line, " 200")) {
    return absl::UnavailableError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return reply.substr(body + 4);
}

absl::StatusOr<double> MetricSum(const std::string& text, const std::string& name,
                                 const std::vector<std::string>& label_filter) {
  double sum = 0;
  bool found = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos || line.substr(0, name_end) != name) continue;
    absl::string_view labels;
    absl::string_view rest = line.substr(name_end);
    if (rest[0] == '{') {
      const size_t close = rest.find('}');
      if (close == absl::string_view::npos) continue;
      labels = rest.substr(1, close - 1);
      rest = rest.substr(close + 1);
    }
    bool match = true;
    for (const std::string& filter : label_filter)
      match = match && absl::StrContains(labels, filter);
    if (!match) continue;
    const std::vector<std::string> tokens = absl::StrSplit(rest, ' ', absl::SkipEmpty());
    if (tokens.empty()) continue;
    char* end = nullptr;
    const double value = std::strtod(tokens[0].c_str(), &end);
    if (end == tokens[0].c_str()) {
      return absl::DataLossError(absl::StrCat("unparsable sample: '", line, "'"));
    }
    sum += value;
    found = true;
  }
  if (!found) {
    return absl::NotFoundError(absl::StrCat("no sample of ", name, " {",
                                            absl::StrJoin(label_filter, ","), "} in /metrics"));
  }
  return sum;
}

}  // namespace layerserve::integration
