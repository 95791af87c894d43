// merge_attention_states: partial results over disjoint key ranges merge into attention
// over all the keys.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/support/support.hpp"

namespace flashattn::test {
namespace {

TEST(Merge, SplitKeysMergeIntoFullAttention) {
  const std::int64_t b = 2, sq = 17, sk = 300, h = 4, hkv = 2, d = 32, dv = 24;
  const Tensor q = random_tensor(DType::f32, {b, sq, h, d}, 1);
  const Tensor k = random_tensor(DType::f32, {b, sk, hkv, d}, 2);
  const Tensor v = random_tensor(DType::f32, {b, sk, hkv, dv}, 3);
  const ForwardResult full = forward(q.view(), k.view(), v.view());

  const std::int64_t bounds[] = {0, 0, 97, 200, 300};  // the first split has no keys
  const std::int64_t splits = 4;
  Tensor outs(DType::f32, {splits, b, sq, h, dv}), lses(DType::f32, {splits, b, h, sq});
  for (std::int64_t s = 0; s < splits; ++s) {
    const std::int64_t k0 = bounds[s], len = bounds[s + 1] - k0;
    auto keys = [&](const Tensor& t) {
      TensorView view = t.view();
      view.data = t.data_as<float>() + k0 * view.strides[1];
      view.shape[1] = len;
      return view;
    };
    MutableTensorView o = outs.view(), l = lses.view();
    o.data = outs.data_as<float>() + s * o.strides[0];
    o.rank = 4;
    o.shape = {b, sq, h, dv, 0};
    o.strides = {o.strides[1], o.strides[2], o.strides[3], 1, 0};
    l.data = lses.data_as<float>() + s * l.strides[0];
    l.rank = 3;
    l.shape = {b, h, sq, 0, 0};
    l.strides = {l.strides[1], l.strides[2], 1, 0, 0};
    forward(q.view(), keys(k), keys(v), o, l);
  }
  for (DType dtype : {DType::f32, DType::bf16}) {
    Tensor out(dtype, {b, sq, h, dv}), lse(DType::f32, {b, h, sq});
    merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
    double err = 0.0, lse_err = 0.0;
    for (std::int64_t i = 0; i < out.numel(); ++i)
      err = std::max(err, abs_difference(out.get(i), round_to(dtype, full.out.get(i))));  // NaN: ∞
    for (std::int64_t i = 0; i < lse.numel(); ++i) lse_err = std::max(lse_err, abs_difference(lse.get(i), full.lse.get(i)));
    EXPECT_LE(err, dtype == DType::f32 ? 2e-6 : 8e-3) << to_string(dtype);
    EXPECT_LE(lse_err, 1e-5);
  }
}

TEST(Merge, ThreadCountsGiveBitIdenticalRows) {
  // Random partials (one split empty in some rows): each row is merged by one thread in
  // split order, so 1, 2, 3 and 7 threads must agree bit for bit, and every row must
  // equal the float64 merge Σ_s exp(lse_s − lse)·out_s computed here.
  const std::int64_t splits = 5, b = 2, sq = 7, h = 3, dv = 19;
  const Tensor outs = random_tensor(DType::f32, {splits, b, sq, h, dv}, 11);
  Tensor lses = random_tensor(DType::f32, {splits, b, h, sq}, 12);
  for (std::int64_t i = 0; i < lses.numel(); i += 4) lses.set(i, -std::numeric_limits<float>::infinity());
  std::vector<Tensor> results;
  for (int threads : {1, 2, 3, 7}) {
    Tensor out(DType::f32, {b, sq, h, dv}), lse(DType::f32, {b, h, sq});
    merge_attention_states(outs.view(), lses.view(), out.view(), lse.view(), threads);
    results.push_back(std::move(out));
    results.push_back(std::move(lse));
  }
  for (std::size_t r = 2; r < results.size(); ++r)
    for (std::int64_t i = 0; i < results[r].numel(); ++i)
      ASSERT_EQ(results[r].get(i), results[r % 2].get(i)) << "result " << r << " element " << i;
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t i = 0; i < sq; ++i)
      for (std::int64_t hi = 0; hi < h; ++hi) {
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t s = 0; s < splits; ++s) m = std::fmax(m, lses.get(((s * b + bi) * h + hi) * sq + i));
        double total = 0.0;
        for (std::int64_t s = 0; s < splits; ++s) total += std::exp(lses.get(((s * b + bi) * h + hi) * sq + i) - m);
        const double lse = m + std::log(total);
        EXPECT_NEAR(results[1].get((bi * h + hi) * sq + i), lse, 1e-5);
        for (std::int64_t c = 0; c < dv; ++c) {
          double want = 0.0;
          for (std::int64_t s = 0; s < splits; ++s)
            want += std::exp(lses.get(((s * b + bi) * h + hi) * sq + i) - lse) *
                    outs.get((((s * b + bi) * sq + i) * h + hi) * dv + c);
          EXPECT_NEAR(results[0].get(((bi * sq + i) * h + hi) * dv + c), want, 1e-5 * (1.0 + std::fabs(want)));
        }
      }
}

// The weights of splits with large lses: each lse's rounding in log2 units (|lse|·2^-24)
// must not reach them — two splits at L and L − 1 with rows +1 and −1 merge to tanh(1/2)
// (0.46211715726) within float32 rounding at any L — and lses near float32's largest merge
// to a finite result.
TEST(Merge, LargeLsesWeighTheSplitsByTheirDifference) {
  Tensor outs(DType::f32, {2, 1, 1, 1, 1}), lses(DType::f32, {2, 1, 1, 1});
  Tensor out(DType::f32, {1, 1, 1, 1}), lse(DType::f32, {1, 1, 1});
  outs.set(0, 1.0f), outs.set(1, -1.0f);
  for (const float top : {0.7f, 57.7f, 700.7f, 12345.7f, -12345.7f, 3e37f}) {
    lses.set(0, top), lses.set(1, top - std::max(1.0f, std::nextafter(top, INFINITY) - top));
    const double gap = static_cast<double>(lses.get(0)) - lses.get(1);
    const double want = std::tanh(gap / 2.0);  // (e^g − 1) / (e^g + 1)
    merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
    EXPECT_NEAR(out.get(0), want, 4e-7) << "lse " << top;
    const double want_lse = lses.get(0) + std::log1p(std::exp(-gap));
    EXPECT_NEAR(lse.get(0), want_lse, 4e-7 * std::max(1.0, std::fabs(want_lse))) << "lse " << top;
  }
  lses.set(0, 3e38f), lses.set(1, 3e38f);
  merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
  EXPECT_EQ(out.get(0), 0.0f);
  EXPECT_NEAR(lse.get(0), 3e38, 3e38 * 1e-6);
  lses.set(1, -std::numeric_limits<float>::infinity());
  merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
  EXPECT_EQ(out.get(0), 1.0f);
  EXPECT_EQ(lse.get(0), 3e38f);
}

TEST(Merge, AllSplitsEmptyGiveZeroAndMinusInfinity) {
  Tensor outs(DType::f32, {3, 1, 2, 1, 4}), lses(DType::f32, {3, 1, 1, 2});
  for (std::int64_t i = 0; i < lses.numel(); ++i) lses.set(i, -std::numeric_limits<float>::infinity());
  Tensor out(DType::f32, {1, 2, 1, 4}), lse(DType::f32, {1, 1, 2});
  merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
  for (std::int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out.get(i), 0.0f);
  for (std::int64_t i = 0; i < lse.numel(); ++i) EXPECT_EQ(lse.get(i), -std::numeric_limits<float>::infinity());
}

TEST(Merge, BadInputNamesTheArgument) {
  Tensor outs(DType::f32, {2, 1, 3, 2, 4}), lses(DType::f32, {2, 1, 3, 2});
  Tensor out(DType::f32, {1, 3, 2, 4}), lse(DType::f32, {1, 2, 3});
  try {
    merge_attention_states(outs.view(), lses.view(), out.view(), lse.view());
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lses: shape (2, 1, 3, 2) but expected (2, 1, 2, 3)"), std::string::npos)
        << e.what();
  }
  Tensor bf(DType::bf16, {2, 1, 3, 2, 4});
  EXPECT_THROW(merge_attention_states(bf.view(), lses.view(), out.view(), lse.view()), Error);
  Tensor lses_ok(DType::f32, {2, 1, 2, 3});
  for (const int threads : {-5, kMaxThreads + 1}) {
    try {
      merge_attention_states(outs.view(), lses_ok.view(), out.view(), lse.view(), threads);
      ADD_FAILURE() << "expected flashattn::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_threads: must be in [0, 4096] (0 = all cores), got " +
                                           std::to_string(threads)),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace flashattn::test
