// The server's log: one record per line on stderr, with its time (UTC,
// milliseconds) and level, as text for people or as JSON lines for log
// collectors (--log-format):
//
//   2026-11-23T15:04:05.123Z INFO layerserve: model demo (llama, ...) layers 0:4, ...
//   {"time":"2026-11-23T15:04:05.123Z","level":"INFO","logger":"layerserve","msg":"model demo ..."}
//
// Everything in the server process that logs (main, the CUDA backend, the
// GEMM tuner, protobuf's and gRPC's own log hooks) goes through here, so one
// flag decides the format of every line. The ready line on stdout is not a
// log record and stays apart.
//
// Threading: every function may be called from any thread. A record is
// formatted whole and written to fd 2 with one write(2) under a mutex, so
// lines from different threads never interleave; stderr's own buffer is not
// used, so nothing is lost by std::_Exit.
#pragma once

#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <string_view>

#include "absl/time/time.h"

namespace layerserve {

enum class LogLevel { kInfo, kWarning, kError };
enum class LogFormat { kText, kJson };

// "INFO", "WARNING", "ERROR".
std::string_view LogLevelName(LogLevel level);

// "text" or "json"; nullopt for anything else.
std::optional<LogFormat> ParseLogFormat(std::string_view name);

// Sets the process-wide format (text until then). main sets it once, right
// after parsing the command line, before other threads start; lines logged
// before it (a command line that does not parse) are text.
void SetLogFormat(LogFormat format);
LogFormat GetLogFormat();

// Writes one record to stderr. A message should be one line: in JSON every
// character is escaped, in text it is written as given (a trailing newline
// is dropped in both).
void Log(LogLevel level, std::string_view message);
inline void LogInfo(std::string_view message) { Log(LogLevel::kInfo, message); }
inline void LogWarning(std::string_view message) { Log(LogLevel::kWarning, message); }
inline void LogError(std::string_view message) { Log(LogLevel::kError, message); }

// The record Log writes, newline included: pure, for tests.
std::string FormatLogRecord(LogFormat format, absl::Time time, LogLevel level,
                            std::string_view message);

// `text` as a JSON string literal, quotes included: `"` and `\` escaped,
// control characters as \n, \t, ... or \u00XX, and bytes that are not valid
// UTF-8 replaced by U+FFFD, so any input gives a string every JSON parser
// accepts.
std::string JsonQuote(std::string_view text);

// An std::ostream whose every line becomes one record at `level`: for code
// that logs to a stream its caller picks (the GEMM tuner: the CUDA backend
// passes a LogStream, layer_bench std::cerr, tests a std::ostringstream). A
// record is written at each '\n'; an unfinished line at destruction. One
// thread at a time, like any ostream.
class LogStream : public std::ostream {
 public:
  explicit LogStream(LogLevel level);
  ~LogStream() override;
  LogStream(const LogStream&) = delete;
  LogStream& operator=(const LogStream&) = delete;

 private:
  // Collects characters into `line_`, logging it at each '\n'.
  class LineBuffer : public std::streambuf {
   public:
    explicit LineBuffer(LogLevel level) : level_(level) {}
    void Finish();  // logs an unfinished line, if any

   protected:
    int_type overflow(int_type c) override;
    std::streamsize xsputn(const char* s, std::streamsize n) override;

   private:
    const LogLevel level_;
    std::string line_;
  };
  LineBuffer buffer_;
};

}  // namespace layerserve
