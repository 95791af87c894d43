// check_forward and check_backward: the call under test on a case's inputs, judged against
// the float64 reference (flashattn/reference.hpp) by the tolerance rule (tolerance.hpp) with
// the naive same-precision computation (naive.hpp) as its yardstick.
#pragma once

#include <functional>

#include "flashattn/attention.hpp"
#include "tests/support/case.hpp"

namespace flashattn::test {

// The call under test: by default the library's forward(), and forward() then backward(),
// with the case's options.
using ForwardCall = std::function<ForwardResult(const Case&, const Inputs&)>;
using BackwardCall = std::function<BackwardResult(const Case&, const Inputs&)>;
ForwardResult library_forward(const Case& c, const Inputs& in);
BackwardResult library_backward(const Case& c, const Inputs& in);

// out and lse of `call`: float32 within kFloat32OutTolerance; bf16/f16 by
// expect_within_yardstick with the yardstick that rounds where the kernels round
// (rounded_where_the_kernel_rounds); lse by expect_lse_near.
void check_forward(const Case& c, const ForwardCall& call = library_forward);
// The same judgement of `got`, computed from `in` — inputs in the case's shapes that are not
// the case's own random ones (a shared prefix's keys, say).
void check_forward(const Case& c, const Inputs& in, const ForwardResult& got);

// dq, dk, dv of `call`, each by gradient_rule against the naive same-precision backward;
// a naive backward outside kGradientYardstickUlps fails the test.
void check_backward(const Case& c, const BackwardCall& call = library_backward);

}  // namespace flashattn::test
