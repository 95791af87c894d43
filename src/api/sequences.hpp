// Per-sequence views of a batch that runs one sequence at a time (variable-length batches,
// the sequences of a KV cache): each sequence becomes a batch-1 problem on views of the
// caller's tensors, with the options restricted to it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

// Reads and checks one cu_seqlens tensor: int32 (batch + 1), starts at 0, non-decreasing,
// ends at `total`, every length at most `max_seqlen` (named `max_name` in errors).
std::vector<std::int64_t> read_offsets(const char* name, const TensorView& cu, std::int64_t total,
                                       std::int64_t max_seqlen, const char* max_name);

// The options of sequence b: ALiBi slopes of shape (batch, heads_q) become that sequence's
// row. check_sequence_options validates those slopes against the whole batch first.
void check_sequence_options(const AttentionOptions& options, std::int64_t batch, std::int64_t heads_q);
AttentionOptions sequence_options(const AttentionOptions& options, std::int64_t b);

// `view`'s data advanced by `elements` elements (null stays null).
template <class View>
auto advanced(const View& view, std::int64_t elements) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(view.data)>>, const unsigned char,
                                  unsigned char>;
  if (view.data == nullptr) return view.data;
  return static_cast<decltype(view.data)>(static_cast<Byte*>(view.data) +
                                          elements * static_cast<std::int64_t>(dtype_size(view.dtype)));
}

// Tokens [begin, begin + len) of a packed (total, heads, dim) view as a (1, len, heads, dim) view.
template <class View>
View packed_sequence(const View& t, std::int64_t begin, std::int64_t len) {
  View r;
  r.data = advanced(t, begin * t.strides[0]);
  r.dtype = t.dtype;
  r.device = t.device;
  r.rank = 4;
  r.shape = {1, len, t.shape[1], t.shape[2]};
  r.strides = {std::max<std::int64_t>(len, 1) * t.strides[0], t.strides[0], t.strides[1], t.strides[2]};
  return r;
}

// Columns [begin, begin + len) of a packed (heads, total) lse view as a (1, heads, len) view.
template <class View>
View packed_lse(const View& t, std::int64_t begin, std::int64_t len) {
  View r = t;
  r.data = advanced(t, begin * t.strides[1]);
  r.rank = 3;
  r.shape = {1, t.shape[0], len, 0};
  r.strides = {t.shape[0] * t.strides[0] + len * t.strides[1], t.strides[0], t.strides[1], 0};
  return r;
}

// Batch element b of a view, as a batch of one.
template <class View>
View batch_element(const View& t, std::int64_t b) {
  View r = t;
  r.data = advanced(t, b * t.strides[0]);
  r.shape[0] = 1;
  return r;
}

// Rows [from, from + n) of cache row `row` of a (rows, slots, heads, dim) view, as a
// (1, n, heads, dim) view.
template <class View>
View cache_rows(const View& t, std::int64_t row, std::int64_t from, std::int64_t n) {
  View r = t;
  r.data = advanced(t, row * t.strides[0] + from * t.strides[1]);
  r.shape = {1, n, t.shape[2], t.shape[3], 0};
  r.strides = {std::max<std::int64_t>(n, 1) * t.strides[1], t.strides[1], t.strides[2], t.strides[3], 0};
  return r;
}

}  // namespace flashattn::detail
