#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "flashattn/flashattn.hpp"

namespace flashattn {
namespace {

TEST(Conversions, HalfRoundTripsEveryFiniteValue) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = f16_to_float(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_f16(f), bits) << "half 0x" << std::hex << h;
  }
}

TEST(Conversions, HalfRoundsMidpointsToEven) {
  // Between neighbouring positive halves a < b the midpoint goes to the even mantissa,
  // anything above it to b.
  for (std::uint16_t a = 0; a < 0x7BFF; ++a) {
    const double lo = f16_to_float(a), hi = f16_to_float(static_cast<std::uint16_t>(a + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(float_to_f16(mid), (a % 2 == 0) ? a : a + 1) << "half " << a;
    ASSERT_EQ(float_to_f16(std::nextafter(mid, 1e9f)), a + 1) << "half " << a;
  }
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);  // overflows to +inf
  EXPECT_EQ(float_to_f16(-1e-9f), 0x8000);     // underflows to −0
}

TEST(Conversions, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 is the midpoint between 1 and 1 + 2^-7: ties to the even 1.0.
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3F80);
  EXPECT_EQ(float_to_bf16(std::nextafter(1.00390625f, 2.0f)), 0x3F81);
  // 1 + 3·2^-8 ties to the even 1 + 2^-6.
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = bf16_to_float(static_cast<std::uint16_t>(h));
    if (!std::isnan(f)) ASSERT_EQ(float_to_bf16(f), h);
  }
}

TEST(Conversions, UnitRoundoffIsHalfTheStepAtOne) {
  EXPECT_EQ(unit_roundoff(DType::f32), 0x1p-24);
  EXPECT_EQ(unit_roundoff(DType::bf16), 0x1p-8);
  EXPECT_EQ(unit_roundoff(DType::f16), 0x1p-11);
  EXPECT_EQ(std::nextafter(1.0f, 2.0f) - 1.0f, static_cast<float>(2.0 * unit_roundoff(DType::f32)));
  for (DType dtype : {DType::bf16, DType::f16}) {
    const float u = static_cast<float>(unit_roundoff(dtype));
    EXPECT_EQ(round_to(dtype, 1.0f + u), 1.0f) << to_string(dtype);  // the midpoint ties to even
    EXPECT_EQ(round_to(dtype, 1.0f + 1.5f * u), 1.0f + 2.0f * u) << to_string(dtype);
  }
  EXPECT_THROW(unit_roundoff(DType::i32), Error);
}

TEST(Tensor, GetSetConvertThroughDtype) {
  Tensor t(DType::bf16, {2, 3});
  t.set(4, 3.14159f);
  EXPECT_EQ(t.get(4), round_to(DType::bf16, 3.14159f));
  EXPECT_NE(t.get(4), 3.14159f);
  EXPECT_EQ(t.view().strides[0], 3);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_THROW(Tensor(DType::f32, {2, -1}), Error);
}

TEST(Tensor, ParseDtype) {
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float16"), DType::f16);
  EXPECT_EQ(parse_dtype("f32"), DType::f32);
  try {
    parse_dtype("f64");
    FAIL() << "expected flashattn::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'f64'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flashattn
