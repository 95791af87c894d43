// The split-KV merge as the library's drivers run it (merge.cpp).
#pragma once

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// merge_attention_states(outs, lses, out, lse) of rows [row_begin, row_end) — (batch, seqlen_q,
// heads_q) rows in that order — on the calling thread, without its checks: for views the
// library built itself, in a parallel region that is already running (where an exception
// could not leave it), head_dim_v at most AttentionProblem::kMaxHeadDim. The same arithmetic
// row by row, so the same bits.
void merge_states(const TensorView& outs, const TensorView& lses, const MutableTensorView& out,
                  const MutableTensorView& lse, std::int64_t row_begin, std::int64_t row_end);

// The same for the drivers' split-KV partials, each given by its softmax state instead of its
// lse: `maxes` (laid out as lses) the states' maxima in log2 units and `sums` (contiguous in
// the same order) their ℓ. Exact where one float32 lse could not hold m + log ℓ (|m| huge).
void merge_split_states(const TensorView& outs, const TensorView& maxes, const float* sums,
                        const MutableTensorView& out, const MutableTensorView& lse, std::int64_t row_begin,
                        std::int64_t row_end);

}  // namespace flashattn::detail
