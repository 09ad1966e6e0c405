// Tests of client/npy.h: files written by NumPy 2.x (embedded bytes, format
// 1.0 and 2.0) parse, what we write is byte-identical to NumPy's np.save,
// round trips through files, and every malformed input is a clear
// INVALID_ARGUMENT rather than a crash or a silent misread.
#include "client/npy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

namespace layerserve::client {
namespace {

std::string FromHex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

// np.save(f, np.arange(3, dtype='<f4'))
const std::string kNumpyArange3 = FromHex(
    "934e554d5059010076007b276465736372273a20273c6634272c2027666f727472616e5f6f72646572273a2046"
    "616c73652c20277368617065273a2028332c292c207d2020202020202020202020202020202020202020202020"
    "202020202020202020202020202020202020202020202020202020202020202020202020200a00000000000080"
    "3f00000040");

// np.lib.format.write_array(f, np.array([[1, 2]], dtype='<u2'), version=(2, 0))
const std::string kNumpyV2U2 = FromHex(
    "934e554d50590200740000007b276465736372273a20273c7532272c2027666f727472616e5f6f72646572273a"
    "2046616c73652c20277368617065273a2028312c2032292c207d20202020202020202020202020202020202020"
    "202020202020202020202020202020202020202020202020202020202020202020202020200a01000200");

// A v1.0 file with the given header dict and data.
std::string MakeNpy(std::string header, std::string_view data) {
  header += '\n';
  std::string out = "\x93NUMPY";
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  return out + header + std::string(data);
}

void ExpectInvalid(std::string_view bytes, std::string_view message_part) {
  absl::StatusOr<NpyArray> array = ParseNpy(bytes);
  ASSERT_FALSE(array.ok()) << "parsed although malformed: " << message_part;
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument) << array.status();
  EXPECT_NE(std::string(array.status().message()).find(message_part), std::string::npos)
      << "message '" << array.status().message() << "' lacks '" << message_part << "'";
}

TEST(NpyTest, ParsesNumpyVersion1) {
  absl::StatusOr<NpyArray> array = ParseNpy(kNumpyArange3);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->descr, "<f4");
  EXPECT_EQ(array->shape, std::vector<int64_t>({3}));
  ASSERT_EQ(array->data.size(), 12u);
  float values[3];
  std::memcpy(values, array->data.data(), 12);
  EXPECT_EQ(values[0], 0.0f);
  EXPECT_EQ(values[1], 1.0f);
  EXPECT_EQ(values[2], 2.0f);
}

TEST(NpyTest, ParsesNumpyVersion2) {
  absl::StatusOr<NpyArray> array = ParseNpy(kNumpyV2U2);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->descr, "<u2");
  EXPECT_EQ(array->shape, std::vector<int64_t>({1, 2}));
  EXPECT_EQ(array->data, std::string("\x01\x00\x02\x00", 4));
}

TEST(NpyTest, SerializesExactlyAsNumpy) {
  absl::StatusOr<NpyArray> array = ParseNpy(kNumpyArange3);
  ASSERT_TRUE(array.ok());
  absl::StatusOr<std::string> bytes = SerializeNpy(*array);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, kNumpyArange3);
}

TEST(NpyTest, RoundTripsShapesAndDtypes) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {0, 3}, {5}, {2, 3}, {1, 1, 7}, {2, 3, 4}};
  for (const char* descr : {"<f4", "<f2", "<u2"}) {
    for (const auto& shape : shapes) {
      size_t count = 1;
      for (int64_t d : shape) count *= static_cast<size_t>(d);
      NpyArray array{descr, shape, std::string(count * (descr[2] == '4' ? 4 : 2), '\0')};
      for (size_t i = 0; i < array.data.size(); ++i) array.data[i] = static_cast<char>(i * 37);
      absl::StatusOr<std::string> bytes = SerializeNpy(array);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ((bytes->size() - array.data.size()) % 64, 0u) << "data not 64-byte aligned";
      absl::StatusOr<NpyArray> back = ParseNpy(*bytes);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->descr, array.descr);
      EXPECT_EQ(back->shape, array.shape);
      EXPECT_EQ(back->data, array.data);
    }
  }
}

TEST(NpyTest, LongHeaderUsesVersion2) {
  NpyArray array{"<f4", std::vector<int64_t>(30000, 1), std::string(4, '\x11')};
  absl::StatusOr<std::string> bytes = SerializeNpy(array);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ((*bytes)[6], 2) << "a header over 65535 bytes needs format 2.0";
  absl::StatusOr<NpyArray> back = ParseNpy(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape.size(), 30000u);
  EXPECT_EQ(back->data, array.data);
}

TEST(NpyTest, FilesRoundTripAndMissingFileIsNotFound) {
  const std::filesystem::path dir = testing::TempDir();
  const std::filesystem::path path = dir / "npy_test_roundtrip.npy";
  NpyArray array{"<f2", {2, 2}, std::string("\x00\x3c\x00\xc0\x00\x00\xff\x7b", 8)};
  ASSERT_TRUE(WriteNpyFile(path, array).ok());
  absl::StatusOr<NpyArray> back = ReadNpyFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->data, array.data);
  std::filesystem::remove(path);
  absl::StatusOr<NpyArray> missing = ReadNpyFile(dir / "npy_test_does_not_exist.npy");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("npy_test_does_not_exist"),
            std::string::npos);
}

TEST(NpyTest, MalformedFilesAreRejected) {
  const std::string four_floats(16, '\0');
  ExpectInvalid("", "magic");
  ExpectInvalid("PK\x03\x04 not numpy at all", "magic");
  ExpectInvalid(std::string("\x93NUMPY\x01", 7), "magic");
  ExpectInvalid(std::string("\x93NUMPY\x01\x00\x05", 9), "truncated");
  ExpectInvalid(std::string("\x93NUMPY\x04\x00\x00\x00", 10), "version 4.0");
  {
    std::string bytes =
        MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", four_floats);
    bytes[8] = '\xff';  // header length beyond the file
    bytes[9] = '\x7f';
    ExpectInvalid(bytes, "header claims");
  }
  ExpectInvalid(MakeNpy("['descr', '<f4']", four_floats), "expected '{'");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'shape': (4,), }", four_floats), "fortran_order");
  ExpectInvalid(MakeNpy("{'fortran_order': False, 'shape': (4,), }", four_floats), "descr");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, }", four_floats), "shape");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", four_floats),
                "Fortran order");
  ExpectInvalid(MakeNpy("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", four_floats),
                "big-endian");
  ExpectInvalid(MakeNpy("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", four_floats),
                "'<f8'");
  ExpectInvalid(MakeNpy("{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", four_floats),
                "'<i4'");
  ExpectInvalid(
      MakeNpy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", four_floats),
      "malformed .npy header");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (-4,), }", four_floats),
                "non-negative integer");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, }", four_floats),
                "malformed .npy header");
  ExpectInvalid(MakeNpy("{'descr': '<f4, 'fortran_order': False, 'shape': (4,), }", four_floats),
                "malformed .npy header");
  ExpectInvalid(
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } extra", four_floats),
      "trailing");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", four_floats),
                "truncated");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", four_floats),
                "needs 12");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, "
                        "'shape': (4294967296, 4294967296, 4294967296), }",
                        four_floats),
                "overflows");
  ExpectInvalid(MakeNpy("{'descr': '<f4', 'fortran_order': False, "
                        "'shape': (99999999999999999999,), }",
                        four_floats),
                "too large");
}

TEST(NpyTest, DtypesMapToDatatypes) {
  EXPECT_EQ(*DatatypeForDescr("<f4"), "FP32");
  EXPECT_EQ(*DatatypeForDescr("<f2"), "FP16");
  EXPECT_EQ(*DatatypeForDescr("<u2"), "BF16");
  EXPECT_FALSE(DatatypeForDescr("<i8").ok());
  EXPECT_EQ(*DescrForDatatype("BF16"), "<u2");
  EXPECT_EQ(DescrForDatatype("INT32").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, TensorConversionKeepsOrConvertsDatatype) {
  // bf16 bit patterns of 1.0 and -2.0.
  NpyArray bf16{"<u2", {1, 2}, std::string("\x80\x3f\x00\xc0", 4)};
  absl::StatusOr<Tensor> natural = NpyToTensor(bf16);
  ASSERT_TRUE(natural.ok()) << natural.status();
  EXPECT_EQ(natural->datatype, "BF16");
  EXPECT_EQ(natural->data, bf16.data);

  absl::StatusOr<Tensor> as_fp32 = NpyToTensor(bf16, "FP32");
  ASSERT_TRUE(as_fp32.ok()) << as_fp32.status();
  ASSERT_EQ(as_fp32->data.size(), 8u);
  float values[2];
  std::memcpy(values, as_fp32->data.data(), 8);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -2.0f);

  absl::StatusOr<NpyArray> back = TensorToNpy(*as_fp32);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->descr, "<f4");
  EXPECT_EQ(back->shape, std::vector<int64_t>({1, 2}));

  EXPECT_FALSE(NpyToTensor(bf16, "INT8").ok());
  EXPECT_FALSE(TensorToNpy(Tensor{"FP32", {3}, std::string(8, '\0')}).ok());
  EXPECT_FALSE(TensorToNpy(Tensor{"INT32", {2}, std::string(8, '\0')}).ok());
}

}  // namespace
}  // namespace layerserve::client
