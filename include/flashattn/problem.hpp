// One description of an attention problem: shapes, dtype and mask options. It drives
// validation, the plan, the FLOP count reported by the CLI and benchmarks, and tests. What
// the library's own entry points know beyond it — the batch index of a sequence of a
// variable-length batch, an FP8 KV cache, FP8 probabilities — they keep beside it, internally.
#pragma once

#include <cstdint>
#include <string>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

struct AttentionProblem {
  std::int64_t batch = 1;
  std::int64_t seqlen_q = 0;
  std::int64_t seqlen_k = 0;
  std::int64_t heads_q = 1;
  std::int64_t heads_kv = 1;
  std::int64_t head_dim = 0;    // D, of q and k
  std::int64_t head_dim_v = 0;  // Dv, of v and out
  DType dtype = DType::f32;  // of q, k, v and out
  bool causal = false;
  CausalAlignment causal_alignment = CausalAlignment::bottom_right;  // of causal, window and ALiBi
  float softmax_scale = 0.0f;  // resolved: never unset here
  // Variants (see AttentionOptions), resolved: causal folds into window_right = 0.
  std::int64_t window_left = -1;   // −1: unbounded
  std::int64_t window_right = -1;  // −1: unbounded
  float softcap = 0.0f;
  bool alibi = false;
  bool sinks = false;  // options.sinks set
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  std::int64_t block_mask_block_size = 0;  // 0: no block mask
  // options.attn_mask: none, a boolean (u8) mask, or an additive (floating) bias.
  enum class MaskKind : std::uint8_t { none, boolean, bias };
  MaskKind attn_mask = MaskKind::none;
  // Forward numerics (docs/algorithm.md §5), resolved: exp2 is never automatic here.
  Exp2Impl exp2 = Exp2Impl::exact;
  float exp2_poly3_fraction = 0.0f;  // mixed only
  float rescale_threshold = 0.0f;    // log2 units
  // Default of AttentionOptions::rescale_threshold; the largest accepted keeps every
  // unrescaled probability 2^(s − m) ≤ 2^64 and ℓ ≤ seqlen_k·2^64 far from float's 2^128.
  static constexpr float kDefaultRescaleThreshold = 8.0f;
  static constexpr float kMaxRescaleThreshold = 64.0f;

  // The largest head_dim and head_dim_v: 576 takes DeepSeek's absorbed MLA decode (K rows of
  // 512 latent + 64 rotary features, V the 512 latent ones). Every kernel sizes its workspace
  // from the problem; decode_fp16 alone has a lower bound of its own (fp16_decode.hpp), and
  // the planner never chooses it above that.
  static constexpr std::int64_t kMaxHeadDim = 576;

  // The largest magnitude of a value the kernels multiply by log2 e in float32: softmax_scale,
  // softcap, sink logits, ALiBi slopes (checked, Error beyond it) and attn_mask biases (a
  // finite one beyond it counts as ±kLargestScaled). Just under float32's largest / log2 e
  // (2.3587e38), whose product with log2 e can round up to inf.
  static constexpr float kLargestScaled = 2.35e38f;

  // Validates q, k, v (and their consistency) and resolves the options.
  static AttentionProblem from_inputs(const TensorView& q, const TensorView& k,
                                      const TensorView& v, const AttentionOptions& options);
  // Builds and validates a problem from sizes alone (CLI, benchmarks, cost model).
  static AttentionProblem from_sizes(std::int64_t batch, std::int64_t seqlen_q,
                                     std::int64_t seqlen_k, std::int64_t heads_q,
                                     std::int64_t heads_kv, std::int64_t head_dim,
                                     std::int64_t head_dim_v, DType dtype,
                                     const AttentionOptions& options);

  // The key aligned with query row i (CausalAlignment): i + seqlen_k − seqlen_q bottom-right,
  // i top-left. causal, window and ALiBi measure from it.
  std::int64_t diagonal(std::int64_t row) const {
    return causal_alignment == CausalAlignment::top_left ? row : row + seqlen_k - seqlen_q;
  }
  // Keys [begin, end) query row i may attend to under causal and window (measured from
  // diagonal(i)); empty when begin >= end. A block mask may hide more inside the range.
  struct KeyRange {
    std::int64_t begin;
    std::int64_t end;
    std::int64_t size() const { return end > begin ? end - begin : 0; }
  };
  KeyRange key_range(std::int64_t row) const;
  // Upstream's convention for the headline GFLOP/s: 4·B·Hq·Sq·Sk·D, halved for causal.
  double conventional_forward_flops() const;
  // (query, key) pairs of one (batch, head) whose score is visible: inside key_range(row)
  // and, where block_mask is set (the validated u8 mask of AttentionOptions, blocks of
  // block_mask_block_size), in a non-zero block. Exact, O(Sq · key blocks).
  std::int64_t visible_pairs(const TensorView& block_mask = {}) const;
  // FLOPs of the visible scores only, 2·(D + Dv) per pair per (batch, head): what a
  // kernel that skips hidden scores needs, so GFLOP/s from it cannot exceed the machine's
  // peak on sparse, windowed or causal problems (conventional_forward_flops is the
  // dense-equivalent figure).
  double visible_forward_flops(const TensorView& block_mask = {}) const;

  std::string describe() const;
};

}  // namespace flashattn
