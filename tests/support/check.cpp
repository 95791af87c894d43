#include "tests/support/check.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "flashattn/reference.hpp"
#include "tests/support/naive.hpp"
#include "tests/support/tolerance.hpp"

namespace flashattn::test {

ForwardResult library_forward(const Case& c, const Inputs& in) {
  return forward(in.q.view(), in.k.view(), in.v.view(), c.options());
}

BackwardResult library_backward(const Case& c, const Inputs& in) {
  const ForwardResult fwd = library_forward(c, in);
  return backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), fwd.out.view(), fwd.lse.view(),
                  c.options());
}

void check_forward(const Case& c, const ForwardCall& call) {
  const Inputs in = c.inputs();
  check_forward(c, in, call(c, in));
}

void check_forward(const Case& c, const Inputs& in, const ForwardResult& got) {
  SCOPED_TRACE(c.describe());
  const reference::Result want = reference::attention(in.q.view(), in.k.view(), in.v.view(), c.options());
  const AttentionProblem& p = c.problem();
  if (p.dtype == DType::f32) {
    EXPECT_LE(max_abs_error(got.out, want.out), kFloat32OutTolerance) << "out";
  } else {
    expect_within_yardstick(got.out, want.out, rounded_where_the_kernel_rounds(p, c.options(), in.q, in.k, in.v),
                            p.dtype);
  }
  expect_lse_near(got.lse, want.lse);
}

void check_backward(const Case& c, const BackwardCall& call) {
  SCOPED_TRACE(c.describe());
  const Inputs in = c.inputs();
  const BackwardResult got = call(c, in);
  const reference::Gradients want =
      reference::attention_backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), c.options());
  const AttentionProblem& p = c.problem();
  NaiveGradients naive;
  if (judged_by_yardstick(p.dtype, p.exp2))
    naive = naive_backward_same_precision(p, c.options(), in.dout, in.q, in.k, in.v);
  struct Gradient {
    const char* name;
    const Tensor& got;
    const std::vector<double>& naive;
    const std::vector<double>& want;
  };
  for (const Gradient& g : {Gradient{"dq", got.dq, naive.dq, want.dq}, Gradient{"dk", got.dk, naive.dk, want.dk},
                            Gradient{"dv", got.dv, naive.dv, want.dv}}) {
    const GradientRule rule = gradient_rule(p.dtype, p.exp2, g.naive, g.want);
    EXPECT_TRUE(rule.unsound.empty()) << g.name << ": " << rule.unsound;
    EXPECT_LE(max_abs_error(g.got, g.want), rule.tolerance) << g.name;
  }
}

}  // namespace flashattn::test
