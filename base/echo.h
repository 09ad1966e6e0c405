// Bounding what an error message repeats of a client's input.
//
// Error messages name the offending value so a client developer can find it,
// but a name or datatype can be a megabyte long, and an echoed megabyte makes
// the status larger than a client's metadata limit (8 KiB in gRPC): the
// client then sees RESOURCE_EXHAUSTED instead of the error the server meant.
// Every client-supplied string goes through EchoForMessage where it is echoed.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace layerserve {

// Longest part of one client string an error message repeats.
inline constexpr size_t kMaxEchoBytes = 128;

// `text` unchanged if it has at most `max_bytes` bytes; otherwise its first
// bytes (cut back to a UTF-8 character boundary, never more than `max_bytes`)
// followed by "…(N more bytes)", N counting everything left out.
std::string EchoForMessage(std::string_view text, size_t max_bytes = kMaxEchoBytes);

}  // namespace layerserve
