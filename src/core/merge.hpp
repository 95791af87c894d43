// The split-KV merge as the library's drivers run it (merge.cpp).
#pragma once

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// merge_attention_states of rows [row_begin, row_end) — (batch, seqlen_q, heads_q) rows in
// that order — on the calling thread, without its checks, for partial results given by their
// softmax states instead of their lses: `maxes` (laid out as lses) the states' maxima in log2
// units and `sums` (laid out as maxes, from its own pointer) their ℓ — apart, exact where one
// float32 lse could not hold m + log ℓ (|m| huge: log ℓ lost, partials over different
// numbers of keys weighed alike). With `out_sums` null, lse receives the merged lse; else the
// merged state, as the partials' (lse its max, out_sums at lse's offsets its ℓ), for a merge
// that follows. For views the library built itself, in a parallel region that is already
// running (where an exception could not leave it), head_dim_v at most
// AttentionProblem::kMaxHeadDim; a row's bits do not depend on who merges it.
void merge_states(const TensorView& outs, const TensorView& maxes, const float* sums, const MutableTensorView& out,
                  const MutableTensorView& lse, float* out_sums, std::int64_t row_begin, std::int64_t row_end);

}  // namespace flashattn::detail
