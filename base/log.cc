// The server's log (see log.h): records formatted whole, written to fd 2 one
// write(2) per record under a process-wide mutex.
#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/mutex.h"

namespace layerserve {
namespace {

constexpr std::string_view kLogger = "layerserve";

std::atomic<LogFormat> g_format{LogFormat::kText};

// Allocated once and never destroyed: threads may log while the process
// exits.
Mutex& WriteMutex() {
  static Mutex* const mu = new Mutex;
  return *mu;
}

// Writes all of `text` to stderr's descriptor, retrying after a signal or a
// short write. Errors are dropped: there is nowhere left to report them.
void WriteToStderr(std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
}

// The length of the valid UTF-8 sequence at the start of `s`, or 0 if it
// does not start with one (RFC 3629: no overlong forms, no surrogates, at
// most U+10FFFF).
size_t Utf8SequenceLength(std::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // overlong below U+0800
    if (lead == 0xED) high = 0x9F;  // surrogates U+D800..U+DFFF
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;   // overlong below U+10000
    if (lead == 0xF4) high = 0x8F;  // beyond U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < length; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return length;
}

std::string_view WithoutTrailingNewlines(std::string_view message) {
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) {
    message.remove_suffix(1);
  }
  return message;
}

}  // namespace

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "ERROR";
}

std::optional<LogFormat> ParseLogFormat(std::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return std::nullopt;
}

void SetLogFormat(LogFormat format) { g_format.store(format, std::memory_order_relaxed); }

LogFormat GetLogFormat() { return g_format.load(std::memory_order_relaxed); }

std::string JsonQuote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out.push_back('"');
  while (!text.empty()) {
    const char c = text.front();
    const size_t length = Utf8SequenceLength(text);
    if (length == 0) {
      out.append("\xEF\xBF\xBD");  // U+FFFD for each byte that is not UTF-8
      text.remove_prefix(1);
      continue;
    }
    if (length > 1) {
      out.append(text.substr(0, length));
      text.remove_prefix(length);
      continue;
    }
    switch (c) {
      case '"':
        out.append("\\\"");
        break;
      case '\\':
        out.append("\\\\");
        break;
      case '\n':
        out.append("\\n");
        break;
      case '\r':
        out.append("\\r");
        break;
      case '\t':
        out.append("\\t");
        break;
      case '\b':
        out.append("\\b");
        break;
      case '\f':
        out.append("\\f");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out.push_back(c);
        }
    }
    text.remove_prefix(1);
  }
  out.push_back('"');
  return out;
}

std::string FormatLogRecord(LogFormat format, absl::Time time, LogLevel level,
                            std::string_view message) {
  // RFC 3339 in UTC with milliseconds: 2026-11-23T15:04:05.123Z.
  const std::string stamp = absl::FormatTime("%Y-%m-%d%ET%H:%M:%E3SZ", time, absl::UTCTimeZone());
  message = WithoutTrailingNewlines(message);
  const std::string_view level_name = LogLevelName(level);
  std::string record;
  if (format == LogFormat::kJson) {
    record.append("{\"time\":\"").append(stamp).append("\",\"level\":\"").append(level_name);
    record.append("\",\"logger\":\"").append(kLogger).append("\",\"msg\":");
    record.append(JsonQuote(message)).append("}\n");
  } else {
    record.append(stamp).append(" ").append(level_name).append(" ").append(kLogger).append(": ");
    record.append(message).append("\n");
  }
  return record;
}

void Log(LogLevel level, std::string_view message) {
  const std::string record = FormatLogRecord(GetLogFormat(), absl::Now(), level, message);
  MutexLock lock(&WriteMutex());
  WriteToStderr(record);
}

LogStream::LogStream(LogLevel level) : std::ostream(nullptr), buffer_(level) { rdbuf(&buffer_); }

LogStream::~LogStream() { buffer_.Finish(); }

void LogStream::LineBuffer::Finish() {
  if (!line_.empty()) Log(level_, line_);
  line_.clear();
}

LogStream::LineBuffer::int_type LogStream::LineBuffer::overflow(int_type c) {
  if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
  const char ch = traits_type::to_char_type(c);
  xsputn(&ch, 1);
  return c;
}

std::streamsize LogStream::LineBuffer::xsputn(const char* s, std::streamsize n) {
  std::string_view text(s, static_cast<size_t>(n));
  for (size_t end = text.find('\n'); end != std::string_view::npos; end = text.find('\n')) {
    line_.append(text.substr(0, end));
    Log(level_, line_);
    line_.clear();
    text.remove_prefix(end + 1);
  }
  line_.append(text);
  return n;
}

}  // namespace layerserve
