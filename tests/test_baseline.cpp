// The standard-attention baseline must itself be right, or the speedups mean nothing.
#include <gtest/gtest.h>

#include "tools/baseline/standard_attention.hpp"
#include "tests/support/support.hpp"

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

namespace flashattn::test {
namespace {

TEST(Baseline, StandardBackwardMatchesReference) {
  for (bool causal : {false, true}) {
    const Tensor q = random_tensor(DType::f32, {2, 37, 4, 24}, 11);
    const Tensor k = random_tensor(DType::f32, {2, 50, 2, 24}, 12);
    const Tensor v = random_tensor(DType::f32, {2, 50, 2, 16}, 13);
    const Tensor dout = random_tensor(DType::f32, {2, 37, 4, 16}, 14);
    Tensor dq(DType::f32, {2, 37, 4, 24}), dk(DType::f32, {2, 50, 2, 24}), dv(DType::f32, {2, 50, 2, 16});
    AttentionOptions options;
    options.causal = causal;
    baseline::standard_attention_backward(dout.view(), q.view(), k.view(), v.view(), dq.view(),
                                          dk.view(), dv.view(), options);
    const reference::Gradients want =
        reference::attention_backward(dout.view(), q.view(), k.view(), v.view(), options);
    EXPECT_LE(max_abs_error(dq, want.dq), 1e-4) << "causal " << causal;
    EXPECT_LE(max_abs_error(dk, want.dk), 1e-4) << "causal " << causal;
    EXPECT_LE(max_abs_error(dv, want.dv), 1e-4) << "causal " << causal;
  }
}

}  // namespace
}  // namespace flashattn::test
