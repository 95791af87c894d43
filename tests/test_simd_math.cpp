// The polynomial exp2s of the CPU kernels (exact and poly3), on every compiled SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tests/test_simd_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "src/cpu/kernels/simd_math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void Exp2Array(const float* x, float* y, std::size_t n) {
  const hn::ScalableTag<float> df;
  for (std::size_t i = 0; i < n; i += hn::Lanes(df))
    hn::StoreU(Exp2(df, hn::LoadU(df, x + i)), df, y + i);
}

void Exp2Poly3Array(const float* x, float* y, std::size_t n) {
  const hn::ScalableTag<float> df;
  for (std::size_t i = 0; i < n; i += hn::Lanes(df))
    hn::StoreU(Exp2Poly3(df, hn::LoadU(df, x + i)), df, y + i);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include "tests/support/support.hpp"

namespace flashattn::cpu {
HWY_EXPORT(Exp2Array);
HWY_EXPORT(Exp2Poly3Array);
namespace {

// Inputs padded to a whole number of vectors on every target.
std::vector<float> padded(std::vector<float> x, float fill) {
  while (x.size() % 16) x.push_back(fill);
  return x;
}

TEST(SimdMath, Exp2IsWithinTwoUlpOnTheKernelsDomain) {
  // The kernel evaluates 2^(s − m) with s − m ≤ 0; below −126 results are subnormal or 0.
  std::vector<float> x;
  for (float v = -126.0f; v <= 0.0f; v += 0.00731f) x.push_back(v);
  x.push_back(0.0f);
  while (x.size() % 16) x.push_back(-1.0f);
  std::vector<float> y(x.size());
  test::for_each_simd_target([&](const std::string&) {
    HWY_DYNAMIC_DISPATCH(Exp2Array)(x.data(), y.data(), x.size());
    double worst = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double want = std::exp2(static_cast<double>(x[i]));
      worst = std::max(worst, test::abs_difference(y[i], want) / want);
    }
    EXPECT_LE(worst, 2.5e-7);  // about two float ulps
  });
}

TEST(SimdMath, Exp2OfMaskedScoresIsExactlyZero) {
  std::vector<float> x(16, -std::numeric_limits<float>::infinity()), y(16, 1.0f);
  x[1] = -127.0f;
  x[2] = -1000.0f;
  test::for_each_simd_target([&](const std::string&) {
    HWY_DYNAMIC_DISPATCH(Exp2Array)(x.data(), y.data(), x.size());
    for (float v : y) EXPECT_EQ(v, 0.0f);
  });
}

TEST(SimdMath, Exp2KeepsNaN) {
  std::vector<float> x(16, std::nanf("")), y(16, 0.0f);
  x[3] = -1.0f;
  test::for_each_simd_target([&](const std::string&) {
    HWY_DYNAMIC_DISPATCH(Exp2Array)(x.data(), y.data(), x.size());
    for (std::size_t i = 0; i < y.size(); ++i) {
      if (i == 3) {
        EXPECT_FLOAT_EQ(y[i], 0.5f);
      } else {
        EXPECT_TRUE(std::isnan(y[i])) << "lane " << i << " = " << y[i];
      }
    }
  });
}

TEST(SimdMath, Exp2IsBitIdenticalOnTheFmaTargetsAndExactAtIntegers) {
  // Every x from below the underflow to past the overflow clamp, the integers (2^n exactly:
  // p(0) = 1) and the points either side of the rounding boundaries ±1/2, where AVX-512's
  // VSCALEFPS path and AVX2's exponent bits must agree bit for bit. (The 128-bit and scalar
  // targets have no FMA: their Horner steps round twice, so they agree only to the bound of
  // Exp2IsWithinTwoUlpOnTheKernelsDomain.)
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {-inf, inf, std::nanf(""), -1e30f, 1e30f, -126.5f, -127.0f, 127.0f, 127.49f};
  for (float v = -140.0f; v < 140.0f; v += 0.00377f) x.push_back(v);
  for (int n = -130; n <= 130; ++n)
    for (float v : {static_cast<float>(n), static_cast<float>(n) + 0.5f})
      for (float e : {std::nextafter(v, -inf), v, std::nextafter(v, inf)}) x.push_back(e);
  x = padded(x, 0.0f);
  std::vector<float> first, y(x.size());
  test::for_each_simd_target([&](const std::string& target) {
    HWY_DYNAMIC_DISPATCH(Exp2Array)(x.data(), y.data(), x.size());
    for (int n = -126; n <= 127; ++n) {  // normal powers of two
      const float v = static_cast<float>(n);
      const auto at = static_cast<std::size_t>(std::find(x.begin(), x.end(), v) - x.begin());
      EXPECT_EQ(y[at], std::ldexp(1.0f, n)) << "2^" << n << " on " << target;
    }
    if (target.rfind("AVX", 0) != 0) return;
    if (first.empty()) {
      first = y;
      return;
    }
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(first[i]) && std::isnan(y[i])) continue;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(y[i]), std::bit_cast<std::uint32_t>(first[i])) << "x = " << x[i] << " on " << target;
    }
  });
}

TEST(SimdMath, Exp2Poly3IsWithinItsMinimaxBoundOverTheWholeRange) {
  // Every normal result: x from −126 to 127, a dense sweep plus each integer (where
  // floor switches binade) and the points just below it.
  std::vector<float> x;
  for (float v = -126.0f; v < 127.0f; v += 0.000913f) x.push_back(v);
  for (int n = -126; n <= 127; ++n) {
    x.push_back(static_cast<float>(n));
    x.push_back(std::nextafter(static_cast<float>(n), -200.0f));
  }
  x = padded(x, 0.0f);
  std::vector<float> y(x.size());
  test::for_each_simd_target([&](const std::string&) {
    HWY_DYNAMIC_DISPATCH(Exp2Poly3Array)(x.data(), y.data(), x.size());
    double worst = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (x[i] < -126.0f) continue;  // the point below −126 is subnormal: flushed (next test)
      const double want = std::exp2(static_cast<double>(x[i]));
      worst = std::max(worst, test::abs_difference(y[i], want) / want);
    }
    // The fit's 7.48e-5 plus a few float roundings of the Horner steps.
    EXPECT_LE(worst, 7.6e-5);
    EXPECT_GE(worst, 7.0e-5);  // it is a cubic, not the exact exp2 under another name
  });
}

TEST(SimdMath, Exp2Poly3UnderflowsToZeroAndKeepsNaN) {
  const float nan = std::nanf("");
  const std::vector<float> x = padded({-std::numeric_limits<float>::infinity(), -1000.0f, -127.0f, -126.5f, nan, -2.0f},
                                      -1000.0f);
  std::vector<float> y(x.size(), 1.0f);
  test::for_each_simd_target([&](const std::string&) {
    HWY_DYNAMIC_DISPATCH(Exp2Poly3Array)(x.data(), y.data(), x.size());
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(y[i], 0.0f) << "x = " << x[i];
    EXPECT_TRUE(std::isnan(y[4]));
    EXPECT_NEAR(y[5], 0.25f, 0.25f * 7.6e-5f);
    for (std::size_t i = 6; i < y.size(); ++i) EXPECT_EQ(y[i], 0.0f);
  });
}

}  // namespace
}  // namespace flashattn::cpu
#endif
