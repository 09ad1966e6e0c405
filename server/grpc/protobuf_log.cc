// protobuf's log, rate-limited (see protobuf_log.h).
#include "server/grpc/protobuf_log.h"

#include <cstdio>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
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

const char* LevelName(google::protobuf::LogLevel level) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      return "INFO";
    case google::protobuf::LOGLEVEL_WARNING:
      return "WARNING";
    case google::protobuf::LOGLEVEL_ERROR:
      return "ERROR";
    case google::protobuf::LOGLEVEL_FATAL:
      return "FATAL";
  }
  return "?";
}

// Allocated once and never destroyed: protobuf may log during exit.
struct LimitedLog {
  absl::Mutex mu;
  LogRateLimiter limiter ABSL_GUARDED_BY(mu) = LogRateLimiter(kProtobufLogBurst,
                                                              kProtobufLogWindow);
};

LimitedLog& Limited() {
  static LimitedLog* const log = new LimitedLog;
  return *log;
}

void RateLimitedLog(google::protobuf::LogLevel level, const char* filename, int line,
                    const std::string& message) {
  int64_t suppressed = 0;
  if (level != google::protobuf::LOGLEVEL_FATAL) {
    LimitedLog& log = Limited();
    absl::MutexLock lock(&log.mu);
    if (!log.limiter.Allow(std::chrono::steady_clock::now(), &suppressed)) return;
  }
  if (suppressed > 0) {
    std::fprintf(stderr, "[libprotobuf] %lld similar lines suppressed (at most %d per %lld s)\n",
                 static_cast<long long>(suppressed), kProtobufLogBurst,
                 static_cast<long long>(kProtobufLogWindow.count()));
  }
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %s\n", LevelName(level), filename, line,
               message.c_str());
}

}  // namespace

void InstallRateLimitedProtobufLog() {
  // SetLogHandler is not thread-safe; once per process, before any call.
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&RateLimitedLog); });
}

}  // namespace layerserve
