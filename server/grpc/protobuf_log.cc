// protobuf's log, rate-limited, and gRPC core's, with failed TLS handshakes
// rate-limited, both through base/log.h (see protobuf_log.h).
#include "server/grpc/protobuf_log.h"

#include <grpc/support/log.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/log.h"
#include "google/protobuf/stubs/logging.h"

namespace layerserve {

bool LogRateLimiter::Allow(Time now, int64_t* suppressed) {
  if (!started_ || now - window_start_ >= window_) {
    started_ = true;
    window_start_ = now;
    printed_in_window_ = 0;
  }
  if (printed_in_window_ >= burst_) {
    ++suppressed_;
    return false;
  }
  ++printed_in_window_;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

namespace {

// FATAL (protobuf aborts after logging it) is an ERROR record.
LogLevel ToLogLevel(google::protobuf::LogLevel level) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      return LogLevel::kInfo;
    case google::protobuf::LOGLEVEL_WARNING:
      return LogLevel::kWarning;
    case google::protobuf::LOGLEVEL_ERROR:
    case google::protobuf::LOGLEVEL_FATAL:
      return LogLevel::kError;
  }
  return LogLevel::kError;
}

// A limiter shared by every thread that logs through it. Each is allocated
// once and never destroyed: protobuf and gRPC may log during exit.
class SharedLimiter {
 public:
  SharedLimiter(int burst, std::chrono::steady_clock::duration window) : limiter_(burst, window) {}
  // Whether to log now; `suppressed`: the lines dropped since the last one.
  bool Allow(int64_t* suppressed) {
    absl::MutexLock lock(&mu_);
    return limiter_.Allow(std::chrono::steady_clock::now(), suppressed);
  }

 private:
  absl::Mutex mu_;
  LogRateLimiter limiter_ ABSL_GUARDED_BY(mu_);
};

SharedLimiter& ProtobufLines() {
  static SharedLimiter* const limiter = new SharedLimiter(kProtobufLogBurst, kProtobufLogWindow);
  return *limiter;
}

void RateLimitedLog(google::protobuf::LogLevel level, const char* filename, int line,
                    const std::string& message) {
  int64_t suppressed = 0;
  if (level != google::protobuf::LOGLEVEL_FATAL && !ProtobufLines().Allow(&suppressed)) return;
  if (suppressed > 0) {
    LogWarning(absl::StrCat("[libprotobuf] ", suppressed, " similar lines suppressed (at most ",
                            kProtobufLogBurst, " per ", kProtobufLogWindow.count(), " s)"));
  }
  Log(ToLogLevel(level), absl::StrCat("[libprotobuf ", filename, ":", line, "] ", message));
}

SharedLimiter& FailedHandshakes() {
  static SharedLimiter* const limiter = new SharedLimiter(kHandshakeLogBurst, kHandshakeLogWindow);
  return *limiter;
}

std::atomic<bool> accept_failed{false};

// gRPC core's DEBUG records (GRPC_VERBOSITY=DEBUG) are INFO ones.
void GrpcCoreLog(gpr_log_func_args* args) {
  if (std::strstr(args->message, "Failed accept4") != nullptr) {
    accept_failed.store(true, std::memory_order_relaxed);
  }
  if (std::strstr(args->message, "Handshake failed") != nullptr) {
    int64_t suppressed = 0;
    if (!FailedHandshakes().Allow(&suppressed)) return;
    if (suppressed > 0) {
      LogWarning(absl::StrCat("[grpc] ", suppressed, " failed TLS handshakes not logged (at most ",
                              kHandshakeLogBurst, " per ", kHandshakeLogWindow.count(), " s)"));
    }
  }
  const LogLevel level =
      args->severity == GPR_LOG_SEVERITY_ERROR ? LogLevel::kError : LogLevel::kInfo;
  Log(level, absl::StrCat("[grpc ", args->file, ":", args->line, "] ", args->message));
}

}  // namespace

void InstallRateLimitedProtobufLog() {
  // SetLogHandler is not thread-safe; once per process, before any call.
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&RateLimitedLog); });
}

void InstallGrpcCoreLog() { gpr_set_log_function(&GrpcCoreLog); }

bool GrpcAcceptFailed() { return accept_failed.load(std::memory_order_relaxed); }

}  // namespace layerserve
