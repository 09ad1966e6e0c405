// The log: both record formats byte for byte, JSON escaping that any parser
// accepts (checked with nlohmann-json, which shares no code with the
// escaper), lines from many threads that never interleave, and LogStream's
// line splitting. The tests that write redirect fd 2 to a file for their
// duration.
#include "base/log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/civil_time.h"
#include "nlohmann/json.hpp"

namespace layerserve {
namespace {

absl::Time Example() {
  return absl::FromCivil(absl::CivilSecond(2026, 11, 23, 15, 4, 5), absl::UTCTimeZone()) +
         absl::Milliseconds(123) + absl::Microseconds(999);  // shown truncated: .123
}

TEST(LogFormatTest, TextRecord) {
  EXPECT_EQ(FormatLogRecord(LogFormat::kText, Example(), LogLevel::kInfo, "model demo"),
            "2026-11-23T15:04:05.123Z INFO layerserve: model demo\n");
  EXPECT_EQ(FormatLogRecord(LogFormat::kText, Example(), LogLevel::kWarning, "binding\n"),
            "2026-11-23T15:04:05.123Z WARNING layerserve: binding\n");
  EXPECT_EQ(FormatLogRecord(LogFormat::kText, absl::UnixEpoch(), LogLevel::kError, ""),
            "1970-01-01T00:00:00.000Z ERROR layerserve: \n");
}

TEST(LogFormatTest, JsonRecord) {
  EXPECT_EQ(FormatLogRecord(LogFormat::kJson, Example(), LogLevel::kError, "port \"8001\" in use"),
            "{\"time\":\"2026-11-23T15:04:05.123Z\",\"level\":\"ERROR\",\"logger\":\"layerserve\","
            "\"msg\":\"port \\\"8001\\\" in use\"}\n");
}

TEST(LogFormatTest, ParseFormat) {
  EXPECT_EQ(ParseLogFormat("text"), LogFormat::kText);
  EXPECT_EQ(ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(ParseLogFormat("JSON"), std::nullopt);
  EXPECT_EQ(ParseLogFormat(""), std::nullopt);
}

TEST(JsonQuoteTest, EscapesWhatJsonRequires) {
  EXPECT_EQ(JsonQuote(""), "\"\"");
  EXPECT_EQ(JsonQuote("plain / text"), "\"plain / text\"");
  EXPECT_EQ(JsonQuote("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonQuote("\n\r\t\b\f"), "\"\\n\\r\\t\\b\\f\"");
  EXPECT_EQ(JsonQuote(std::string("\x01\x1f\x00", 3)), "\"\\u0001\\u001f\\u0000\"");
  EXPECT_EQ(JsonQuote("\x7f"), "\"\x7f\"");  // DEL needs no escape
  // Valid UTF-8 passes unchanged: é (2 bytes), € (3), 😀 (4).
  EXPECT_EQ(JsonQuote("\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"),
            "\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"");
}

TEST(JsonQuoteTest, ReplacesBytesThatAreNotUtf8) {
  const std::string kReplacement = "\xEF\xBF\xBD";
  EXPECT_EQ(JsonQuote("a\xFF"
                      "b"),
            "\"a" + kReplacement + "b\"");
  EXPECT_EQ(JsonQuote("\xC0\xAF"), "\"" + kReplacement + kReplacement + "\"");  // overlong '/'
  EXPECT_EQ(JsonQuote("\xED\xA0\x80"), "\"" + kReplacement + kReplacement + kReplacement + "\"");
  EXPECT_EQ(JsonQuote("\xE2\x82"), "\"" + kReplacement + kReplacement + "\"");  // truncated €
  EXPECT_EQ(JsonQuote("\xF4\x90\x80\x80").substr(0, 4), "\"" + kReplacement);   // > U+10FFFF
}

// Every byte string round-trips through a real JSON parser: the parsed
// string equals the input wherever the input is valid UTF-8.
TEST(JsonQuoteTest, AnyInputParses) {
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  const std::vector<std::string> inputs = {all_bytes,           "tab\there", "quote\"backslash\\",
                                           "\xC3\xA9t\xC3\xA9", "\xE2\x82",  "\xF0\x9F"};
  for (const std::string& input : inputs) {
    const std::string record = FormatLogRecord(LogFormat::kJson, Example(), LogLevel::kInfo, input);
    ASSERT_EQ(record.back(), '\n');
    ASSERT_EQ(record.find('\n'), record.size() - 1) << "one line per record";
    nlohmann::json parsed;
    ASSERT_NO_THROW(parsed = nlohmann::json::parse(record)) << record;
    EXPECT_EQ(parsed["level"], "INFO");
    EXPECT_EQ(parsed["logger"], "layerserve");
    EXPECT_EQ(parsed["time"], "2026-11-23T15:04:05.123Z");
  }
  EXPECT_EQ(nlohmann::json::parse(FormatLogRecord(LogFormat::kJson, Example(), LogLevel::kInfo,
                                                  "quote\"backslash\\\x01\xC3\xA9"))["msg"],
            "quote\"backslash\\\x01\xC3\xA9");
}

// Sends fd 2 to a file while alive; the file's text on Read().
class CapturedStderr {
 public:
  CapturedStderr() : path_(::testing::TempDir() + "log_test_" + std::to_string(getpid())) {
    const int fd = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    saved_ = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
  }
  ~CapturedStderr() {
    Restore();
    std::remove(path_.c_str());
  }
  std::string Read() {
    Restore();
    std::ifstream in(path_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  void Restore() {
    if (saved_ < 0) return;
    dup2(saved_, STDERR_FILENO);
    close(saved_);
    saved_ = -1;
  }
  std::string path_;
  int saved_ = -1;
};

// Restores the text format at the end of a test that changes it.
class LogTest : public ::testing::Test {
 protected:
  void TearDown() override { SetLogFormat(LogFormat::kText); }
};

TEST_F(LogTest, LinesFromManyThreadsNeverInterleave) {
  SetLogFormat(LogFormat::kJson);
  constexpr int kThreads = 8, kLines = 500;
  CapturedStderr captured;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      // Long enough (about 5 KB) that a split write would show.
      const std::string filler(5000, static_cast<char>('a' + t));
      for (int i = 0; i < kLines; ++i) LogInfo(absl::StrCat(t, " ", i, " ", filler));
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::string text = captured.Read();
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), static_cast<size_t>(kThreads * kLines));
  std::vector<int> next(kThreads, 0);
  for (const std::string& line : lines) {
    nlohmann::json record;
    ASSERT_NO_THROW(record = nlohmann::json::parse(line)) << line.substr(0, 200);
    const std::string msg = record["msg"];
    const std::vector<std::string> parts = absl::StrSplit(msg, ' ');
    ASSERT_EQ(parts.size(), 3u);
    const int t = std::stoi(parts[0]);
    ASSERT_TRUE(t >= 0 && t < kThreads);
    EXPECT_EQ(std::stoi(parts[1]), next[t]++) << "each thread's lines in its order";
    EXPECT_EQ(parts[2], std::string(5000, static_cast<char>('a' + t)));
  }
}

TEST_F(LogTest, LogWritesTheFormatSet) {
  CapturedStderr captured;
  LogWarning("as text");
  SetLogFormat(LogFormat::kJson);
  LogError("as json");
  const std::vector<std::string> lines = absl::StrSplit(captured.Read(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_TRUE(lines[0].ends_with("Z WARNING layerserve: as text")) << lines[0];
  const nlohmann::json record = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(record["level"], "ERROR");
  EXPECT_EQ(record["msg"], "as json");
}

TEST_F(LogTest, LogStreamLogsEachLine) {
  CapturedStderr captured;
  {
    LogStream log(LogLevel::kWarning);
    log << "gemm " << 1024 << "x" << 4096 << std::endl;
    log << "two\nlines\n";
    log << "unfinished";
  }
  const std::vector<std::string> lines = absl::StrSplit(captured.Read(), '\n');
  ASSERT_EQ(lines.size(), 5u);  // four records and the empty rest after the last '\n'
  EXPECT_TRUE(lines[0].ends_with(" WARNING layerserve: gemm 1024x4096")) << lines[0];
  EXPECT_TRUE(lines[1].ends_with(" WARNING layerserve: two")) << lines[1];
  EXPECT_TRUE(lines[2].ends_with(" WARNING layerserve: lines")) << lines[2];
  EXPECT_TRUE(lines[3].ends_with(" WARNING layerserve: unfinished")) << lines[3];
  EXPECT_EQ(lines[4], "");
}

}  // namespace
}  // namespace layerserve
