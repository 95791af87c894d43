// The tolerance rule, upstream FlashAttention's: against the float64 reference, a kernel's
// error at most 2× that of a naive implementation in the same precision (naive.hpp) for
// outputs, 3× for gradients; float32 with exact exponentials within fixed floors. A
// yardstick is itself held to a few units in the last place of the reference's largest
// value, so that a sloppy yardstick fails the test instead of widening its tolerance.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/reference.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::test {

// |a − b|, but +∞ where one of them is NaN and not the other (two NaNs, or two equal
// infinities, agree: 0). A largest error taken with std::fmax or std::max drops NaN operands,
// so an output left NaN (unwritten, or poisoned) would pass any tolerance; through this it
// fails every finite one.
double abs_difference(double a, double b);

double max_abs_error(const Tensor& actual, const std::vector<double>& expected);
double max_abs_error(const std::vector<double>& actual, const std::vector<double>& expected);

struct ErrorStats {
  double max = 0.0, mean = 0.0;
};
ErrorStats error_stats(const std::vector<double>& actual, const std::vector<double>& expected);
ErrorStats error_stats(const Tensor& actual, const std::vector<double>& expected);

// One unit in the last place of a value of magnitude |x| in dtype (bf16: 8 significant
// bits, f16: 11, f32: 24), at least that of dtype's smallest normal.
double ulp(DType dtype, double x);

// Float32 with exact exponentials: the largest output error, and lse's (plus 1e-6·|lse|;
// −∞ exactly for rows without visible keys), against the float64 reference — a float32
// floor of reordered accumulation over thousands of keys. The gradients' floor, and the
// floor added to 3× the naive gradients' error, is kGradientFloor.
constexpr double kFloat32OutTolerance = 1e-5;
constexpr double kLseTolerance = 1e-5;
constexpr double kGradientFloor = 1e-4;

// The yardstick's own error may be at most this many ulps (in dtype) of the largest |value|
// of the float64 result: a yardstick sloppier than that — one that would let a wrong kernel
// pass — fails the test instead.
constexpr double kYardstickUlps = 2.0;

// Upstream FA3's rule on a sound yardstick: the kernel's largest and mean errors against the
// float64 reference `want` at most twice the yardstick's, and the yardstick within
// kYardstickUlps of the largest |want|. The largest error may exceed twice the yardstick's by
// half an ulp of the largest |want|: both round their outputs to dtype, and where the exact
// value lies near the middle of two neighbours, a pre-rounding difference far below the
// yardstick's error moves the kernel to the farther one (seen: 2.35× on one element of
// 10240, tiled_bf16, causal). The mean error, over every element, has no such luck; it is
// what a small systematic error (a 0.5% error in the softmax scale) shows in.
// "" where `got` passes, else what fails.
std::string yardstick_verdict(const Tensor& got, const std::vector<double>& want,
                              const std::vector<double>& yardstick, DType dtype);
void expect_within_yardstick(const Tensor& got, const std::vector<double>& want,
                             const std::vector<double>& yardstick, DType dtype);

// A yardstick's largest error against the float64 `want`, as a tolerance may use it:
// finite (a NaN in the yardstick counts as an error of +∞, which would pass any kernel) and
// at most `share` of the largest |want| (zeros, garbage), else the test fails (ADD_FAILURE,
// naming `what`) and the error counts as 0, so that a broken yardstick cannot widen a
// tolerance. `share` +∞: finiteness alone (an lse, whose values may lie near 0).
double yardstick_error(const std::vector<double>& yardstick, const std::vector<double>& want, const std::string& what,
                       double share);

// yardstick_error for the naive same-precision output (naive_same_precision), the yardstick
// of upstream's output rule at the call sites that add their own floors, with a share of
// kNaiveOutputShare. Not an ulp bound, as yardstick_verdict's: this naive result rounds S
// to dtype, and its error grows with the scores and with |V| where the output cancels —
// measured up to 17 bf16 ulps and 407 float32 ulps of the largest |want| in the unit tests
// (a bf16 case with rising scores: 0.12 of it) — so the share guards against a broken
// yardstick; it is not a precision claim.
constexpr double kNaiveOutputShare = 0.25;
double naive_output_error(const std::vector<double>& naive, const std::vector<double>& want, DType dtype,
                          Exp2Impl exp2);

// lse against the float64 reference's: −∞ exactly for rows without visible keys, else
// within kLseTolerance + 1e-6·|lse|.
void expect_lse_near(const Tensor& lse, const std::vector<double>& want);

// The naive backward's error may be at most this many ulps of the largest |gradient| of the
// float64 reference, in the precision of its dtype and exponential (poly3's relative error
// 7.5e-5, about 13 bits, caps a float32 naive's). Its roundings of S, P, dP, dS and of each
// product compound over the keys, so the bound is wider than the forward's: the backward
// tests' naive gradients (tests/test_backward*.cpp, the CUDA emulation's random shapes) are
// within 3.8 ulps. Past it the yardstick is broken, not generous.
constexpr double kGradientYardstickUlps = 8.0;

// Whether a result in dtype computed with `exp2` is judged beside a naive same-precision
// implementation (bf16, f16, or poly3/mixed exponentials), rather than by the float32 floors.
bool judged_by_yardstick(DType dtype, Exp2Impl exp2);

// Upstream's rule for gradients: a gradient within 3× the naive same-precision backward's
// largest error (naive_backward_same_precision) plus kGradientFloor and half an ulp of the
// largest |gradient| (both round their gradients to dtype: the outputs' reason, above; the
// fuzzer met 3.1–5× on bf16 gradients of 6–52 elements with dropout) where
// judged_by_yardstick, else within kGradientFloor. `naive`: that naive backward's gradient
// (read only where judged_by_yardstick).
struct GradientRule {
  double tolerance = kGradientFloor;
  std::string unsound;  // "" when the naive backward is within kGradientYardstickUlps, else why not
};
GradientRule gradient_rule(DType dtype, Exp2Impl exp2, const std::vector<double>& naive,
                           const std::vector<double>& want);

}  // namespace flashattn::test
