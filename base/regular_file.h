// Reading a small file a flag or a checkpoint names, refusing anything that
// is not a regular file: opening a FIFO for reading blocks until a writer
// appears (start-up would hang before its first log line, and SIGTERM would
// not end it), and reading a device or a socket never ends.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace layerserve {

// The whole contents of the regular file `path`, at most `max_bytes`. The
// error's message is the reason alone, for the caller to prefix with what
// named the file: "cannot be read: No such file or directory" (NOT_FOUND),
// "cannot be read: <errno text>", "is not a regular file (a directory, FIFO,
// socket or device)" (INVALID_ARGUMENT) or "is larger than N bytes"
// (OUT_OF_RANGE, for callers that say what the file should hold). Opens
// without blocking and never waits for a writer.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes);

}  // namespace layerserve
