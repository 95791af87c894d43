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
#include "flashattn/reference.hpp"
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

// x rounded to the nearest half-precision value, ties to even (±∞ beyond half's range).
float half(float x);

// The power of two that brings the largest finite |x| into [1, 2).
double unit_scale(const std::vector<double>& x);

// The yardstick of the decode kernels on narrow products (upstream's rule: a naive
// implementation in the same precision) for a quantized cache: decode_fp16 (half precision)
// or decode_bf16 (bf16 operands, float32 sums). The values the kernel reads of the codes kc,
// vc — e4m3 values, int8 codes as integers (u8 as code − 128) — exact in either, with factors
// kd, vd (descales, scales) per (batch, key, kv head) and, for int8 codes with zero points,
// kz, vz (null: none) of the same shape: the zero points as the kernel reads them (z − 128
// for u8); a value is (code − zero)·factor. Scores: q rounded to half (bf16) after a power of
// two brings its row into [1, 2), times the codes, summed over runs of 8 products (an FMA:
// one rounding each, in half; in float32 for bf16), the runs in double, less Σq·zero, then
// times the K factor. P·V: each probability times its V factor, scaled by a power of two
// into [1, 2) per row and rounded to half (bf16), times the codes, summed over runs of 16
// keys likewise, less Σ p·factor·zero in double. Softmax in double; causal (bottom-right) or
// full, GQA, no other option. Returns out and lse like reference::attention. k_int8: K holds
// int8 codes, which decode_bf16 scores on integer products (src/cpu/kernels/int8_dot.hpp):
// q's row brought into [2^13, 2^14) and rounded to integers, the products exact, and 128·Σq
// more taken off (that kernel reads the codes 128 higher); decode_fp16 as above.
reference::Result narrow_precision_attention(ForwardKernel kernel, const Tensor& q, const Tensor& kc, const Tensor& kd,
                                             const Tensor& vc, const Tensor& vd, const AttentionOptions& o,
                                             const Tensor* kz = nullptr, const Tensor* vz = nullptr,
                                             bool k_int8 = false);

// One rounding of the narrow products' type relative to a value: 2^-11 for decode_fp16's
// half, 2^-9 for decode_bf16's bf16 — the error any P·V on them carries, which the
// yardstick's few outputs of a tiny head dim can undershoot.
double narrow_rounding(ForwardKernel kernel);

// The narrow decode kernels this CPU runs: decode_fp16 with AVX512-FP16, decode_bf16 with
// AVX512-BF16 (tests/test_cpu_features.cpp checks both flags against the CPU's own).
std::vector<ForwardKernel> narrow_decode_kernels();

}  // namespace flashattn::test
