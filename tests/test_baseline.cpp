// The standard-attention baseline must itself be right, or the speedups mean nothing.
#include <gtest/gtest.h>

#include "src/baseline/standard_attention.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

TEST(Baseline, StandardAttentionMatchesReference) {
  for (bool causal : {false, true}) {
    const Tensor q = random_tensor(DType::f32, {2, 77, 4, 40}, 1);
    const Tensor k = random_tensor(DType::f32, {2, 50, 2, 40}, 2);
    const Tensor v = random_tensor(DType::f32, {2, 50, 2, 24}, 3);
    Tensor out(DType::f32, {2, 77, 4, 24}), lse(DType::f32, {2, 4, 77});
    AttentionOptions options;
    options.causal = causal;
    const std::size_t peak = baseline::standard_attention(q.view(), k.view(), v.view(), out.view(),
                                                          lse.view(), options);
    EXPECT_GE(peak, 77u * 50u * sizeof(float));  // it materializes the score matrix
    const reference::Result want = reference::attention(q.view(), k.view(), v.view(), options);
    EXPECT_LE(max_abs_error(out, want.out), 2e-5) << "causal " << causal;
    for (std::int64_t i = 0; i < lse.numel(); ++i) {
      const double e = want.lse[static_cast<std::size_t>(i)];
      if (std::isinf(e)) {
        EXPECT_EQ(lse.get(i), e);
      } else {
        EXPECT_NEAR(lse.get(i), e, 1e-4);
      }
    }
  }
}

}  // namespace
}  // namespace flashattn::test
