// Shared test helpers: random inputs, the same-precision naive attention that sets the
// low-precision tolerance, and iteration over every compiled SIMD target.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::test {

// A (d0, d1, d2, d3) tensor of N(0, 1) values rounded to `dtype`, never exactly zero.
inline Tensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::uint64_t seed) {
  Tensor t(dtype, std::move(shape));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    float x = normal(rng);
    if (x == 0.0f) x = 0.5f;
    t.set(i, x);
  }
  return t;
}

// |a − b|, but +∞ where one of them is NaN and not the other (two NaNs, or two equal
// infinities, agree: 0). A largest error taken with std::fmax or std::max drops NaN operands,
// so an output left NaN (unwritten, or poisoned) would pass any tolerance; through this it
// fails every finite one.
inline double abs_difference(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0.0 : INFINITY;
  return a == b ? 0.0 : std::fabs(a - b);
}

// Runs `body` once per SIMD target compiled into the library and supported by this CPU,
// with dispatch forced to that target; the trace names the target.
inline void for_each_simd_target(const std::function<void(const std::string&)>& body) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    SCOPED_TRACE("simd target " + name);
    body(name);
  }
  hwy::SetSupportedTargetsForTest(0);
}

// e^x as a kernel run with `options` computes it: through the poly3 cubic when the options
// let the kernel use it (poly3, and mixed, whose worst case that is), else std::exp. The
// naive yardsticks below use it, so that a kernel's error is set beside that of a naive
// implementation with the same exponential.
inline float naive_exp(const AttentionOptions& options, float x) {
  if (options.exp2 != Exp2Impl::poly3 && options.exp2 != Exp2Impl::mixed) return std::exp(x);
  const float power = x * 1.44269504f;
  float y = 0.0f;
  exp2_array(Exp2Impl::poly3, &power, &y, 1);
  return y;
}

// Attention in the inputs' precision with float32 accumulation, rounding to dtype either at
// every step (naive_same_precision) or only where the kernels round
// (rounded_where_the_kernel_rounds); both described below.
enum class Rounding { every_step, where_the_kernel_rounds };
inline std::vector<double> same_precision_attention(const AttentionProblem& p, const AttentionOptions& options,
                                                    const Tensor& q, const Tensor& k, const Tensor& v,
                                                    Rounding rounding) {
  const bool every_step = rounding == Rounding::every_step;
  const reference::Semantics sem{&p, &options};
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  const std::int64_t group = p.heads_q / p.heads_kv;
  std::vector<float> s(static_cast<std::size_t>(p.seqlen_k));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
        const std::int64_t kvh = h / group;
        float m = -INFINITY, sum = 0.0f;
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          s[j] = -INFINITY;
          if (!sem.visible(i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d)
            dot += q.get(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + d) *
                   k.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim + d);
          s[j] = every_step ? round_to(p.dtype, static_cast<float>(sem.score(b, h, i, j, round_to(p.dtype, dot))))
                            : static_cast<float>(sem.score(b, h, i, j, dot));
          m = std::fmax(m, s[j]);
        }
        if (m == -INFINITY) continue;
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) sum += (s[j] = naive_exp(options, s[j] - m));
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          const auto keep = static_cast<float>(sem.dropout_weight(b, h, i, j));
          s[j] = every_step ? round_to(p.dtype, round_to(p.dtype, s[j] / sum) * keep) : round_to(p.dtype, s[j] * keep);
        }
        for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < p.seqlen_k; ++j)
            acc += s[j] * v.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim_v + d);
          out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v + d)] =
              round_to(p.dtype, every_step ? acc : acc / sum);
        }
      }
  return out;
}

// Naive attention in the inputs' precision, the way a framework does it on low-precision
// tensors: S accumulated in float32 and rounded to dtype, softmax in float32 rounded to
// dtype, O = P·V accumulated in float32 and rounded to dtype; variants as the reference
// states them. Its error against the float64 reference is the yardstick of upstream's
// "at most 2× a naive implementation".
inline std::vector<double> naive_same_precision(const AttentionProblem& p, const AttentionOptions& options,
                                                const Tensor& q, const Tensor& k, const Tensor& v) {
  return same_precision_attention(p, options, q, k, v, Rounding::every_step);
}

// The low-precision yardstick that rounds where the kernels round, no more: inputs exact in
// dtype, S accumulated in float32 (variants as the reference states them, rounded to float),
// P = e^(s − m) in float32 with ℓ summed from it, P (after dropout) rounded to dtype before
// P·V — as tiled_bf16 and upstream's kernels round it; the tiled and decode kernels keep it
// in float32, which only makes them more exact — P·V accumulated in float32, then o = (P·V)/ℓ
// rounded to dtype. naive_same_precision above also rounds S, the normalized P and each
// product to dtype; its error (a score off by a rounding of |S| is a weight off by as much)
// is large enough to hide a 0.5% error in the softmax scale, or a key dropped from every
// causal row, which this one is not (see Bf16Tolerance in tests/test_forward_bf16.cpp).
inline std::vector<double> rounded_where_the_kernel_rounds(const AttentionProblem& p, const AttentionOptions& options,
                                                           const Tensor& q, const Tensor& k, const Tensor& v) {
  return same_precision_attention(p, options, q, k, v, Rounding::where_the_kernel_rounds);
}

// One unit in the last place of a value of magnitude |x| in dtype (bf16: 8 significant
// bits, f16: 11, f32: 24), at least that of dtype's smallest normal.
inline double ulp(DType dtype, double x) {
  const int bits = dtype == DType::bf16 ? 8 : dtype == DType::f16 ? 11 : 24;
  const int min_exponent = dtype == DType::f16 ? -14 : -126;
  int exponent = 0;
  std::frexp(std::fabs(x), &exponent);  // |x| in [2^(exponent − 1), 2^exponent)
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - (bits - 1));
}

struct ErrorStats {
  double max = 0.0, mean = 0.0;
};
inline ErrorStats error_stats(const std::vector<double>& actual, const std::vector<double>& expected) {
  ErrorStats e;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double d = abs_difference(actual[i], expected[i]);
    e.max = std::max(e.max, d);
    e.mean += d;
  }
  if (!actual.empty()) e.mean /= static_cast<double>(actual.size());
  return e;
}
inline ErrorStats error_stats(const Tensor& actual, const std::vector<double>& expected) {
  std::vector<double> a(static_cast<std::size_t>(actual.numel()));
  for (std::int64_t i = 0; i < actual.numel(); ++i) a[static_cast<std::size_t>(i)] = actual.get(i);
  return error_stats(a, expected);
}

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
inline std::string yardstick_verdict(const Tensor& got, const std::vector<double>& want,
                                     const std::vector<double>& yardstick, DType dtype) {
  double largest = 0.0;
  for (double x : want) largest = std::fmax(largest, std::fabs(x));
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

inline void expect_within_yardstick(const Tensor& got, const std::vector<double>& want,
                                    const std::vector<double>& yardstick, DType dtype) {
  const std::string verdict = yardstick_verdict(got, want, yardstick, dtype);
  EXPECT_TRUE(verdict.empty()) << verdict;
}

// Calls `call` and expects an Error whose message contains every one of `fragments`.
inline void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const Error& e) {
    for (const auto& f : fragments)
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos)
          << "message '" << e.what() << "' lacks '" << f << "'";
  }
}

// lse against the float64 reference's: −∞ exactly for rows without visible keys, else
// within 1e-5 + 1e-6·|lse|.
inline void expect_lse_near(const Tensor& lse, const std::vector<double>& want) {
  for (std::int64_t i = 0; i < lse.numel(); ++i) {
    const double e = want[static_cast<std::size_t>(i)];
    if (std::isinf(e)) {
      ASSERT_EQ(lse.get(i), e) << "lse " << i;
    } else {
      ASSERT_NEAR(lse.get(i), e, 1e-5 + 1e-6 * std::fabs(e)) << "lse " << i;
    }
  }
}

// What the CPU says about itself, independently of the library's detection: a machine that
// has AVX512-BF16 must run the bf16 kernels, never skip them.
inline bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") != 0;
#else
  return false;
#endif
}

inline double max_abs_error(const Tensor& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::int64_t i = 0; i < actual.numel(); ++i)
    e = std::max(e, abs_difference(actual.get(i), expected[static_cast<std::size_t>(i)]));
  return e;
}

inline double max_abs_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) e = std::max(e, abs_difference(actual[i], expected[i]));
  return e;
}

}  // namespace flashattn::test

namespace flashattn::test {

// Naive backward in the inputs' precision (the way a framework differentiates attention
// on low-precision tensors): every materialized matrix (S, P, dP, dS) and every gradient
// is rounded to dtype, accumulations run in float32. Its error against the float64
// reference gradients is the yardstick of upstream's "at most 3× a naive implementation".
struct NaiveGradients {
  std::vector<double> dq, dk, dv;
};
inline NaiveGradients naive_backward_same_precision(const AttentionProblem& p,
                                                    const AttentionOptions& options,
                                                    const Tensor& dout, const Tensor& q,
                                                    const Tensor& k, const Tensor& v) {
  const reference::Semantics sem{&p, &options};
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const std::int64_t sq = p.seqlen_q, sk = p.seqlen_k;
  auto qi = [&](std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t dim) {
    return ((b * sq + i) * p.heads_q + h) * dim;
  };
  auto ki = [&](std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t dim) {
    return ((b * sk + j) * p.heads_kv + h) * dim;
  };
  std::vector<float> dq(static_cast<std::size_t>(q.numel())), dk(static_cast<std::size_t>(k.numel())),
      dvv(static_cast<std::size_t>(v.numel()));
  // Per head: P (undropped), W (dropout weights), G (dscore/ddot), dS, all (sq, sk).
  std::vector<float> prob(static_cast<std::size_t>(sq * sk)), w(prob.size()), g(prob.size()), ds(prob.size());
  std::vector<float> o(static_cast<std::size_t>(sq * dv));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const std::int64_t kvh = h / group;
      for (std::int64_t i = 0; i < sq; ++i) {
        float m = -INFINITY, sum = 0.0f;
        float* pr = prob.data() + i * sk;  // no element to index when sk = 0
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::size_t e = static_cast<std::size_t>(i * sk + j);
          pr[j] = -INFINITY;
          w[e] = static_cast<float>(sem.dropout_weight(b, h, i, j));
          if (!sem.visible(i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t c = 0; c < d; ++c) dot += q.get(qi(b, i, h, d) + c) * k.get(ki(b, j, kvh, d) + c);
          dot = round_to(p.dtype, dot);
          g[e] = static_cast<float>(sem.score_gradient(dot));
          pr[j] = round_to(p.dtype, static_cast<float>(sem.score(b, h, i, j, dot)));
          m = std::fmax(m, pr[j]);
        }
        if (m == -INFINITY) {
          std::fill(pr, pr + sk, 0.0f);
        } else {
          for (std::int64_t j = 0; j < sk; ++j) sum += (pr[j] = naive_exp(options, pr[j] - m));
          for (std::int64_t j = 0; j < sk; ++j) pr[j] = round_to(p.dtype, pr[j] / sum);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < sk; ++j)
            acc += round_to(p.dtype, pr[j] * w[static_cast<std::size_t>(i * sk + j)]) * v.get(ki(b, j, kvh, dv) + c);
          o[static_cast<std::size_t>(i * dv + c)] = round_to(p.dtype, acc);
        }
      }
      for (std::int64_t i = 0; i < sq; ++i) {
        float delta = 0.0f;
        for (std::int64_t c = 0; c < dv; ++c) delta += dout.get(qi(b, i, h, dv) + c) * o[static_cast<std::size_t>(i * dv + c)];
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::size_t e = static_cast<std::size_t>(i * sk + j);
          float dp = 0.0f;
          for (std::int64_t c = 0; c < dv; ++c) dp += dout.get(qi(b, i, h, dv) + c) * v.get(ki(b, j, kvh, dv) + c);
          ds[e] = prob[e] == 0.0f ? 0.0f
                                  : round_to(p.dtype, prob[e] * (w[e] * round_to(p.dtype, dp) - delta) * g[e]);
        }
      }
      for (std::int64_t i = 0; i < sq; ++i)
        for (std::int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < sk; ++j) acc += ds[static_cast<std::size_t>(i * sk + j)] * k.get(ki(b, j, kvh, d) + c);
          dq[static_cast<std::size_t>(qi(b, i, h, d) + c)] = round_to(p.dtype, acc);
        }
      for (std::int64_t j = 0; j < sk; ++j) {  // this head's share of dK, dV
        for (std::int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < sq; ++i) acc += ds[static_cast<std::size_t>(i * sk + j)] * q.get(qi(b, i, h, d) + c);
          dk[static_cast<std::size_t>(ki(b, j, kvh, d) + c)] += round_to(p.dtype, acc);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < sq; ++i) {
            const std::size_t e = static_cast<std::size_t>(i * sk + j);
            acc += round_to(p.dtype, prob[e] * w[e]) * dout.get(qi(b, i, h, dv) + c);
          }
          dvv[static_cast<std::size_t>(ki(b, j, kvh, dv) + c)] += round_to(p.dtype, acc);
        }
      }
    }
  NaiveGradients r;
  for (float x : dq) r.dq.push_back(x);
  for (float x : dk) r.dk.push_back(round_to(p.dtype, x));
  for (float x : dvv) r.dv.push_back(round_to(p.dtype, x));
  return r;
}

}  // namespace flashattn::test
