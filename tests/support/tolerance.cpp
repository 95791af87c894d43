#include "tests/support/tolerance.hpp"

#include <algorithm>
#include <cmath>

namespace flashattn::test {

namespace {

// Significant bits of a yardstick computed in dtype with `exp2`'s exponential: poly3's (and
// mixed's, whose worst case it is) relative error 7.5e-5 is about 2^-13.
int yardstick_bits(DType dtype, Exp2Impl exp2) {
  const int bits = dtype == DType::bf16 ? 8 : dtype == DType::f16 ? 11 : 24;
  return exp2 == Exp2Impl::poly3 || exp2 == Exp2Impl::mixed ? std::min(bits, 13) : bits;
}

double ulp_of_bits(int bits, int min_exponent, double x) {
  int exponent = 0;
  std::frexp(std::fabs(x), &exponent);  // |x| in [2^(exponent − 1), 2^exponent)
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - (bits - 1));
}

double largest_magnitude(const std::vector<double>& x) {
  double largest = 0.0;
  for (double e : x) largest = std::fmax(largest, std::fabs(e));
  return largest;
}

}  // namespace

double abs_difference(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0.0 : INFINITY;
  return a == b ? 0.0 : std::fabs(a - b);
}

double max_abs_error(const Tensor& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::int64_t i = 0; i < actual.numel(); ++i)
    e = std::max(e, abs_difference(actual.get(i), expected[static_cast<std::size_t>(i)]));
  return e;
}

double max_abs_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) e = std::max(e, abs_difference(actual[i], expected[i]));
  return e;
}

ErrorStats error_stats(const std::vector<double>& actual, const std::vector<double>& expected) {
  ErrorStats e;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double d = abs_difference(actual[i], expected[i]);
    e.max = std::max(e.max, d);
    e.mean += d;
  }
  if (!actual.empty()) e.mean /= static_cast<double>(actual.size());
  return e;
}

ErrorStats error_stats(const Tensor& actual, const std::vector<double>& expected) {
  std::vector<double> a(static_cast<std::size_t>(actual.numel()));
  for (std::int64_t i = 0; i < actual.numel(); ++i) a[static_cast<std::size_t>(i)] = actual.get(i);
  return error_stats(a, expected);
}

double ulp(DType dtype, double x) {
  return ulp_of_bits(yardstick_bits(dtype, Exp2Impl::exact), dtype == DType::f16 ? -14 : -126, x);
}

std::string yardstick_verdict(const Tensor& got, const std::vector<double>& want,
                              const std::vector<double>& yardstick, DType dtype) {
  const double largest = largest_magnitude(want);
  const ErrorStats kernel = error_stats(got, want), yard = error_stats(yardstick, want);
  std::string verdict;
  if (yard.max > kYardstickUlps * ulp(dtype, largest))
    verdict += "the yardstick itself is off by " + std::to_string(yard.max) + ", more than " +
               std::to_string(kYardstickUlps) + " ulps of " + std::to_string(largest) + " in " + to_string(dtype) +
               ": it cannot judge a kernel; ";
  if (kernel.max > 2.0 * yard.max + 0.5 * ulp(dtype, largest))
    verdict += "largest error " + std::to_string(kernel.max) + " against the yardstick's " + std::to_string(yard.max) + "; ";
  if (kernel.mean > 2.0 * yard.mean + 1e-7)
    verdict += "mean error " + std::to_string(kernel.mean) + " against the yardstick's " + std::to_string(yard.mean);
  return verdict;
}

void expect_within_yardstick(const Tensor& got, const std::vector<double>& want,
                             const std::vector<double>& yardstick, DType dtype) {
  const std::string verdict = yardstick_verdict(got, want, yardstick, dtype);
  EXPECT_TRUE(verdict.empty()) << verdict;
}

double yardstick_error(const std::vector<double>& yardstick, const std::vector<double>& want, const std::string& what,
                       double share) {
  const double error = max_abs_error(yardstick, want), largest = largest_magnitude(want);
  if (std::isfinite(error) && (std::isinf(share) || error <= share * largest)) return error;  // ∞·0 is NaN
  ADD_FAILURE() << what << " is off by " << error << " against a largest |value| of " << largest
                << ": it cannot judge a kernel";
  return 0.0;
}

double naive_output_error(const std::vector<double>& naive, const std::vector<double>& want, DType dtype,
                          Exp2Impl exp2) {
  return yardstick_error(naive, want, "the naive " + to_string(dtype) + " output (exp2 " + to_string(exp2) + ")",
                         kNaiveOutputShare);
}

void expect_lse_near(const Tensor& lse, const std::vector<double>& want) {
  for (std::int64_t i = 0; i < lse.numel(); ++i) {
    const double e = want[static_cast<std::size_t>(i)];
    if (std::isinf(e)) {
      ASSERT_EQ(lse.get(i), e) << "lse " << i;
    } else {
      ASSERT_NEAR(lse.get(i), e, kLseTolerance + 1e-6 * std::fabs(e)) << "lse " << i;
    }
  }
}

bool judged_by_yardstick(DType dtype, Exp2Impl exp2) {
  return dtype != DType::f32 || exp2 == Exp2Impl::poly3 || exp2 == Exp2Impl::mixed;
}

GradientRule gradient_rule(DType dtype, Exp2Impl exp2, const std::vector<double>& naive,
                           const std::vector<double>& want) {
  GradientRule rule;
  if (!judged_by_yardstick(dtype, exp2)) return rule;
  const double naive_error = max_abs_error(naive, want);
  const double largest = largest_magnitude(want);
  rule.tolerance = 3.0 * naive_error + kGradientFloor + 0.5 * ulp(dtype, largest);
  const double bound = kGradientYardstickUlps * ulp_of_bits(yardstick_bits(dtype, exp2),
                                                            dtype == DType::f16 ? -14 : -126, largest);
  if (naive_error > bound)
    rule.unsound = "the naive backward itself is off by " + std::to_string(naive_error) + ", more than " +
                   std::to_string(kGradientYardstickUlps) + " ulps of " + std::to_string(largest) + " in " +
                   to_string(dtype) + " with exp2 " + to_string(exp2) + ": it cannot judge a kernel";
  return rule;
}

}  // namespace flashattn::test
