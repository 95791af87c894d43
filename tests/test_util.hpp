// Shared test helpers: random inputs, the same-precision naive attention that sets the
// low-precision tolerance, and iteration over every compiled SIMD target.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>

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

// Naive attention in the inputs' precision, the way a framework does it on low-precision
// tensors: S accumulated in float32 and rounded to dtype, softmax in float32 rounded to
// dtype, O = P·V accumulated in float32 and rounded to dtype. Its error against the
// float64 reference is the yardstick of upstream's "at most 2× a naive implementation".
inline std::vector<double> naive_same_precision(const AttentionProblem& p, const Tensor& q,
                                                const Tensor& k, const Tensor& v) {
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * p.head_dim_v));
  const std::int64_t group = p.heads_q / p.heads_kv;
  std::vector<float> s(static_cast<std::size_t>(p.seqlen_k));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
        const std::int64_t n = p.visible_keys(i), kvh = h / group;
        float m = -INFINITY, sum = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d)
            dot += q.get(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + d) *
                   k.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim + d);
          s[j] = round_to(p.dtype, round_to(p.dtype, dot) * p.softmax_scale);
          m = std::fmax(m, s[j]);
        }
        for (std::int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
        for (std::int64_t j = 0; j < n; ++j) s[j] = round_to(p.dtype, s[j] / sum);
        for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < n; ++j)
            acc += s[j] * v.get(((b * p.seqlen_k + j) * p.heads_kv + kvh) * p.head_dim_v + d);
          out[static_cast<std::size_t>(((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim_v + d)] =
              round_to(p.dtype, acc);
        }
      }
  return out;
}

inline double max_abs_error(const Tensor& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::int64_t i = 0; i < actual.numel(); ++i)
    e = std::fmax(e, std::fabs(static_cast<double>(actual.get(i)) - expected[static_cast<std::size_t>(i)]));
  return e;
}

inline double max_abs_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  double e = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) e = std::fmax(e, std::fabs(actual[i] - expected[i]));
  return e;
}

}  // namespace flashattn::test
