// Element conversions must round exactly as torch does (round to nearest
// even), since a bf16 client compares our output bit for bit with its own.
#include "base/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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
