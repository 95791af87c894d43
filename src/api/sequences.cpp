#include "src/api/sequences.hpp"

#include "src/core/validate.hpp"

namespace flashattn::detail {

void check_sequence_options(const AttentionOptions& options, std::int64_t batch, std::int64_t heads_q) {
  const TensorView& a = options.alibi_slopes;
  if (a.rank != 2) return;  // rank 1 (or anything else) is checked per sequence
  check_view("alibi_slopes", a, 2, "(batch, heads_q)");
  check_dtype("alibi_slopes", a, DType::f32, "slopes are float32");
  check_shape("alibi_slopes", a, {batch, heads_q}, "(batch, heads_q)");
}

AttentionOptions sequence_options(const AttentionOptions& options, std::int64_t b) {
  AttentionOptions o = options;
  const TensorView& a = options.alibi_slopes;
  if (a.rank == 2 && a.data != nullptr) {
    o.alibi_slopes.data = static_cast<const float*>(a.data) + b * a.strides[0];
    o.alibi_slopes.rank = 1;
    o.alibi_slopes.shape = {a.shape[1], 0, 0, 0, 0};
    o.alibi_slopes.strides = {a.strides[1], 0, 0, 0, 0};
  }
  return o;
}

}  // namespace flashattn::detail
