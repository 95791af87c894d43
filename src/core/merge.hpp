// The split-KV merge as the library's drivers run it (merge.cpp).
#pragma once

#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// merge_attention_states(outs, lses, out, lse) on the calling thread, without its checks: for
// views the library built itself, in a parallel region that is already running (where an
// exception could not leave it). The same arithmetic row by row, so the same bits.
void merge_states(const TensorView& outs, const TensorView& lses, const MutableTensorView& out,
                  const MutableTensorView& lse);

}  // namespace flashattn::detail
