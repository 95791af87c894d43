// The float64 reference: attention exactly as written in the textbook, one score row
// at a time (S row and P row materialized in double). Tests and the CLI judge every
// kernel against it.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::reference {

// Every variant of AttentionOptions stated once, in float64 scalar form: the definition
// the kernels are tested against.
struct Semantics {
  const AttentionProblem* problem;
  const AttentionOptions* options;
  // Index of the problem's batch element 0 in a larger batch: dropout and (batch, heads)
  // ALiBi slopes of batch element b are those of batch index b + batch_offset. Sequence b of
  // a variable-length batch, taken as a batch-1 problem, has batch_offset b: forward_varlen
  // keys its dropout mask with batch index b.
  std::int64_t batch_offset = 0;

  // Row i may see key j: inside the causal/window range and a kept block.
  bool visible(std::int64_t i, std::int64_t j) const;
  double slope(std::int64_t b, std::int64_t h) const;
  double sink(std::int64_t h) const;  // the sink logit of q head h (options.sinks)
  // options.attn_mask at (b, h, i, j), broadcast: a bias, or 0 (kept) / −∞ (hidden) for a
  // boolean mask; 0 without one.
  double mask(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  // Score of (i, j) from the raw dot product q_i·k_j: scale, then softcap, then ALiBi, then
  // attn_mask, without options.score_hook.
  double builtin_score(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const;
  // options.score_hook keeps (b, h, i, j): its block mask's block is full, or partial (every
  // block without a block mask) and mask_mod keeps it (or there is none). True without a hook.
  bool hook_keeps(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  // builtin_score, then the hook: −∞ where it hides the key, else score_mod of it (if any).
  // A score of −∞ hides its key as visible() does.
  double score(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const;
  // d score / d dot (the softcap's tanh and score_mod's derivative included).
  double score_gradient(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double dot) const;
  // 0 if (i, j) is dropped, 1/(1 − p) if kept, 1 without dropout.
  double dropout_weight(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
};

// Output row (head_dim_v values) and natural-log lse of query `row` of (batch, head), with
// every variant of `options` (window, softcap, ALiBi, dropout, block mask). A row without
// visible keys gives zeros and lse = −∞ (the sink logit with options.sinks). `batch_offset` as Semantics::batch_offset: the
// batch index that keys dropout and (batch, heads) ALiBi slopes is batch + batch_offset.
void attention_row(const AttentionProblem& problem, const AttentionOptions& options,
                   const TensorView& q,
                   const TensorView& k, const TensorView& v, std::int64_t batch,
                   std::int64_t head, std::int64_t row, double* out_row, double* lse,
                   std::int64_t batch_offset = 0);

// attention, attention_probs and attention_backward run rows on OpenMP threads; an exception
// from the options' score hook (score_mod, mask_mod: its score, mask and derivative) reaches
// the caller once the threads are done.
struct Result {
  std::vector<double> out;  // (batch, seqlen_q, heads_q, head_dim_v), contiguous
  std::vector<double> lse;  // (batch, heads_q, seqlen_q), contiguous
};
Result attention(const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& options = {});

// The attention probabilities after dropout — P/(1 − p) where kept, 0 where dropped or
// masked — as upstream's return_attn_probs: (batch, heads_q, seqlen_q, seqlen_k) float32.
// It materializes Sq × Sk per head: for testing and inspection, never for speed.
// `batch_offset` as attention_row's: sequence b of a variable-length batch, taken as a
// batch-1 problem, draws its dropout as batch index b.
Tensor attention_probs(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOptions& options = {}, std::int64_t batch_offset = 0);

struct Gradients {
  std::vector<double> dq;  // (batch, seqlen_q, heads_q, head_dim), contiguous
  std::vector<double> dk;  // (batch, seqlen_k, heads_kv, head_dim), contiguous
  std::vector<double> dv;  // (batch, seqlen_k, heads_kv, head_dim_v), contiguous
  std::vector<double> dsinks;  // (heads_q) with options.sinks, else empty
  // attn_mask's shape, contiguous, with a float attn_mask (a bias), else empty: dS = P ∘ (dP − D)
  // (the score's gradient after the mask step) summed over the bias's size-1 dims.
  std::vector<double> dbias;
};
// Analytic gradients of Σ dout ∘ attention(q, k, v) in float64, row by row:
// P = softmax(S), dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)),
// dQ = scale · dS K, dK += scale · dSᵀ Q. dk/dv of a kv head sum over its q heads.
Gradients attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const AttentionOptions& options = {});

}  // namespace flashattn::reference
