// The bearer-token primitives the gRPC edge and the metrics endpoint share
// (server/auth/auth_token.h): the token file's rules, the comparison, the parsing of
// an authorization value and of --auth-open. No message may hold the token.
#include "server/auth/auth_token.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace layerserve {
namespace {

class TokenFileTest : public ::testing::Test {
 protected:
  // A file holding exactly `contents`; its path.
  std::string Write(const std::string& contents) {
    const std::string path = ::testing::TempDir() + "/token_" + std::to_string(files_++);
    std::ofstream(path, std::ios::binary) << contents;
    return path;
  }

 private:
  int files_ = 0;
};

TEST_F(TokenFileTest, TrailingWhitespaceIsStripped) {
  for (const char* contents :
       {"s3cret-token", "s3cret-token\n", "s3cret-token\r\n", "s3cret-token \n\n"}) {
    absl::StatusOr<std::string> token = ReadAuthTokenFile(Write(contents));
    ASSERT_TRUE(token.ok()) << token.status();
    EXPECT_EQ(*token, "s3cret-token");
  }
}

TEST_F(TokenFileTest, RefusesWhatCannotBeAToken) {
  const struct {
    std::string contents;
    std::string message;
  } cases[] = {
      {"", "is empty"},
      {"\n \n", "is empty"},
      {"two words\n", "one word of printable ASCII"},
      {" leading-space", "one word of printable ASCII"},
      {"tab\there", "one word of printable ASCII"},
      {"caf\xc3\xa9", "one word of printable ASCII"},
      {std::string(5000, 'x'), "longer than 4096 bytes"},
  };
  for (const auto& c : cases) {
    const std::string path = Write(c.contents);
    absl::StatusOr<std::string> token = ReadAuthTokenFile(path);
    ASSERT_FALSE(token.ok()) << c.message;
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(token.status().message(), "--auth-token-file=" + path))
        << token.status();
    EXPECT_TRUE(absl::StrContains(token.status().message(), c.message)) << token.status();
    if (c.contents.size() > 2) {
      EXPECT_FALSE(absl::StrContains(token.status().message(), c.contents)) << token.status();
    }
  }
}

TEST_F(TokenFileTest, AMissingFileIsNamed) {
  absl::StatusOr<std::string> token = ReadAuthTokenFile("/no/such/token", "--my-flag");
  ASSERT_FALSE(token.ok());
  EXPECT_TRUE(
      absl::StrContains(token.status().message(), "--my-flag=/no/such/token cannot be read"))
      << token.status();
}

TEST(ConstantTimeEqualsTest, EqualOnlyForTheSameBytes) {
  EXPECT_TRUE(ConstantTimeEquals("abc123", "abc123"));
  EXPECT_FALSE(ConstantTimeEquals("abc12", "abc123"));
  EXPECT_FALSE(ConstantTimeEquals("abc1234", "abc123"));
  EXPECT_FALSE(ConstantTimeEquals("abc124", "abc123"));
  EXPECT_FALSE(ConstantTimeEquals("xbc123", "abc123"));
  EXPECT_FALSE(ConstantTimeEquals("", "abc123"));
  // Cycling through the secret must not make a repetition of it equal.
  EXPECT_FALSE(ConstantTimeEquals("abcabc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("", "")) << "an empty secret matches nothing";
  EXPECT_FALSE(ConstantTimeEquals("x", ""));
}

TEST(CheckBearerTest, EachOutcome) {
  const std::string secret = "tok-en_1.2~3+/=";
  const auto check = [&](std::vector<std::string_view> values) {
    return CheckBearer(values, secret);
  };
  EXPECT_EQ(check({"Bearer tok-en_1.2~3+/="}), BearerCheck::kOk);
  EXPECT_EQ(check({"bearer tok-en_1.2~3+/="}), BearerCheck::kOk) << "the scheme has no case";
  EXPECT_EQ(check({"BEARER   tok-en_1.2~3+/=  "}), BearerCheck::kOk);
  EXPECT_EQ(check({}), BearerCheck::kMissing);
  EXPECT_EQ(check({"Bearer tok-en_1.2~3+/=", "Bearer tok-en_1.2~3+/="}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"tok-en_1.2~3+/="}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"Basic dXNlcjpwYXNz"}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"Bearer"}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"Bearer "}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"Bearertok-en_1.2~3+/="}), BearerCheck::kMalformed);
  EXPECT_EQ(check({""}), BearerCheck::kMalformed);
  EXPECT_EQ(check({"Bearer tok-en_1.2~3+/"}), BearerCheck::kWrong);
  EXPECT_EQ(check({"Bearer tok-en_1.2~3+/=x"}), BearerCheck::kWrong);
  EXPECT_EQ(check({"Bearer tok-en_1.2~3+/= x"}), BearerCheck::kWrong);
}

TEST(CheckBearerTest, MessagesSayWhatToSendAndQuoteNothing) {
  EXPECT_EQ(BearerRefusalMessage(BearerCheck::kOk, "metadata"), "");
  EXPECT_EQ(BearerRefusalMessage(BearerCheck::kMissing, "metadata"),
            "this call needs a bearer token: send the metadata 'authorization: Bearer <token>'");
  EXPECT_TRUE(absl::StrContains(BearerRefusalMessage(BearerCheck::kMalformed, "header"),
                                "authorization header"));
  EXPECT_EQ(BearerRefusalMessage(BearerCheck::kWrong, "metadata"), "the bearer token is not valid");
}

TEST(AuthOpenTest, ParsesTheDefaultAndEveryWord) {
  absl::StatusOr<OpenWithoutToken> open = ParseAuthOpen(kDefaultAuthOpen);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_TRUE(open->health && open->live && open->ready && open->metrics);
  EXPECT_FALSE(open->metadata || open->statistics);
  EXPECT_EQ(FormatAuthOpen(*open), kDefaultAuthOpen);
  // The struct's own defaults are the flag's.
  EXPECT_EQ(FormatAuthOpen(OpenWithoutToken{}), kDefaultAuthOpen);

  open = ParseAuthOpen(" statistics , metadata,health ");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(FormatAuthOpen(*open), "health,metadata,statistics");

  open = ParseAuthOpen("none");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(FormatAuthOpen(*open), "none");
}

TEST(AuthOpenTest, RefusesUnknownWords) {
  for (const char* value : {"", "inference", "health,", "none,health", "Health"}) {
    absl::StatusOr<OpenWithoutToken> open = ParseAuthOpen(value);
    ASSERT_FALSE(open.ok()) << value;
    EXPECT_TRUE(absl::StrContains(open.status().message(), "--auth-open")) << open.status();
  }
}

}  // namespace
}  // namespace layerserve
