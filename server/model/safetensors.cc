// safetensors reader: POSIX mmap plus a header validated once at Open() (see
// safetensors.h).
#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace layerserve {
namespace {

// Bytes per element of every dtype the safetensors format defines, so offsets
// of tensors we never compute with are still checked. Sub-byte and unknown
// dtypes return nullopt: their offsets are range-checked only.
std::optional<uint64_t> ElementBytes(std::string_view dtype) {
  if (dtype == "BOOL" || dtype == "U8" || dtype == "I8" || dtype == "F8_E5M2" ||
      dtype == "F8_E4M3" || dtype == "F8_E8M0") {
    return 1;
  }
  if (dtype == "I16" || dtype == "U16" || dtype == "F16" || dtype == "BF16") return 2;
  if (dtype == "I32" || dtype == "U32" || dtype == "F32") return 4;
  if (dtype == "I64" || dtype == "U64" || dtype == "F64") return 8;
  return std::nullopt;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

// The reference safetensors library accepts a file only if its tensors,
// ordered by offset, tile the data section exactly: each starts where the
// previous one ends and the last ends at the end of the file. Anything else
// (bytes after the last tensor, a gap, two tensors sharing bytes) is a file
// transformers would refuse, most likely truncated or concatenated by a
// broken tool, so it is refused here too rather than served.
absl::Status SafetensorsFile::CheckTiling(const std::string& file,
                                          const std::map<std::string, Entry, std::less<>>& entries,
                                          uint64_t data_size) {
  std::vector<std::pair<const std::string*, const Entry*>> by_offset;
  by_offset.reserve(entries.size());
  for (const auto& [tensor_name, entry] : entries) by_offset.emplace_back(&tensor_name, &entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  uint64_t covered = 0;
  for (const auto& [tensor_name, entry] : by_offset) {
    if (entry->begin != covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": tensor '", *tensor_name, "': data_offsets [", entry->begin, ", ", entry->end,
          "] start at ", entry->begin, ", not where the previous tensor ends (", covered,
          "); tensors must tile the data section without gaps or overlaps"));
    }
    covered = entry->end;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": data section is ", data_size, " bytes but its tensors cover ",
                     covered, "; the file has bytes the header does not describe"));
  }
  return absl::OkStatus();
}

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;

  Mapping(void* a, size_t s) : addr(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { munmap(addr, size); }

  const unsigned char* bytes() const { return static_cast<const unsigned char*>(addr); }
};

SafetensorsFile::SafetensorsFile(std::filesystem::path path, std::unique_ptr<Mapping> mapping,
                                 std::map<std::string, Entry, std::less<>> entries,
                                 uint64_t data_start)
    : path_(std::move(path)),
      mapping_(std::move(mapping)),
      entries_(std::move(entries)),
      data_start_(data_start) {}

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::filesystem::path& path) {
  const std::string name = path.string();
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
  // forever (and a signal would not end the wait); it is refused below. The
  // flag has no effect on reading a regular file through mmap.
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    const std::string reason = std::strerror(err);
    // The words of base's ReadRegularFile, which reads the checkpoint's JSON.
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(name, ": cannot be read: ", reason));
    return absl::InvalidArgumentError(absl::StrCat(name, ": cannot be read: ", reason));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string reason = std::strerror(errno);
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(name, ": cannot stat: ", reason));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": is not a regular file (a directory, FIFO, socket or device)"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": file is ", file_size, " bytes, too short for a safetensors header"));
  }
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (addr == MAP_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": mmap failed: ", std::strerror(mmap_errno)));
  }
  auto mapping = std::make_unique<Mapping>(addr, file_size);
  const unsigned char* bytes = mapping->bytes();

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > file_size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header length ", header_len,
                                                   " exceeds the file (", file_size, " bytes)"));
  }
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;

  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  const nlohmann::json header = nlohmann::json::parse(header_begin, header_begin + header_len,
                                                      /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header is not valid JSON"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header is not a JSON object"));
  }

  std::map<std::string, Entry, std::less<>> entries;
  for (const auto& [tensor_name, desc] : header.items()) {
    if (tensor_name == "__metadata__") continue;
    const std::string where = absl::StrCat(name, ": tensor '", tensor_name, "'");
    if (!desc.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": entry is not a JSON object"));
    }
    const auto dtype_it = desc.find("dtype");
    const auto shape_it = desc.find("shape");
    const auto offsets_it = desc.find("data_offsets");
    if (dtype_it == desc.end() || !dtype_it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing or non-string 'dtype'"));
    }
    if (shape_it == desc.end() || !shape_it->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing or non-array 'shape'"));
    }
    if (offsets_it == desc.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": 'data_offsets' must be two non-negative integers"));
    }
    Entry entry;
    entry.dtype = dtype_it->get<std::string>();
    uint64_t num_elements = 1;
    for (const auto& dim : *shape_it) {
      if (!dim.is_number_unsigned()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": shape entries must be non-negative integers"));
      }
      const uint64_t d = dim.get<uint64_t>();
      if (d > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(num_elements, d, &num_elements)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": shape overflows"));
      }
      entry.shape.push_back(static_cast<int64_t>(d));
    }
    entry.begin = (*offsets_it)[0].get<uint64_t>();
    entry.end = (*offsets_it)[1].get<uint64_t>();
    if (entry.begin > entry.end || entry.end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets [", entry.begin, ", ",
                                                     entry.end, "] lie outside the data section (",
                                                     data_size, " bytes)"));
    }
    if (const std::optional<uint64_t> elem = ElementBytes(entry.dtype)) {
      uint64_t expected = 0;
      if (__builtin_mul_overflow(num_elements, *elem, &expected) ||
          expected != entry.end - entry.begin) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": shape ", ShapeString(entry.shape), " of ", entry.dtype, " needs ",
            num_elements, " x ", *elem, " bytes but data_offsets span ", entry.end - entry.begin));
      }
    }
    entries.emplace(tensor_name, std::move(entry));
  }
  LS_RETURN_IF_ERROR(CheckTiling(name, entries, data_size));
  return SafetensorsFile(path, std::move(mapping), std::move(entries), data_start);
}

absl::StatusOr<SafetensorsTensor> SafetensorsFile::Get(std::string_view name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat(path_.string(), ": no tensor named '", ToAbsl(name), "'"));
  }
  const Entry& entry = it->second;
  const std::optional<DType> dtype = ParseSafetensorsDType(entry.dtype);
  if (!dtype) {
    return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": tensor '", ToAbsl(name),
                                                   "' has dtype ", entry.dtype,
                                                   "; only BF16, F16 and F32 are supported"));
  }
  SafetensorsTensor tensor;
  tensor.dtype = *dtype;
  tensor.shape = entry.shape;
  tensor.data = std::span<const unsigned char>(mapping_->bytes() + data_start_ + entry.begin,
                                               entry.end - entry.begin);
  return tensor;
}

bool SafetensorsFile::Contains(std::string_view name) const { return entries_.contains(name); }

std::vector<std::string> SafetensorsFile::Names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

}  // namespace layerserve
