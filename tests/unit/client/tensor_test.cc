// Tests of the client's element conversions (client/tensor.h): exhaustive
// round trips over every FP16 / BF16 bit pattern, the IEEE rounding corner
// cases, and the tensor-level size checks.
#include "client/tensor.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/match.h"

namespace layerserve::client {
namespace {

bool IsHalfNan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool IsBf16Nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

TEST(HalfTest, EveryBitPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = HalfBitsToFloat(bits);
    if (IsHalfNan(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(IsHalfNan(FloatToHalfBits(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToHalfBits(f), bits) << "half 0x" << std::hex << h << " -> " << f;
  }
}

TEST(HalfTest, KnownValuesAndRounding) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalfBits(65519.0f), 0x7bff);  // just below the rounding boundary
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);  // ties away from max to infinity (even)
  EXPECT_EQ(FloatToHalfBits(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);         // tie -> even (zero)
  EXPECT_EQ(FloatToHalfBits(std::ldexp(3.0f, -26)), 0x0001);         // above the tie
  EXPECT_EQ(FloatToHalfBits(std::ldexp(3.0f, -25)), 0x0002);         // tie 1.5 ulp -> 2
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1023.5f, -24)), 0x0400);      // subnormal carries to normal
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_TRUE(IsHalfNan(FloatToHalfBits(std::numeric_limits<float>::quiet_NaN())));
}

TEST(HalfTest, RandomFloatsRoundToNearest) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-26.0f, 16.5f);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::exp2(exponent(rng)) * (i % 2 ? -1.0f : 1.0f);
    const uint16_t h = FloatToHalfBits(f);
    const double got = HalfBitsToFloat(h);
    if (std::isinf(got)) {
      ASSERT_GE(std::fabs(f), 65520.0f);
      continue;
    }
    const double err = std::fabs(got - f);
    // No neighbouring half value is closer.
    for (int step : {-1, 1}) {
      const uint16_t neighbour = static_cast<uint16_t>(h + step);
      const double other = HalfBitsToFloat(neighbour);
      if ((neighbour & 0x7fffu) >= 0x7c00u || ((h & 0x7fffu) == 0 && step < 0)) continue;
      ASSERT_LE(err, std::fabs(other - f)) << "f=" << f << " half=0x" << std::hex << h;
    }
  }
}

TEST(Bf16Test, EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f = Bf16BitsToFloat(bits);
    if (IsBf16Nan(bits)) {
      ASSERT_TRUE(IsBf16Nan(FloatToBf16Bits(f))) << std::hex << b;
      continue;
    }
    ASSERT_EQ(FloatToBf16Bits(f), bits) << "bf16 0x" << std::hex << b;
  }
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16Bits(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie -> even
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(3.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.0f, -9) * 1.5f), 0x3f80);
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  // A NaN whose payload lives only in the low bits must stay NaN.
  EXPECT_TRUE(IsBf16Nan(FloatToBf16Bits(std::bit_cast<float>(0x7f800001u))));
}

TEST(TensorTest, NumElementsRejectsNegativeAndOverflow) {
  EXPECT_EQ(Tensor({"FP32", {2, 3, 4}, {}}).NumElements(), 24);
  EXPECT_EQ(Tensor({"FP32", {2, 0, 4}, {}}).NumElements(), 0);
  EXPECT_EQ(Tensor({"FP32", {2, -1}, {}}).NumElements(), std::nullopt);
  EXPECT_EQ(Tensor({"FP32", {int64_t{1} << 40, int64_t{1} << 40}, {}}).NumElements(), std::nullopt);
}

TEST(TensorTest, DatatypeSizes) {
  EXPECT_EQ(DatatypeByteSize("FP32"), 4u);
  EXPECT_EQ(DatatypeByteSize("BF16"), 2u);
  EXPECT_EQ(DatatypeByteSize("FP16"), 2u);
  EXPECT_EQ(DatatypeByteSize("INT64"), 8u);
  EXPECT_EQ(DatatypeByteSize("BYTES"), std::nullopt);
  EXPECT_EQ(DatatypeByteSize("FOO"), std::nullopt);
}

TEST(TensorTest, FloatsRoundTripThroughEachDatatype) {
  const std::vector<float> values = {0.0f, 1.0f, -2.5f, 0.125f, 3.0f, -0.75f};
  for (const char* datatype : {"FP32", "FP16", "BF16"}) {
    absl::StatusOr<Tensor> tensor = FloatsToTensor(values, {2, 3}, datatype);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    EXPECT_EQ(tensor->data.size(), 6 * *DatatypeByteSize(datatype));
    absl::StatusOr<std::vector<float>> back = TensorToFloats(*tensor);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, values) << datatype;  // all exactly representable
  }
}

// A finite value the datatype cannot hold is refused, naming it, rather than
// sent as infinity (issue 37: layerctl turned 70000 into inf for FP16);
// 65504 and 65519 (which rounds to it) pass, and infinities stay infinities.
TEST(TensorTest, FiniteValuesOutsideTheRangeAreRefused) {
  const absl::StatusOr<Tensor> over =
      FloatsToTensor(std::vector<float>{1.0f, 70000.0f}, {2}, "FP16");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "element 1 (70000)")) << over.status();
  EXPECT_EQ(FloatsToTensor(std::vector<float>{-65520.0f}, {1}, "FP16").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FloatsToTensor(std::vector<float>{3.4e38f}, {1}, "BF16").status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<float> edges = {65504.0f, -65519.0f, std::numeric_limits<float>::infinity()};
  const absl::StatusOr<Tensor> held = FloatsToTensor(edges, {3}, "FP16");
  ASSERT_TRUE(held.ok()) << held.status();
  const absl::StatusOr<std::vector<float>> back = TensorToFloats(*held);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back,
            (std::vector<float>{65504.0f, -65504.0f, std::numeric_limits<float>::infinity()}));
}

TEST(TensorTest, SizeAndTypeErrors) {
  EXPECT_EQ(FloatsToTensor(std::vector<float>(5), {2, 3}, "FP32").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FloatsToTensor(std::vector<float>(6), {2, 3}, "INT32").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorToFloats(Tensor{"FP16", {3}, std::string(5, '\0')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorToFloats(Tensor{"INT32", {1}, std::string(4, '\0')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorToFloats(Tensor{"FP32", {-1}, ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layerserve::client
