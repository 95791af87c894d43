// Naive attention in the inputs' precision: the yardsticks of upstream's tolerance rule (a
// kernel's error at most 2× that of a naive implementation in the same precision for
// outputs, 3× for gradients; tolerance.hpp applies it). Variants, masks and the exponential
// (exact or poly3) as the options state them, so that a kernel is set beside a naive
// implementation of the same computation.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::test {

// Naive attention the way a framework computes it on low-precision tensors: S accumulated
// in float32 and rounded to dtype, softmax in float32 rounded to dtype, O = P·V accumulated
// in float32 and rounded to dtype; variants as the reference states them. Its error
// against the float64 reference is the yardstick of upstream's "at most 2× a naive
// implementation". out as (batch, seqlen_q, heads_q, head_dim_v), contiguous. Dropout and
// (batch, heads) ALiBi slopes keyed as reference::Semantics keys them with `batch_offset`.
std::vector<double> naive_same_precision(const AttentionProblem& p, const AttentionOptions& options,
                                         const Tensor& q, const Tensor& k, const Tensor& v,
                                         std::int64_t batch_offset = 0);

// The low-precision yardstick that rounds where the kernels round, no more: inputs exact in
// dtype, S accumulated in float32 (variants as the reference states them, rounded to float),
// P = e^(s − m) in float32 with ℓ summed from it, P (after dropout) rounded to dtype before
// P·V — as tiled_bf16 and upstream's kernels round it; the tiled and decode kernels keep it
// in float32, which only makes them more exact — P·V accumulated in float32, then o = (P·V)/ℓ
// rounded to dtype. naive_same_precision above also rounds S, the normalized P and each
// product to dtype; its error (a score off by a rounding of |S| is a weight off by as much)
// is large enough to hide a 0.5% error in the softmax scale, or a key dropped from every
// causal row, which this one is not (see Bf16Tolerance in tests/test_forward_bf16.cpp).
std::vector<double> rounded_where_the_kernel_rounds(const AttentionProblem& p, const AttentionOptions& options,
                                                    const Tensor& q, const Tensor& k, const Tensor& v);

// Naive backward in the inputs' precision (the way a framework differentiates attention
// on low-precision tensors): every materialized matrix (S, P, dP, dS) and every gradient
// is rounded to dtype, accumulations run in float32. Its error against the float64
// reference gradients is the yardstick of upstream's "at most 3× a naive implementation".
// dq, dk, dv contiguous in the layouts of q, k, v; with a float attn_mask, dbias (contiguous,
// its shape): dS before the softcap's chain rule rounded to dtype, summed in float32.
struct NaiveGradients {
  std::vector<double> dq, dk, dv, dbias;
};
NaiveGradients naive_backward_same_precision(const AttentionProblem& p, const AttentionOptions& options,
                                             const Tensor& dout, const Tensor& q, const Tensor& k,
                                             const Tensor& v);

}  // namespace flashattn::test
