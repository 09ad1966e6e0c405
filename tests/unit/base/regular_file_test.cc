// ReadRegularFile: a regular file's contents; a FIFO, a directory or a
// device refused at once (never waiting for a writer); a missing file
// NOT_FOUND; a file over the limit OUT_OF_RANGE.
#include "base/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>

#include "gtest/gtest.h"

namespace layerserve {
namespace {

std::filesystem::path Scratch() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::path(::testing::TempDir()) /
             (std::string("layerserve_") + info->name() + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(RegularFileTest, ReadsAFileUpToItsLimit) {
  const auto dir = Scratch();
  std::ofstream(dir / "f") << "hello\n";
  absl::StatusOr<std::string> text = ReadRegularFile(dir / "f", 6);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "hello\n");
  absl::StatusOr<std::string> over = ReadRegularFile(dir / "f", 5);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kOutOfRange) << over.status();
  EXPECT_EQ(over.status().message(), "is larger than 5 bytes");
  absl::StatusOr<std::string> missing = ReadRegularFile(dir / "none", 5);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_EQ(missing.status().message(), "cannot be read: No such file or directory");
  std::filesystem::remove_all(dir);
}

TEST(RegularFileTest, RefusesAFifoADirectoryAndADeviceAtOnce) {
  const auto dir = Scratch();
  const auto fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  for (const std::filesystem::path& path : {fifo, dir, std::filesystem::path("/dev/zero")}) {
    SCOPED_TRACE(path.string());
    auto read = std::async(std::launch::async, [&] { return ReadRegularFile(path, 1 << 20); });
    if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      // Release the reader (a writer lets a blocked open return), then fail.
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
      FAIL() << "reading blocked";
    }
    const absl::StatusOr<std::string> text = read.get();
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
    EXPECT_EQ(text.status().message(),
              "is not a regular file (a directory, FIFO, socket or device)");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace layerserve
