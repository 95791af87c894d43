// The float64 reference against closed forms, so it cannot be wrong the way a kernel is.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

TEST(Reference, EqualScoresAverageTheValues) {
  // q = 0 makes every score 0: out is the mean of the visible values, lse = log(n).
  const std::int64_t sk = 7, d = 3;
  Tensor q(DType::f32, {1, 2, 1, d});
  const Tensor k = random_tensor(DType::f32, {1, sk, 1, d}, 1);
  const Tensor v = random_tensor(DType::f32, {1, sk, 1, d}, 2);
  AttentionOptions options;
  options.causal = true;  // row 0 sees keys 0..5, row 1 sees 0..6
  const reference::Result r = reference::attention(q.view(), k.view(), v.view(), options);
  for (std::int64_t row = 0; row < 2; ++row) {
    const std::int64_t n = sk - 1 + row;
    for (std::int64_t c = 0; c < d; ++c) {
      double mean = 0;
      for (std::int64_t j = 0; j < n; ++j) mean += v.get(j * d + c) / static_cast<double>(n);
      EXPECT_NEAR(r.out[static_cast<std::size_t>(row * d + c)], mean, 1e-12);
    }
    EXPECT_NEAR(r.lse[static_cast<std::size_t>(row)], std::log(static_cast<double>(n)), 1e-12);
  }
}

TEST(Reference, TwoKeysFollowTheLogisticFunction) {
  // Scores a and b give weights σ(a − b) and σ(b − a).
  Tensor q(DType::f32, {1, 1, 1, 1}), k(DType::f32, {1, 2, 1, 1}), v(DType::f32, {1, 2, 1, 1});
  q.set(0, 2.0f);
  k.set(0, 1.5f);
  k.set(1, -0.5f);
  v.set(0, 10.0f);
  v.set(1, -4.0f);
  AttentionOptions options;
  options.softmax_scale = 0.7f;
  const reference::Result r = reference::attention(q.view(), k.view(), v.view(), options);
  const double a = 0.7f * 3.0, b = 0.7f * -1.0;
  const double w = 1.0 / (1.0 + std::exp(b - a));
  EXPECT_NEAR(r.out[0], w * 10.0 + (1 - w) * -4.0, 1e-12);
  EXPECT_NEAR(r.lse[0], std::log(std::exp(a) + std::exp(b)), 1e-12);
}

// A finite bias beyond ±kLargestScaled counts as ±kLargestScaled (options.hpp), in the
// reference as in the kernels: biases −3e38 and −2.5e38 weigh their two keys alike (the
// reference took them as they are: the second key alone, lse 22% off the kernels').
TEST(Reference, BiasesBeyondTheLargestScaledCountAsIt) {
  const Tensor q(DType::f32, {1, 1, 1, 1}), k(DType::f32, {1, 2, 1, 1});
  Tensor v(DType::f32, {1, 2, 1, 1}), bias(DType::f32, {1, 1, 1, 2});
  v.set(0, 1.0f);
  v.set(1, 2.0f);
  bias.set(0, -3e38f);
  bias.set(1, -2.5e38f);
  AttentionOptions options;
  options.attn_mask = bias.view();
  const reference::Result r = reference::attention(q.view(), k.view(), v.view(), options);
  EXPECT_EQ(r.out[0], 1.5);
  EXPECT_EQ(r.lse[0], -static_cast<double>(AttentionProblem::kLargestScaled) + std::log(2.0));
  const ForwardResult got = forward(q.view(), k.view(), v.view(), options);
  EXPECT_EQ(got.out.get(0), 1.5f);
  EXPECT_EQ(got.lse.get(0), static_cast<float>(r.lse[0]));
}

TEST(Reference, GroupedHeadsReadTheirSharedKvHead) {
  // With Hq = 4, Hkv = 2, q heads 0,1 use kv head 0 and 2,3 use kv head 1: giving every
  // q head the same query must give equal outputs within each group only.
  const std::int64_t d = 4, sk = 5;
  Tensor q(DType::f32, {1, 1, 4, d});
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t c = 0; c < d; ++c) q.set(h * d + c, 0.1f * static_cast<float>(c + 1));
  const Tensor k = random_tensor(DType::f32, {1, sk, 2, d}, 5);
  const Tensor v = random_tensor(DType::f32, {1, sk, 2, d}, 6);
  const reference::Result r = reference::attention(q.view(), k.view(), v.view());
  for (std::int64_t c = 0; c < d; ++c) {
    EXPECT_EQ(r.out[static_cast<std::size_t>(0 * d + c)], r.out[static_cast<std::size_t>(1 * d + c)]);
    EXPECT_EQ(r.out[static_cast<std::size_t>(2 * d + c)], r.out[static_cast<std::size_t>(3 * d + c)]);
  }
  EXPECT_NE(r.out[0], r.out[static_cast<std::size_t>(2 * d)]);
}

// The tests' error measures see a NaN output: std::fmax(e, |NaN − x|) is e, so a largest
// error taken that way let an all-NaN output pass every tolerance.
TEST(Reference, ErrorMeasuresCountANaNOutputAsInfinite) {
  const std::vector<double> want{1.0, 2.0, -INFINITY};
  const std::vector<double> nan_first{std::nan(""), 2.0, -INFINITY}, nan_last{1.0, 2.0, std::nan("")};
  EXPECT_EQ(max_abs_error(nan_first, want), INFINITY);
  EXPECT_EQ(max_abs_error(nan_last, want), INFINITY);
  EXPECT_EQ(error_stats(nan_first, want).max, INFINITY);
  EXPECT_EQ(error_stats(nan_first, want).mean, INFINITY);
  EXPECT_EQ(max_abs_error(want, want), 0.0);  // equal infinities agree
  Tensor out(DType::bf16, {3});
  out.set(0, 1.0f), out.set(1, std::nanf("")), out.set(2, -INFINITY);
  EXPECT_EQ(max_abs_error(out, want), INFINITY);
  EXPECT_NE(yardstick_verdict(out, want, want, DType::bf16), "");
}

// A naive output that is NaN somewhere, or off by more than kNaiveOutputShare of the largest
// |value|, fails the test and counts as 0 instead of making the output tolerance +∞ or huge;
// a sound one is its largest error. Likewise any yardstick through yardstick_error.
TEST(Reference, NaiveOutputErrorRejectsABrokenYardstick) {
  // Static: EXPECT_NONFATAL_FAILURE's statement may not name local variables.
  static const std::vector<double> want{0.5, -2.0, 1.0};
  static double error = -1.0;
  EXPECT_NEAR(naive_output_error({0.5, -1.99, 1.0}, want, DType::bf16, Exp2Impl::exact), 0.01, 1e-15);
  EXPECT_NONFATAL_FAILURE(error = naive_output_error({0.5, std::nan(""), 1.0}, want, DType::bf16, Exp2Impl::exact),
                          "cannot judge a kernel");
  EXPECT_EQ(error, 0.0);
  error = -1.0;
  EXPECT_NONFATAL_FAILURE(error = naive_output_error({0.0, 0.0, 0.0}, want, DType::f32, Exp2Impl::poly3),
                          "cannot judge a kernel");  // zeros: off by the largest |value|
  EXPECT_EQ(error, 0.0);
  // An lse's yardstick: finiteness alone.
  EXPECT_EQ(yardstick_error({1.0, 5.0}, {1.0, 2.0}, "lse", INFINITY), 3.0);
  EXPECT_NONFATAL_FAILURE(error = yardstick_error({1.0, std::nan("")}, {1.0, 2.0}, "lse", INFINITY), "lse is off by inf");
  EXPECT_EQ(error, 0.0);
}

// A naive backward sloppier than kGradientYardstickUlps cannot widen the gradients'
// tolerance: the rule reports it unsound; within the bound it sets 3× its error + the floor.
TEST(Reference, GradientRuleRejectsAnInflatedYardstick) {
  const std::vector<double> want{0.5, -1.5, 1.0};
  const double u = ulp(DType::bf16, 1.5);
  const std::vector<double> sound{0.5, -1.5 + 2 * u, 1.0}, inflated{0.5, -1.5 + 16 * u, 1.0};
  const GradientRule ok = gradient_rule(DType::bf16, Exp2Impl::exact, sound, want);
  EXPECT_EQ(ok.unsound, "");
  EXPECT_DOUBLE_EQ(ok.tolerance, 3.0 * 2 * u + kGradientFloor + 0.5 * u);  // half an ulp: both round
  EXPECT_NE(gradient_rule(DType::bf16, Exp2Impl::exact, inflated, want).unsound, "");
  // Float32 with exact exponentials: the floor alone, whatever the naive gradient.
  EXPECT_EQ(gradient_rule(DType::f32, Exp2Impl::exact, inflated, want).tolerance, kGradientFloor);
  // poly3's 13 bits: a float32 naive off by bf16's 16 ulps (2^-3 of 1.5) is still unsound.
  EXPECT_NE(gradient_rule(DType::f32, Exp2Impl::poly3, inflated, want).unsound, "");
}

}  // namespace
}  // namespace flashattn::test
