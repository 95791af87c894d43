// Everything the tests share (tests/support): the case type, its random inputs, the naive
// same-precision yardsticks, the tolerance rule, check_forward / check_backward, and the
// GoogleTest helpers.
#pragma once

#include "flashattn/flashattn.hpp"
#include "tests/support/case.hpp"
#include "tests/support/check.hpp"
#include "tests/support/harness.hpp"
#include "tests/support/naive.hpp"
#include "tests/support/tolerance.hpp"
#include "tools/support/random_inputs.hpp"

namespace flashattn::test {

using support::random_tensor;

}  // namespace flashattn::test
