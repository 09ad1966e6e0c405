// EchoForMessage keeps short input whole and cuts long input to a bounded
// prefix that says how much was left out, never splitting a UTF-8 character.
#include "base/echo.h"

#include <gtest/gtest.h>

#include <string>

namespace layerserve {
namespace {

TEST(EchoTest, ShortTextIsUnchanged) {
  EXPECT_EQ(EchoForMessage(""), "");
  EXPECT_EQ(EchoForMessage("FP32"), "FP32");
  const std::string exact(kMaxEchoBytes, 'a');
  EXPECT_EQ(EchoForMessage(exact), exact);
}

TEST(EchoTest, LongTextIsCutWithACount) {
  const std::string huge(1 << 20, 'x');
  const std::string echoed = EchoForMessage(huge);
  EXPECT_EQ(echoed, std::string(kMaxEchoBytes, 'x') + "\xE2\x80\xA6(" +
                        std::to_string((1 << 20) - kMaxEchoBytes) + " more bytes)");
  EXPECT_EQ(EchoForMessage("abcdef", 4), "abcd\xE2\x80\xA6(2 more bytes)");
}

TEST(EchoTest, NeverSplitsAUtf8Character) {
  // "é" is 2 bytes (C3 A9), "€" 3 (E2 82 AC): a cut at 4 bytes would fall
  // inside the euro sign, so it backs off to 3.
  EXPECT_EQ(EchoForMessage("ab\xC3\xA9\xE2\x82\xAC", 4), "ab\xC3\xA9\xE2\x80\xA6(3 more bytes)");
  EXPECT_EQ(EchoForMessage("\xE2\x82\xAC\xE2\x82\xAC", 4),
            "\xE2\x82\xAC\xE2\x80\xA6(3 more bytes)");
  // Invalid UTF-8 (continuation bytes only) still ends within the bound.
  const std::string junk(64, '\x80');
  EXPECT_LE(EchoForMessage(junk, 8).size(), 8 + std::string("\xE2\x80\xA6(64 more bytes)").size());
}

}  // namespace
}  // namespace layerserve
