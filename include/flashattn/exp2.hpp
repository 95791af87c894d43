// The forward kernel's exponentials (docs/algorithm.md §5), evaluated on an array: for inspecting their
// accuracy (flashattn numerics) without reaching into the kernels.
#pragma once

#include <cstddef>

#include "flashattn/options.hpp"

namespace flashattn {

// y[i] = 2^x[i] with the kernel's `exact` or `poly3` exp2 on the dispatched SIMD target.
// Throws Error for automatic and mixed, which are choices between the two, not functions.
void exp2_array(Exp2Impl impl, const float* x, float* y, std::size_t n);

}  // namespace flashattn
