// Small view operations of the ring: slices along the token dimension, and element-wise
// copies and sums between tensors of any floating dtype (float32 accumulators).
#pragma once

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn::dist::detail {

// `count` entries of dimension `dim` from `begin` on (same strides).
template <class Ptr>
BasicTensorView<Ptr> slice(BasicTensorView<Ptr> view, int dim, std::int64_t begin, std::int64_t count) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const unsigned char, unsigned char>;
  view.data = static_cast<Byte*>(view.data) +
              begin * view.strides[dim] * static_cast<std::int64_t>(dtype_size(view.dtype));
  view.shape[dim] = count;
  return view;
}

// Tokens [begin, begin + count) of a (batch, seqlen, heads, dim) tensor.
template <class Ptr>
BasicTensorView<Ptr> tokens(const BasicTensorView<Ptr>& view, std::int64_t begin, std::int64_t count) {
  return slice(view, 1, begin, count);
}
// Tokens [begin, begin + count) of a (batch, heads, seqlen) log-sum-exp.
template <class Ptr>
BasicTensorView<Ptr> lse_tokens(const BasicTensorView<Ptr>& view, std::int64_t begin, std::int64_t count) {
  return slice(view, 2, begin, count);
}

// Element-wise over views of one shape, rank 3 or 4, with a contiguous last dimension, on
// `threads` OpenMP threads (AttentionOptions::num_threads: 0 = all cores):
// dst = src, converting the dtype.
void copy(const MutableTensorView& dst, const TensorView& src, int threads);
// dst += src, dst float32.
void accumulate(const MutableTensorView& dst, const TensorView& src, int threads);
// Every element of dst set to `value`.
void fill(const MutableTensorView& dst, float value, int threads);

}  // namespace flashattn::dist::detail
