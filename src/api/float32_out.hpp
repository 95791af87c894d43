// forward() and backward() whose out and gradients may also be float32 for bf16/f16 inputs
// (the public entry points require the inputs' dtype, as upstream does): for ring attention
// (src/dist), whose steps' partial outputs and gradient shares are summed in float32 and
// rounded once. Checked and routed as forward() and backward() are; the CPU kernels write
// any floating dtype.
#pragma once

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// With lse_sums (the CPU backend only), lse receives each row's softmax state, its max (log2
// units), and lse_sums (laid out as lse, from its own pointer) its ℓ: for a merge that follows
// (detail::merge_states), exact where one float32 lse could not hold m + log ℓ.
void forward_into_float32(const TensorView& q, const TensorView& k, const TensorView& v, const MutableTensorView& out,
                          const MutableTensorView& lse, const AttentionOptions& options, float* lse_sums = nullptr);
void backward_into_float32(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const TensorView& lse, const MutableTensorView& dq,
                           const MutableTensorView& dk, const MutableTensorView& dv, const AttentionOptions& options);

}  // namespace flashattn::detail
