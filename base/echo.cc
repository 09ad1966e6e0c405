// Truncation of echoed client input (see echo.h).
#include "base/echo.h"

#include "absl/strings/str_cat.h"

namespace layerserve {

std::string EchoForMessage(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  // Back off while the first byte left out is a continuation byte
  // (10xxxxxx), so a multi-byte character is not split: at most 3 steps for
  // valid UTF-8, and bounded the same for invalid input.
  const auto continuation = [&](size_t i) {
    return (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80;
  };
  size_t cut = max_bytes;
  for (int steps = 0; steps < 3 && cut > 0 && continuation(cut); ++steps) --cut;
  return absl::StrCat(absl::string_view(text.data(), cut), "\xE2\x80\xA6(", text.size() - cut,
                      " more bytes)");
}

}  // namespace layerserve
