// The polynomial exp2 of the CPU kernels, on every compiled SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tests/test_simd_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/simd_math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashattn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void Exp2Array(const float* x, float* y, std::size_t n) {
  const hn::ScalableTag<float> df;
  for (std::size_t i = 0; i < n; i += hn::Lanes(df))
    hn::StoreU(Exp2(df, hn::LoadU(df, x + i)), df, y + i);
}

}  // namespace flashattn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace flashattn::cpu {
HWY_EXPORT(Exp2Array);
namespace {

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
      worst = std::fmax(worst, std::fabs(y[i] - want) / want);
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

}  // namespace
}  // namespace flashattn::cpu
#endif
