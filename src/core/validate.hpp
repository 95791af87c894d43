// Argument checks shared by every entry point. Each throws flashattn::Error with a
// message that names the argument and the offending values.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "flashattn/fp8.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// Rank, non-negative sizes and strides, contiguous last dimension, non-null data when
// non-empty, and an addressable extent (no 64-bit overflow).
void check_view(const char* name, const TensorView& view, int rank, const char* layout);

// `view` must have exactly this dtype and these sizes.
void check_dtype(const char* name, const TensorView& view, DType expected,
                 const char* why);
void check_shape(const char* name, const TensorView& view,
                 std::initializer_list<std::int64_t> expected, const char* layout);

// check_view, check_dtype and check_shape of one tensor: rank and sizes `shape`, dtype `dtype`.
void check_tensor(const char* name, const TensorView& view, DType dtype, const char* why,
                  std::initializer_list<std::int64_t> shape, const char* layout);

// An output must not overlap itself (two elements at one address) nor any input.
void check_output_layout(const char* name, const TensorView& out);
// ALiBi slopes: float32 (heads_q) or (batch, heads_q), each finite and of magnitude at most
// AttentionProblem::kLargestScaled over `distance` (≥ 1), the largest |diagonal − key| of the
// problem, so that the kernels' slope·log2e·distance stays finite in float32 (it overflowed
// to ±∞: NaN rows, or rows taken as seeing no key); an Error names the batch and head of a
// bad one.
void check_alibi_slopes(const TensorView& slopes, std::int64_t batch, std::int64_t heads_q, std::int64_t distance = 1);
void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in);

// Each output free of self-overlap and disjoint from every other output and every input.
struct NamedView {
  const char* name;
  TensorView view;
};
void check_outputs_apart(std::initializer_list<NamedView> outputs, std::initializer_list<NamedView> inputs);

// out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype and lse (batch, heads_q,
// seqlen_q) float32, distinct from each other and from every input.
void check_forward_outputs(const AttentionProblem& problem, const TensorView& q,
                           const TensorView& k, const TensorView& v, const TensorView& out,
                           const TensorView& lse);

// The same without the dtype rule: out may be any floating dtype (the FP8 forward).
void check_forward_output_views(const AttentionProblem& problem, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse);

// options.rescale_counts, when set: int32 (batch, heads_q, seqlen_q), overlapping nothing.
void check_rescale_counts(const AttentionProblem& problem, const AttentionOptions& options,
                          const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse);
// Entry points that run one sequence at a time do not report rescale counts.
void reject_rescale_counts(const char* entry_point, const AttentionOptions& options);
// Entry points without a dense attn_mask (varlen, KV cache, FP8) reject one by name.
void reject_attn_mask(const char* entry_point, const AttentionOptions& options);
// Likewise a top-left causal_alignment (positions there are the sequences' or the cache's).
void reject_top_left(const char* entry_point, const AttentionOptions& options);
// Entry points without user score and mask functions (the same as attn_mask) reject a score_hook by name.
void reject_score_hook(const char* entry_point, const AttentionOptions& options);

// An FP8 input `name` (q, k, v): u8 codes (batch, seqlen, heads, dim), block_size >= 0, and
// finite positive float32 descales, one per tensor (1) or per block (batch, heads, blocks).
void check_fp8_input(const char* name, const Fp8View& x);

std::string shape_string(const TensorView& view);

}  // namespace flashattn::detail
