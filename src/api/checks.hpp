// The argument checks of the entry points, shared by every backend: a call is checked here
// once, on the views' shapes, strides and addresses, before it is routed. Each throws
// flashattn::Error naming the argument and the offending values.
#pragma once

#include "flashattn/fp8.hpp"
#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"
#include "src/api/kv_quant.hpp"

namespace flashattn::detail {

// The dtype rule of forward's out and backward's gradients: their inputs' dtype (the public
// entry points), or that or float32 (the ring's steps, whose partial results are summed in
// float32 and rounded once).
enum class OutputDtypes { inputs, inputs_or_f32 };

// forward(): q, k, v, the options, out and lse, and options.rescale_counts.
AttentionProblem check_forward_call(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& out, const TensorView& lse, const AttentionOptions& options,
                                    OutputDtypes outputs = OutputDtypes::inputs);

// An output apart from the options' side inputs: attn_mask, alibi_slopes, the block-sparse
// block_mask, sinks and the score hook's block mask (unset views and null outputs pass).
void check_apart_from_options(const char* name, const TensorView& output, const AttentionOptions& options);

// backward(): dout, out and lse as the forward returned them, dq, dk, dv like their inputs
// and apart from every input and from each other.
AttentionProblem check_backward_call(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out, const TensorView& lse,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const AttentionOptions& options, OutputDtypes grad_dtypes = OutputDtypes::inputs);

// forward_fp8(): each FP8 input (codes, block size, descales), the options as FP8
// probabilities allow them, out (any floating dtype) and lse, options.rescale_counts. The
// problem is that of the values the codes stand for, in float32.
AttentionProblem check_forward_fp8_call(const Fp8View& q, const Fp8View& k, const Fp8View& v, const TensorView& out,
                                        const TensorView& lse, const AttentionOptions& options);

// The page pools (or cache rows) of forward_with_kvcache and forward_varlen_paged: q of a
// floating dtype; k_cache and v_cache 4-d views (k_layout, v_layout name their dims) of q's
// dtype, or both u8 (quantized codes, true is returned; then each pool's scales and zero
// points are checked, check_pool_scales) — a cache of q's dtype takes no scales, zero points
// or formats —; v_cache's first three dims those of k_cache, k_cache's head_dim q's (its last
// dim). The values of the scales are the caller's to check (which of them are read differs
// between the entry points).
bool check_cache_pools(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                       const PoolScales& k, const PoolScales& v, const char* k_layout, const char* v_layout);

}  // namespace flashattn::detail
