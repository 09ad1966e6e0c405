// The x-session-id header against the request's sequence_id
// (CheckSessionHeader): no header is always fine; one naming the session
// (decimal for an integer id, also as its uint64 bits; the string itself for
// a string id) passes; another session, a header on a stateless request or a
// repeated header is INVALID_ARGUMENT naming both values, with the header's
// value quoted and cut like a string id.
#include "server/grpc/session_header.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace layerserve {
namespace {

std::optional<SessionParams> Session(SessionId id) {
  SessionParams p;
  p.id = std::move(id);
  return p;
}

using Values = std::vector<std::string_view>;

TEST(SessionHeaderTest, NoHeaderIsAlwaysFine) {
  EXPECT_TRUE(CheckSessionHeader({}, std::nullopt).ok());
  EXPECT_TRUE(CheckSessionHeader({}, Session(SessionId(7))).ok());
}

TEST(SessionHeaderTest, AHeaderNamingTheSessionPasses) {
  EXPECT_TRUE(CheckSessionHeader(Values{"7"}, Session(SessionId(7))).ok());
  EXPECT_TRUE(CheckSessionHeader(Values{"-3"}, Session(SessionId(-3))).ok());
  // Triton's uint64 correlation id with the same bits as int64 -1.
  EXPECT_TRUE(CheckSessionHeader(Values{"18446744073709551615"}, Session(SessionId(-1))).ok());
  EXPECT_TRUE(CheckSessionHeader(Values{"chat-42"}, Session(SessionId("chat-42"))).ok());
  // The header is text: "7" routes integer 7 and string "7" alike (two
  // sessions that merely share a replica).
  EXPECT_TRUE(CheckSessionHeader(Values{"7"}, Session(SessionId("7"))).ok());
}

TEST(SessionHeaderTest, AnotherSessionIsInvalidAndNamesBoth) {
  const absl::Status s = CheckSessionHeader(Values{"8"}, Session(SessionId(7)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "header x-session-id is \"8\" but the request's sequence_id is 7"))
      << s;
  const absl::Status t = CheckSessionHeader(Values{"a"}, Session(SessionId("b")));
  EXPECT_TRUE(absl::StrContains(t.message(), "is \"a\" but the request's sequence_id is \"b\""))
      << t;
  // Not a number's other spellings: the header is compared as text.
  EXPECT_FALSE(CheckSessionHeader(Values{"07"}, Session(SessionId(7))).ok());
  EXPECT_FALSE(CheckSessionHeader(Values{"+7"}, Session(SessionId(7))).ok());
  EXPECT_FALSE(CheckSessionHeader(Values{"chat-42 "}, Session(SessionId("chat-42"))).ok());
}

TEST(SessionHeaderTest, AHeaderOnAStatelessRequestIsInvalid) {
  const absl::Status s = CheckSessionHeader(Values{"7"}, std::nullopt);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "names session \"7\" but the request has no "
                                "sequence_id"))
      << s;
}

TEST(SessionHeaderTest, ARepeatedHeaderIsInvalid) {
  const absl::Status s = CheckSessionHeader(Values{"7", "7"}, Session(SessionId(7)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "is given 2 times")) << s;
}

TEST(SessionHeaderTest, ALongHeaderIsQuotedInPart) {
  const std::string value(10000, 'x');
  const absl::Status s = CheckSessionHeader(Values{value}, Session(SessionId(7)));
  EXPECT_FALSE(s.ok());
  EXPECT_LT(s.message().size(), 600u) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "(10000 bytes)")) << s;
}

}  // namespace
}  // namespace layerserve
