// Test helpers: a scratch directory per test and a minimal safetensors writer
// (written here from the format description, independent of the reader under
// test), plus raw byte edits for building malformed files.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace layerserve::testing_files {

// A fresh directory under the gtest temp dir, removed when the object dies.
// The pid keeps concurrent runs of the same test (other build trees) apart.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::path(::testing::TempDir()) /
            (std::string("layerserve_") + info->test_suite_name() + "_" + info->name() + "_" +
             std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

struct TensorSpec {
  std::string name;
  std::string dtype;  // safetensors dtype string, e.g. "F32"
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

inline std::vector<unsigned char> F32Bytes(const std::vector<float>& values) {
  std::vector<unsigned char> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// Header JSON for `tensors`, laid out back to back in the data section.
inline nlohmann::json HeaderFor(const std::vector<TensorSpec>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  return header;
}

// File bytes from a header text and the tensors' data (concatenated).
inline std::string FileBytes(const std::string& header_text,
                             const std::vector<TensorSpec>& tensors) {
  std::string out(8, '\0');
  uint64_t len = header_text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  out += header_text;
  for (const TensorSpec& t : tensors) out.append(t.bytes.begin(), t.bytes.end());
  return out;
}

inline std::string SafetensorsBytes(const std::vector<TensorSpec>& tensors) {
  return FileBytes(HeaderFor(tensors).dump(), tensors);
}

inline void WriteFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "writing " << path;
}

}  // namespace layerserve::testing_files
