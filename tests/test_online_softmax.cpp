#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "flashattn/online_softmax.hpp"

namespace flashattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Σ 2^(s_j − max) computed directly in double, and the natural-log lse.
double direct_lse(const std::vector<float>& scores) {
  double m = -INFINITY, sum = 0;
  for (float s : scores) m = std::fmax(m, s);
  for (float s : scores) sum += std::exp2(s - m);
  return (m + std::log2(sum)) * std::log(2.0);
}

OnlineSoftmaxState stream(const std::vector<float>& scores, std::size_t begin, std::size_t end,
                          std::size_t tile, double* weighted, const std::vector<float>& values) {
  OnlineSoftmaxState st;
  *weighted = 0;
  for (std::size_t t = begin; t < end; t += tile) {
    float tile_max = -kInf;
    for (std::size_t j = t; j < std::min(end, t + tile); ++j) tile_max = std::fmax(tile_max, scores[j]);
    *weighted *= st.rescale_to(tile_max);
    float tile_sum = 0;
    for (std::size_t j = t; j < std::min(end, t + tile); ++j) {
      const float p = std::exp2(scores[j] - st.max);
      tile_sum += p;
      *weighted += p * values[j];
    }
    st.add(tile_sum);
  }
  return st;
}

TEST(OnlineSoftmaxState, StreamingAndMergeMatchDirectSoftmax) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  std::vector<float> scores(1000), values(1000);
  for (auto& s : scores) s = normal(rng);
  for (auto& v : values) v = normal(rng);
  double m = -INFINITY, sum = 0, dot = 0;
  for (float s : scores) m = std::fmax(m, s);
  for (std::size_t j = 0; j < scores.size(); ++j) {
    sum += std::exp2(scores[j] - m);
    dot += std::exp2(scores[j] - m) * values[j];
  }
  const double expected_out = dot / sum;

  double weighted = 0;
  const OnlineSoftmaxState whole = stream(scores, 0, 1000, 64, &weighted, values);
  EXPECT_NEAR(whole.lse(), direct_lse(scores), 1e-5);
  EXPECT_NEAR(weighted * whole.inverse_sum(), expected_out, 1e-4);

  double wa = 0, wb = 0;  // two disjoint halves merged (split-KV style)
  OnlineSoftmaxState a = stream(scores, 0, 377, 50, &wa, values);
  const OnlineSoftmaxState b = stream(scores, 377, 1000, 50, &wb, values);
  const auto f = a.merge(b);
  EXPECT_NEAR(a.lse(), direct_lse(scores), 1e-5);
  EXPECT_NEAR((wa * f.self + wb * f.other) * a.inverse_sum(), expected_out, 1e-4);
}

TEST(OnlineSoftmaxState, EmptyRowsNeverProduceNaN) {
  OnlineSoftmaxState empty;
  EXPECT_EQ(empty.rescale_to(-kInf), 1.0f);
  EXPECT_EQ(empty.lse(), -kInf);
  EXPECT_EQ(empty.inverse_sum(), 0.0f);
  OnlineSoftmaxState other;
  const auto f = empty.merge(other);
  EXPECT_EQ(f.self, 1.0f);  // neither state saw a key: factors 1 and 0, never NaN
  EXPECT_EQ(f.other, 0.0f);
  EXPECT_EQ(empty.lse(), -kInf);

  OnlineSoftmaxState seen;
  EXPECT_EQ(seen.rescale_to(3.0f), 0.0f);  // from −∞: factor 0, not NaN
  seen.add(1.0f);
  OnlineSoftmaxState none;
  const auto g = seen.merge(none);
  EXPECT_EQ(g.self, 1.0f);
  EXPECT_EQ(g.other, 0.0f);
  EXPECT_FLOAT_EQ(seen.lse(), 3.0f * std::log(2.0f));
}

TEST(OnlineSoftmaxState, ConditionalRescalingKeepsTheReferenceWithinTheThreshold) {
  OnlineSoftmaxState st;
  EXPECT_EQ(st.rescale_to(1.0f, 8.0f), 0.0f);  // the first visible tile sets the reference
  EXPECT_EQ(st.max, 1.0f);
  st.add(2.0f);
  EXPECT_EQ(st.rescale_to(9.0f, 8.0f), 1.0f);  // grew by exactly the threshold: kept
  EXPECT_EQ(st.max, 1.0f);
  EXPECT_EQ(st.sum, 2.0f);
  EXPECT_EQ(st.rescale_to(9.5f, 8.0f), std::exp2(1.0f - 9.5f));  // beyond it: moved to the tile's max
  EXPECT_EQ(st.max, 9.5f);
  EXPECT_FLOAT_EQ(st.sum, 2.0f * std::exp2(-8.5f));
  EXPECT_EQ(st.rescale_to(9.6f, 0.0f), std::exp2(9.5f - 9.6f));  // the classic rule: any growth
}

}  // namespace
}  // namespace flashattn
