// ReadRegularFile (see regular_file.h).
#include "base/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace layerserve {

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once instead of
  // waiting for one; the type check below then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("cannot be read: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(why) : absl::InvalidArgumentError(why);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        "is not a regular file (a directory, FIFO, socket or device)");
  }
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = absl::StrCat("cannot be read: ", std::strerror(errno));
      ::close(fd);
      return absl::InvalidArgumentError(why);
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      ::close(fd);
      return absl::OutOfRangeError(absl::StrCat("is larger than ", max_bytes, " bytes"));
    }
  }
  ::close(fd);
  return text;
}

}  // namespace layerserve
