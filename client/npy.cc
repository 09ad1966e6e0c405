// .npy reading and writing (see npy.h). The header is a Python dict literal;
// HeaderParser accepts the subset NumPy writes (string keys, string / bool /
// int-tuple values) and reports anything else as a malformed header.
#include "client/npy.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace layerserve::client {
namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr size_t kAlignment = 64;

using HeaderValue = std::variant<std::string, bool, std::vector<int64_t>>;

class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  absl::StatusOr<std::map<std::string, HeaderValue>> ParseDict() {
    std::map<std::string, HeaderValue> dict;
    if (!Consume('{')) return Error("expected '{'");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      absl::StatusOr<std::string> key = ParseString();
      if (!key.ok()) return key.status();
      if (!Consume(':')) return Error("expected ':' after a key");
      absl::StatusOr<HeaderValue> value = ParseValue();
      if (!value.ok()) return value.status();
      dict[*key] = *std::move(value);
      if (Consume(',')) continue;
      if (Consume('}')) break;
      return Error("expected ',' or '}'");
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters after the dict");
    return dict;
  }

 private:
  void SkipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool ConsumeWord(std::string_view word) {
    SkipSpace();
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("malformed .npy header at offset ", pos_, ": ",
                                                   std::string(what), " in \"", std::string(text_),
                                                   "\""));
  }

  absl::StatusOr<std::string> ParseString() {
    SkipSpace();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return Error("expected a quoted string");
    }
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) return Error("unterminated string");
    std::string value(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return value;
  }

  absl::StatusOr<HeaderValue> ParseValue() {
    SkipSpace();
    if (pos_ < text_.size() && (text_[pos_] == '\'' || text_[pos_] == '"')) {
      absl::StatusOr<std::string> s = ParseString();
      if (!s.ok()) return s.status();
      return HeaderValue(*std::move(s));
    }
    if (ConsumeWord("True")) return HeaderValue(true);
    if (ConsumeWord("False")) return HeaderValue(false);
    if (Consume('(')) return ParseTupleRest();
    return Error("expected a string, True, False or a tuple");
  }

  absl::StatusOr<HeaderValue> ParseTupleRest() {
    std::vector<int64_t> dims;
    while (true) {
      if (Consume(')')) break;
      SkipSpace();
      const size_t start = pos_;
      int64_t dim = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        const int digit = text_[pos_] - '0';
        if (dim > (std::numeric_limits<int64_t>::max() - digit) / 10) {
          return Error("dimension too large");
        }
        dim = dim * 10 + digit;
        ++pos_;
      }
      if (pos_ == start) return Error("expected a non-negative integer dimension");
      Consume('L');  // Python 2 long suffix, written by old NumPy
      dims.push_back(dim);
      if (Consume(',')) continue;
      if (Consume(')')) break;
      return Error("expected ',' or ')' in shape");
    }
    return HeaderValue(std::move(dims));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<size_t> ElementSize(std::string_view descr) {
  if (descr == "<f4") return 4;
  if (descr == "<f2" || descr == "<u2") return 2;
  if (!descr.empty() && descr[0] == '>') {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported .npy dtype '", std::string(descr),
                     "': big-endian data (use little-endian <f4, <f2, <u2)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported .npy dtype '", std::string(descr),
                   "': expected <f4 (float32), <f2 (float16) or <u2 (bfloat16 bit patterns)"));
}

absl::StatusOr<size_t> DataBytes(const std::vector<int64_t>& shape, size_t element_size) {
  size_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return absl::InvalidArgumentError("negative dimension in .npy shape");
    if (dim != 0 &&
        count > std::numeric_limits<size_t>::max() / element_size / static_cast<size_t>(dim)) {
      return absl::InvalidArgumentError(absl::StrCat(".npy shape (", absl::StrJoin(shape, ", "),
                                                     ") overflows the address space"));
    }
    count *= static_cast<size_t>(dim);
  }
  return count * element_size;
}

}  // namespace

absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes) {
  if (bytes.size() < kMagic.size() + 2 || bytes.substr(0, kMagic.size()) != kMagic) {
    return absl::InvalidArgumentError("not a .npy file (missing \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  size_t header_len_bytes;
  if (major == 1) {
    header_len_bytes = 2;
  } else if (major == 2 || major == 3) {
    header_len_bytes = 4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported .npy format version ", major, ".", minor, " (1.0-3.0 known)"));
  }
  const size_t prefix = 8 + header_len_bytes;
  if (bytes.size() < prefix)
    return absl::InvalidArgumentError(".npy file truncated in its preamble");
  size_t header_len = 0;
  for (size_t i = 0; i < header_len_bytes; ++i) {
    header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
  }
  if (bytes.size() - prefix < header_len) {
    return absl::InvalidArgumentError(absl::StrCat(".npy header claims ", header_len,
                                                   " bytes but the file has only ",
                                                   bytes.size() - prefix, " after the preamble"));
  }
  HeaderParser parser(bytes.substr(prefix, header_len));
  absl::StatusOr<std::map<std::string, HeaderValue>> dict = parser.ParseDict();
  if (!dict.ok()) return dict.status();

  NpyArray array;
  auto descr = dict->find("descr");
  auto fortran = dict->find("fortran_order");
  auto shape = dict->find("shape");
  if (descr == dict->end() || !std::holds_alternative<std::string>(descr->second)) {
    return absl::InvalidArgumentError(
        ".npy header lacks a string 'descr' (structured dtypes are not supported)");
  }
  if (fortran == dict->end() || !std::holds_alternative<bool>(fortran->second)) {
    return absl::InvalidArgumentError(".npy header lacks a boolean 'fortran_order'");
  }
  if (shape == dict->end() || !std::holds_alternative<std::vector<int64_t>>(shape->second)) {
    return absl::InvalidArgumentError(".npy header lacks a tuple 'shape'");
  }
  if (std::get<bool>(fortran->second)) {
    return absl::InvalidArgumentError(
        ".npy array is in Fortran order; save it with np.ascontiguousarray first");
  }
  array.descr = std::get<std::string>(descr->second);
  array.shape = std::get<std::vector<int64_t>>(shape->second);
  absl::StatusOr<size_t> element_size = ElementSize(array.descr);
  if (!element_size.ok()) return element_size.status();
  absl::StatusOr<size_t> data_bytes = DataBytes(array.shape, *element_size);
  if (!data_bytes.ok()) return data_bytes.status();
  const std::string_view data = bytes.substr(prefix + header_len);
  if (data.size() != *data_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(".npy data has ", data.size(), " bytes but shape (",
                     absl::StrJoin(array.shape, ", "), ") of ", array.descr, " needs ", *data_bytes,
                     data.size() < *data_bytes ? " (truncated)" : ""));
  }
  array.data = std::string(data);
  return array;
}

absl::StatusOr<std::string> SerializeNpy(const NpyArray& array) {
  absl::StatusOr<size_t> element_size = ElementSize(array.descr);
  if (!element_size.ok()) return element_size.status();
  absl::StatusOr<size_t> data_bytes = DataBytes(array.shape, *element_size);
  if (!data_bytes.ok()) return data_bytes.status();
  if (array.data.size() != *data_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("array data has ", array.data.size(), " bytes, shape needs ", *data_bytes));
  }
  // Python's repr of a 1-tuple needs the trailing comma: (5,).
  std::string shape_text = absl::StrJoin(array.shape, ", ");
  if (array.shape.size() == 1) shape_text += ",";
  std::string header = absl::StrCat("{'descr': '", array.descr,
                                    "', 'fortran_order': False, 'shape': (", shape_text, "), }");
  // Version 1.0 stores the header length in 2 bytes; fall back to 2.0 (4
  // bytes) only when needed, as NumPy does.
  int major = 1;
  size_t prefix = 10;
  if ((prefix + header.size() + 1 + kAlignment - 1) / kAlignment * kAlignment - prefix > 0xffff) {
    major = 2;
    prefix = 12;
  }
  const size_t total = (prefix + header.size() + 1 + kAlignment - 1) / kAlignment * kAlignment;
  header.append(total - prefix - header.size() - 1, ' ');
  header.push_back('\n');

  std::string out(kMagic);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const size_t header_len = header.size();
  for (size_t i = 0; i < prefix - 8; ++i)
    out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xff));
  out += header;
  out += array.data;
  return out;
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path.string()));
  absl::StatusOr<NpyArray> array = ParseNpy(contents.str());
  if (!array.ok()) {
    return absl::Status(array.status().code(),
                        absl::StrCat(path.string(), ": ", array.status().message()));
  }
  return array;
}

absl::Status WriteNpyFile(const std::filesystem::path& path, const NpyArray& array) {
  absl::StatusOr<std::string> bytes = SerializeNpy(array);
  if (!bytes.ok()) return bytes.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot create ", path.string()));
  out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path.string()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> DatatypeForDescr(std::string_view descr) {
  if (descr == "<f4") return std::string("FP32");
  if (descr == "<f2") return std::string("FP16");
  if (descr == "<u2") return std::string("BF16");
  // Every other descr is unsupported; ElementSize explains why.
  return ElementSize(descr).status();
}

absl::StatusOr<std::string> DescrForDatatype(std::string_view datatype) {
  if (datatype == "FP32") return std::string("<f4");
  if (datatype == "FP16") return std::string("<f2");
  if (datatype == "BF16") return std::string("<u2");
  return absl::InvalidArgumentError(absl::StrCat(
      "datatype ", std::string(datatype), " cannot be stored in .npy (FP32, FP16, BF16 can)"));
}

absl::StatusOr<Tensor> NpyToTensor(const NpyArray& array,
                                   std::optional<std::string_view> datatype) {
  absl::StatusOr<std::string> natural = DatatypeForDescr(array.descr);
  if (!natural.ok()) return natural.status();
  Tensor tensor{*natural, array.shape, array.data};
  if (!datatype || *datatype == *natural) return tensor;
  absl::StatusOr<std::vector<float>> values = TensorToFloats(tensor);
  if (!values.ok()) return values.status();
  return FloatsToTensor(*values, array.shape, *datatype);
}

absl::StatusOr<NpyArray> TensorToNpy(const Tensor& tensor) {
  absl::StatusOr<std::string> descr = DescrForDatatype(tensor.datatype);
  if (!descr.ok()) return descr.status();
  absl::StatusOr<size_t> data_bytes = DataBytes(tensor.shape, *DatatypeByteSize(tensor.datatype));
  if (!data_bytes.ok()) return data_bytes.status();
  if (tensor.data.size() != *data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor data has ", tensor.data.size(),
                                                   " bytes, its shape needs ", *data_bytes));
  }
  return NpyArray{*descr, tensor.shape, tensor.data};
}

}  // namespace layerserve::client
