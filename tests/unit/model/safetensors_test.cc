// SafetensorsFile: valid files read back exactly; every kind of malformed file
// is rejected at Open() with a message naming the file (and the tensor).
#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/model/test_files.h"

namespace layerserve {
namespace {

using ::testing::HasSubstr;
using testing_files::F32Bytes;
using testing_files::FileBytes;
using testing_files::HeaderFor;
using testing_files::SafetensorsBytes;
using testing_files::ScratchDir;
using testing_files::TensorSpec;
using testing_files::WriteFile;

std::vector<TensorSpec> TwoTensors() {
  return {
      {"a.weight", "F32", {2, 3}, F32Bytes({1, 2, 3, 4, 5, 6})},
      // bf16 1.0, -2.0
      {"b.bias", "BF16", {2}, {0x80, 0x3f, 0x00, 0xc0}},
  };
}

TEST(SafetensorsTest, ReadsValidFile) {
  ScratchDir dir;
  const auto path = dir.path() / "model.safetensors";
  WriteFile(path, SafetensorsBytes(TwoTensors()));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Names(), (std::vector<std::string>{"a.weight", "b.bias"}));
  EXPECT_TRUE(file->Contains("a.weight"));
  EXPECT_FALSE(file->Contains("__metadata__"));

  auto a = file->Get("a.weight");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(a->data.size(), 24u);
  float values[6];
  std::memcpy(values, a->data.data(), 24);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[5], 6.0f);

  auto b = file->Get("b.bias");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->dtype, DType::kBF16);
  ASSERT_EQ(b->data.size(), 4u);
  EXPECT_EQ(b->data[1], 0x3f);
  EXPECT_EQ(b->data[3], 0xc0);
}

TEST(SafetensorsTest, FileMoveKeepsMappingAlive) {
  ScratchDir dir;
  const auto path = dir.path() / "m.safetensors";
  WriteFile(path, SafetensorsBytes(TwoTensors()));
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SafetensorsFile moved = std::move(*opened);
  auto b = moved.Get("b.bias");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data[3], 0xc0);
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  ScratchDir dir;
  auto file = SafetensorsFile::Open(dir.path() / "absent.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("absent.safetensors"));
}

TEST(SafetensorsTest, MissingTensorIsNotFound) {
  ScratchDir dir;
  const auto path = dir.path() / "model.safetensors";
  WriteFile(path, SafetensorsBytes(TwoTensors()));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto t = file->Get("c.weight");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("model.safetensors"));
  EXPECT_THAT(t.status().message(), HasSubstr("'c.weight'"));
}

// Each malformed variant: file bytes and a fragment the error must contain.
struct MalformedCase {
  std::string label;
  std::string bytes;
  std::string expected_fragment;
};

std::vector<MalformedCase> MalformedCases() {
  const std::vector<TensorSpec> tensors = TwoTensors();
  const std::string valid = SafetensorsBytes(tensors);
  std::vector<MalformedCase> cases;

  cases.push_back({"shorter than the length prefix", valid.substr(0, 5), "too short"});
  cases.push_back({"truncated data", valid.substr(0, valid.size() - 3), "'b.bias'"});

  std::string huge_len = valid;
  huge_len[6] = 0x01;  // header length ~2^48
  cases.push_back({"header length beyond file", huge_len, "header length"});

  const std::string bad_json = "{\"a.weight\": {\"dtype\": \"F32\",";
  cases.push_back({"bad JSON", FileBytes(bad_json, tensors), "not valid JSON"});
  cases.push_back({"header not an object", FileBytes("[1, 2]", tensors), "not a JSON object"});

  nlohmann::json out_of_range = HeaderFor(tensors);
  out_of_range["b.bias"]["data_offsets"] = {24, 400};
  out_of_range["b.bias"]["shape"] = {188};
  cases.push_back({"offsets out of range", FileBytes(out_of_range.dump(), tensors),
                   "lie outside the data section"});

  nlohmann::json reversed = HeaderFor(tensors);
  reversed["a.weight"]["data_offsets"] = {24, 0};
  cases.push_back({"begin after end", FileBytes(reversed.dump(), tensors), "'a.weight'"});

  nlohmann::json mismatch = HeaderFor(tensors);
  mismatch["a.weight"]["shape"] = {3, 3};
  cases.push_back(
      {"shape/size mismatch", FileBytes(mismatch.dump(), tensors), "shape [3, 3] of F32"});

  nlohmann::json overflow = HeaderFor(tensors);
  overflow["a.weight"]["shape"] = {4294967296ull, 4294967296ull};
  cases.push_back({"shape overflow", FileBytes(overflow.dump(), tensors), "overflows"});

  nlohmann::json negative = HeaderFor(tensors);
  negative["a.weight"]["shape"] = {-2, -3};
  cases.push_back({"negative dim", FileBytes(negative.dump(), tensors), "non-negative integers"});

  nlohmann::json no_dtype = HeaderFor(tensors);
  no_dtype["a.weight"].erase("dtype");
  cases.push_back({"missing dtype", FileBytes(no_dtype.dump(), tensors), "'dtype'"});

  nlohmann::json bad_offsets = HeaderFor(tensors);
  bad_offsets["a.weight"]["data_offsets"] = {0};
  cases.push_back({"one offset", FileBytes(bad_offsets.dump(), tensors), "data_offsets"});

  // The reference safetensors library (and so transformers) refuses a data
  // section that the tensors do not tile exactly: bytes after the last
  // tensor, a gap between two, or two tensors sharing bytes.
  cases.push_back({"bytes after the last tensor", valid + std::string(5, '\0'),
                   "data section is 33 bytes but its tensors cover 28"});
  std::vector<TensorSpec> gap_tensors = tensors;
  nlohmann::json gap = HeaderFor(gap_tensors);
  gap["b.bias"]["data_offsets"] = {28, 32};
  gap_tensors[0].bytes.resize(28, 0);  // 4 unclaimed bytes after a.weight
  cases.push_back({"gap between tensors", FileBytes(gap.dump(), gap_tensors),
                   "'b.bias': data_offsets [28, 32] start at 28, not where the previous tensor "
                   "ends (24)"});
  nlohmann::json overlap = HeaderFor(tensors);
  overlap["b.bias"]["data_offsets"] = {20, 24};
  cases.push_back({"overlapping tensors", FileBytes(overlap.dump(), tensors),
                   "'b.bias': data_offsets [20, 24] start at 20"});
  return cases;
}

TEST(SafetensorsTest, RejectsMalformedFiles) {
  ScratchDir dir;
  int index = 0;
  for (const MalformedCase& c : MalformedCases()) {
    SCOPED_TRACE(c.label);
    const auto path = dir.path() / ("bad" + std::to_string(index++) + ".safetensors");
    WriteFile(path, c.bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    EXPECT_THAT(file.status().message(), HasSubstr(path.filename().string()));
    EXPECT_THAT(file.status().message(), HasSubstr(c.expected_fragment));
  }
}

TEST(SafetensorsTest, UnsupportedDtypeFailsOnlyWhenRequested) {
  ScratchDir dir;
  const auto path = dir.path() / "mixed.safetensors";
  std::vector<TensorSpec> tensors = TwoTensors();
  tensors.push_back({"ids", "I64", {2}, std::vector<unsigned char>(16, 0)});
  tensors.push_back({"odd", "Q4_WEIRD", {7}, std::vector<unsigned char>(5, 0)});
  WriteFile(path, SafetensorsBytes(tensors));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->Get("a.weight").ok());
  for (const char* name : {"ids", "odd"}) {
    auto t = file->Get(name);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(t.status().message(), HasSubstr("mixed.safetensors"));
    EXPECT_THAT(t.status().message(), HasSubstr(std::string("'") + name + "'"));
    EXPECT_THAT(t.status().message(), HasSubstr("only BF16, F16 and F32"));
  }
}

TEST(SafetensorsTest, KnownDtypeSizeIsCheckedEvenIfUnsupported) {
  ScratchDir dir;
  const auto path = dir.path() / "i64.safetensors";
  // 2 x I64 needs 16 bytes; give it 12.
  WriteFile(path, SafetensorsBytes({{"ids", "I64", {2}, std::vector<unsigned char>(12, 0)}}));
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("'ids'"));
}

TEST(SafetensorsTest, EmptyTensorAndEmptyHeaderAreValid) {
  ScratchDir dir;
  const auto path = dir.path() / "empty.safetensors";
  WriteFile(path, SafetensorsBytes({{"zero", "F16", {0, 4}, {}}}));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto t = file->Get("zero");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->data.size(), 0u);

  const auto path2 = dir.path() / "nothing.safetensors";
  WriteFile(path2, FileBytes("{}", {}));
  auto file2 = SafetensorsFile::Open(path2);
  ASSERT_TRUE(file2.ok()) << file2.status();
  EXPECT_TRUE(file2->Names().empty());
}

// A FIFO (or any other non-regular file) where the checkpoint should be
// would block open() until a writer appears, so start-up hung forever and
// SIGTERM could not end it: it is refused at once. The open runs on a thread
// so that a regression fails the test instead of hanging it.
TEST(SafetensorsTest, RefusesNonRegularFilesWithoutBlocking) {
  ScratchDir dir;
  const auto fifo = dir.path() / "model.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  auto opened = std::async(std::launch::async, [&] { return SafetensorsFile::Open(fifo); });
  if (opened.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    // Unblock the reader so the test can end, then fail.
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
    FAIL() << "opening a FIFO blocked";
  }
  const absl::StatusOr<SafetensorsFile> file = opened.get();
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("model.safetensors"));
  EXPECT_THAT(file.status().message(), HasSubstr("not a regular file"));

  const absl::StatusOr<SafetensorsFile> directory = SafetensorsFile::Open(dir.path());
  ASSERT_FALSE(directory.ok());
  EXPECT_THAT(directory.status().message(), HasSubstr("not a regular file"));
}

}  // namespace
}  // namespace layerserve
