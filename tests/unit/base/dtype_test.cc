// Element conversions must round exactly as torch does (round to nearest
// even), since a bf16 client compares our output bit for bit with its own;
// float8_e4m3fn exactly as ml_dtypes does (the FP8 formats' reference).
#include "base/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace layerserve {
namespace {

TEST(DTypeTest, ProtocolNamesRoundTrip) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    EXPECT_EQ(ParseProtocolDType(DTypeProtocolName(t)), t);
  }
  EXPECT_FALSE(ParseProtocolDType("INT32").has_value());
  EXPECT_FALSE(ParseProtocolDType("fp32").has_value());
  EXPECT_EQ(ParseSafetensorsDType("BF16"), DType::kBF16);
  EXPECT_FALSE(ParseSafetensorsDType("I64").has_value());
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6: goes up.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

TEST(DTypeTest, Fp16KnownValues) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);                      // rounds to inf
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -26)), 0x0000);         // rounds to zero
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_FLOAT_EQ(Fp16ToFloat(0x3555), 0.333251953125f);
  EXPECT_FLOAT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
}

TEST(DTypeTest, Fp16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = Fp16ToFloat(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), bits) << "fp16 bits 0x" << std::hex << h;
  }
}

TEST(DTypeTest, BulkConversionsMatchScalar) {
  const float src[5] = {0.1f, -3.25f, 1e-3f, 7.0f, -0.0f};
  unsigned char buf[20];
  float back[5];
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    ConvertFromFloat(src, 5, t, buf);
    ConvertToFloat(t, buf, 5, back);
    for (int i = 0; i < 5; ++i) {
      const float expected = t == DType::kF32   ? src[i]
                             : t == DType::kF16 ? Fp16ToFloat(FloatToFp16(src[i]))
                                                : Bf16ToFloat(FloatToBf16(src[i]));
      EXPECT_EQ(back[i], expected) << DTypeProtocolName(t) << " element " << i;
    }
  }
}

}  // namespace
}  // namespace layerserve

namespace layerserve {
namespace {

// Every pair ml_dtypes wrote (tests/support/make_fp8_golden.py): the ties
// between neighbours, the values just beside them, every e4m3 value and
// random ones, both signs.
TEST(DTypeTest, Fp8E4M3IsBitExactWithMlDtypes) {
  std::ifstream golden(LAYERSERVE_FP8_GOLDEN);
  ASSERT_TRUE(golden.good()) << "cannot read " << LAYERSERVE_FP8_GOLDEN;
  std::string line;
  int checked = 0, wrong = 0;
  while (std::getline(golden, line)) {
    if (line.empty() || line[0] == '#') continue;
    uint32_t bits = 0;
    unsigned code = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "%x %x", &bits, &code), 2) << line;
    const float x = std::bit_cast<float>(bits);
    const uint8_t got = FloatToFp8E4M3(x);
    if (got != code && ++wrong <= 10) {
      ADD_FAILURE() << "FloatToFp8E4M3(" << x << ") = 0x" << std::hex << int{got}
                    << ", ml_dtypes 0x" << code;
    }
    ++checked;
  }
  EXPECT_GT(checked, 7000);
  EXPECT_EQ(wrong, 0) << "of " << checked;
}

TEST(DTypeTest, Fp8E4M3DecodesEveryCodeAndRoundTrips) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = Fp8E4M3ToFloat(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(FloatToFp8E4M3(v), code) << "code 0x" << std::hex << c << " = " << v;
  }
}

TEST(DTypeTest, Fp8E4M3SaturatesAndKeepsNaN) {
  for (const float big : {464.0f, 465.0f, 480.0f, 1e30f, INFINITY}) {
    EXPECT_EQ(FloatToFp8E4M3(big), 0x7e) << big;
    EXPECT_EQ(FloatToFp8E4M3(-big), 0xfe) << -big;
  }
  EXPECT_EQ(FloatToFp8E4M3(NAN), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(-NAN), 0xff);
  // Ties to even: 2^-10 lies between 0 and 2^-9, 1 + 1/16 between 1 and 1 + 1/8.
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);
  std::vector<float> values = {0.5f, -3.25f, 300.0f};
  std::vector<unsigned char> bytes(3);
  ConvertFromFloat(values.data(), 3, DType::kF8E4M3, bytes.data());
  std::vector<float> back(3);
  ConvertToFloat(DType::kF8E4M3, bytes.data(), 3, back.data());
  EXPECT_EQ(back, (std::vector<float>{0.5f, -3.25f, 288.0f}));
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(ParseSafetensorsDType("F8_E4M3"), DType::kF8E4M3);
  EXPECT_EQ(ParseProtocolDType("F8_E4M3"), std::nullopt);  // never on the wire
}

}  // namespace
}  // namespace layerserve
