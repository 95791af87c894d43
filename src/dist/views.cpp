#include "views.hpp"

#include <omp.h>

#include "src/core/element.hpp"

namespace flashattn::dist::detail {
namespace {

// Calls row(dst_offset, src_offset) for the first element of every innermost row of two views
// of one shape (rank 3 or 4), rows in parallel.
template <class Row>
void for_each_row(const TensorView& dst, const TensorView& src, int threads, Row row) {
  const bool rank4 = dst.rank == 4;
  const std::int64_t n0 = dst.shape[0], n1 = dst.shape[1], n2 = rank4 ? dst.shape[2] : 1;
  const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for collapse(3) schedule(static) num_threads(team)
  for (std::int64_t i0 = 0; i0 < n0; ++i0)
    for (std::int64_t i1 = 0; i1 < n1; ++i1)
      for (std::int64_t i2 = 0; i2 < n2; ++i2)
        row(i0 * dst.strides[0] + i1 * dst.strides[1] + (rank4 ? i2 * dst.strides[2] : 0),
            i0 * src.strides[0] + i1 * src.strides[1] + (rank4 ? i2 * src.strides[2] : 0));
}

}  // namespace

void copy(const MutableTensorView& dst, const TensorView& src, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  for_each_row(dst, src, threads, [&](std::int64_t d, std::int64_t s) {
    for (std::int64_t c = 0; c < n; ++c)
      flashattn::detail::store_element(dst, d + c * dst.strides[dst.rank - 1],
                                       flashattn::detail::load_element(src, s + c * src.strides[src.rank - 1]));
  });
}

void accumulate(const MutableTensorView& dst, const TensorView& src, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  auto* out = static_cast<float*>(dst.data);
  for_each_row(dst, src, threads, [&](std::int64_t d, std::int64_t s) {
    for (std::int64_t c = 0; c < n; ++c)
      out[d + c * dst.strides[dst.rank - 1]] +=
          flashattn::detail::load_element(src, s + c * src.strides[src.rank - 1]);
  });
}

void fill(const MutableTensorView& dst, float value, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  for_each_row(dst, dst, threads, [&](std::int64_t d, std::int64_t) {
    for (std::int64_t c = 0; c < n; ++c) flashattn::detail::store_element(dst, d + c * dst.strides[dst.rank - 1], value);
  });
}

}  // namespace flashattn::dist::detail
