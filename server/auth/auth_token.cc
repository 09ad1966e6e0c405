// Bearer tokens (see auth_token.h).
#include "server/auth/auth_token.h"

#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/regular_file.h"

namespace layerserve {
namespace {

// A token is a secret of a few dozen bytes; a file far larger than any is a
// wrong path (a certificate bundle, a log), and a value this long would
// crowd a client's 8 KiB metadata limit.
constexpr size_t kMaxTokenBytes = 4096;

constexpr absl::string_view kBearerScheme = "Bearer";

// Debian's Abseil has its own string_view, which its functions take.
absl::string_view Absl(std::string_view text) { return {text.data(), text.size()}; }

}  // namespace

absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path, std::string_view flag) {
  const auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(Absl(flag), "=", path, " ", Absl(why)));
  };
  if (path.empty()) return bad("names no file");
  absl::StatusOr<std::string> read = ReadRegularFile(path, kMaxTokenBytes);
  if (read.status().code() == absl::StatusCode::kOutOfRange) {
    return bad(absl::StrCat("is longer than ", kMaxTokenBytes, " bytes; it should hold the token"));
  }
  if (!read.ok()) return bad(std::string(read.status().message()));
  std::string token = *std::move(read);
  token.erase(token.find_last_not_of(" \t\r\n\f\v") + 1);  // npos + 1 == 0: all blank
  if (token.empty()) return bad("is empty: it must hold the token");
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return bad(
          "holds a space, a control byte or non-ASCII: a token is one word of printable ASCII");
    }
  }
  return token;
}

bool ConstantTimeEquals(std::string_view presented, std::string_view secret) {
  if (secret.empty()) return false;
  // Every byte presented is compared with a byte of the secret (cycling
  // through it) and the differences are ORed, never branched on; volatile
  // keeps the compiler from ending the loop early.
  volatile unsigned char difference = presented.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < presented.size(); ++i) {
    difference = difference | static_cast<unsigned char>(presented[i] ^ secret[i % secret.size()]);
  }
  return difference == 0;
}

BearerCheck CheckBearer(const std::vector<std::string_view>& values, std::string_view secret) {
  if (values.empty()) return BearerCheck::kMissing;
  if (values.size() > 1) return BearerCheck::kMalformed;
  absl::string_view value = absl::StripAsciiWhitespace(Absl(values.front()));
  // RFC 7235: the scheme is case-insensitive; one or more spaces follow it.
  if (value.size() <= kBearerScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearerScheme.size()), kBearerScheme) ||
      value[kBearerScheme.size()] != ' ') {
    return BearerCheck::kMalformed;
  }
  value.remove_prefix(kBearerScheme.size());
  value = absl::StripLeadingAsciiWhitespace(value);
  if (value.empty()) return BearerCheck::kMalformed;
  return ConstantTimeEquals(std::string_view(value.data(), value.size()), secret)
             ? BearerCheck::kOk
             : BearerCheck::kWrong;
}

std::string BearerRefusalMessage(BearerCheck check, std::string_view where) {
  switch (check) {
    case BearerCheck::kOk:
      return "";
    case BearerCheck::kMissing:
      return absl::StrCat("this call needs a bearer token: send the ", Absl(where),
                          " 'authorization: Bearer <token>'");
    case BearerCheck::kMalformed:
      return absl::StrCat("the authorization ", Absl(where),
                          " must be one value of the form 'Bearer <token>'");
    case BearerCheck::kWrong:
      return "the bearer token is not valid";
  }
  return "";
}

absl::StatusOr<OpenWithoutToken> ParseAuthOpen(std::string_view list) {
  OpenWithoutToken open{.health = false,
                        .live = false,
                        .ready = false,
                        .metadata = false,
                        .statistics = false,
                        .metrics = false};
  const absl::string_view stripped = absl::StripAsciiWhitespace(Absl(list));
  if (stripped == "none") return open;
  const std::pair<absl::string_view, bool OpenWithoutToken::*> names[] = {
      {"health", &OpenWithoutToken::health},         {"live", &OpenWithoutToken::live},
      {"ready", &OpenWithoutToken::ready},           {"metadata", &OpenWithoutToken::metadata},
      {"statistics", &OpenWithoutToken::statistics}, {"metrics", &OpenWithoutToken::metrics}};
  for (absl::string_view word : absl::StrSplit(stripped, ',')) {
    word = absl::StripAsciiWhitespace(word);
    bool known = false;
    for (const auto& [name, field] : names) {
      if (word == name) {
        open.*field = true;
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth-open: '", word.substr(0, 32),
                       "' is not one of health, live, ready, metadata, statistics, metrics, "
                       "or none alone"));
    }
  }
  return open;
}

std::string FormatAuthOpen(const OpenWithoutToken& open) {
  std::vector<absl::string_view> words;
  if (open.health) words.push_back("health");
  if (open.live) words.push_back("live");
  if (open.ready) words.push_back("ready");
  if (open.metadata) words.push_back("metadata");
  if (open.statistics) words.push_back("statistics");
  if (open.metrics) words.push_back("metrics");
  return words.empty() ? "none" : absl::StrJoin(words, ",");
}

}  // namespace layerserve
