// A read-only view of one .safetensors file.
//
// The file is memory-mapped (POSIX mmap) for the lifetime of the
// SafetensorsFile, so the model loader copies only the tensors of the layers it
// serves. Open() refuses anything but a regular file (a FIFO would block
// start-up) and validates the whole header up front: header length within the
// file, JSON that parses, a known dtype and shape for every entry, data
// offsets that lie within the data section and agree with shape * dtype size,
// and tensors that tile the data section exactly, with no byte before, between
// or after them undescribed (the reference library's rule).
// A tensor whose dtype the server cannot compute with (anything but BF16, F16,
// F32) is an error only when it is requested.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the data section (offsets are relative to it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace layerserve {

// One tensor inside a mapped file. `data` points into the mapping and is valid
// while the SafetensorsFile that returned it is alive; it may be unaligned.
struct SafetensorsTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const unsigned char> data;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`. Errors (NOT_FOUND for a missing file,
  // INVALID_ARGUMENT for a malformed one) name the file.
  static absl::StatusOr<SafetensorsFile> Open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  // NOT_FOUND if absent; INVALID_ARGUMENT if its dtype is not BF16/F16/F32.
  absl::StatusOr<SafetensorsTensor> Get(std::string_view name) const;
  bool Contains(std::string_view name) const;
  // Sorted tensor names.
  std::vector<std::string> Names() const;

  const std::filesystem::path& path() const { return path_; }

 private:
  struct Mapping;
  struct Entry {
    std::string dtype;  // as written in the header
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // offsets into the data section
    uint64_t end = 0;
  };

  // OK if the entries tile [0, data_size) exactly, as the reference library
  // requires; otherwise INVALID_ARGUMENT naming `file` (and the tensor).
  static absl::Status CheckTiling(const std::string& file,
                                  const std::map<std::string, Entry, std::less<>>& entries,
                                  uint64_t data_size);

  SafetensorsFile(std::filesystem::path path, std::unique_ptr<Mapping> mapping,
                  std::map<std::string, Entry, std::less<>> entries, uint64_t data_start);

  std::filesystem::path path_;
  std::unique_ptr<Mapping> mapping_;
  std::map<std::string, Entry, std::less<>> entries_;
  uint64_t data_start_ = 0;  // byte offset of the data section in the file
};

}  // namespace layerserve
