// Rate limiting of protobuf's own log lines, and the routing of protobuf's and
// gRPC core's log lines into the server's log (base/log.h), so that
// --log-format decides their format too.
//
// protobuf writes one ERROR line to stderr for every message whose `string`
// field holds invalid UTF-8 ("String field ... contains invalid UTF-8 data
// when parsing"), and the request is then refused by gRPC. A client can send
// such messages at any rate, so unchecked they fill the server's log. The
// gRPC frontend installs, once per process, a handler that prints the first
// kProtobufLogBurst lines of each kProtobufLogWindow and counts the rest,
// reporting the count with the next line it prints. The wire format is
// unchanged: the fields stay `string`.
#pragma once

#include <chrono>
#include <cstdint>

namespace layerserve {

inline constexpr int kProtobufLogBurst = 5;
inline constexpr std::chrono::seconds kProtobufLogWindow(60);

// Decides which lines of a stream pass: at most `burst` per `window`,
// windows starting at the first line after the previous one ended. Not
// thread-safe; callers lock.
class LogRateLimiter {
 public:
  using Time = std::chrono::steady_clock::time_point;

  LogRateLimiter(int burst, std::chrono::steady_clock::duration window)
      : burst_(burst), window_(window) {}

  // True if the line logged at `now` should be printed; then `*suppressed` is
  // the number of lines dropped since the last printed one (to report).
  bool Allow(Time now, int64_t* suppressed);

 private:
  const int burst_;
  const std::chrono::steady_clock::duration window_;
  Time window_start_{};
  bool started_ = false;
  int printed_in_window_ = 0;
  int64_t suppressed_ = 0;
};

// Routes protobuf's log through a LogRateLimiter (kProtobufLogBurst per
// kProtobufLogWindow) to the server's log, as "[libprotobuf FILE:LINE]
// message" at protobuf's level (FATAL as ERROR). FATAL lines always pass.
// Idempotent and thread-safe.
void InstallRateLimitedProtobufLog();

// With TLS on (--tls-cert-file), gRPC core logs one ERROR line for every
// handshake that fails ("Handshake failed with fatal error ...": a plaintext
// client, a client certificate missing or signed by no client CA), which
// anyone who reaches the port can cause at its connection rate: those lines
// pass kHandshakeLogBurst per kHandshakeLogWindow, the rest counted.
inline constexpr int kHandshakeLogBurst = 5;
inline constexpr std::chrono::seconds kHandshakeLogWindow(60);

// Routes gRPC core's log (what GRPC_VERBOSITY lets through; ERROR by
// default) to the server's log, as "[grpc FILE:LINE] message", with the
// lines of failed TLS handshakes rate-limited (above). Idempotent.
void InstallGrpcCoreLog();

// True once gRPC core has logged "Failed accept4" (through the log
// InstallGrpcCoreLog installs). gRPC 1.51 reports a failed accept() other than
// EAGAIN/ECONNABORTED (EMFILE: the process ran out of file descriptors) only
// in its log, and then never listens on that socket again, even after
// descriptors are free (the bug class of CVE-2023-4785, fixed in gRPC 1.58):
// the server keeps serving the connections it has and refuses every new one.
// main() polls this to shut down and let a supervisor restart it.
bool GrpcAcceptFailed();

}  // namespace layerserve
