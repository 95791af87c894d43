#include "views.hpp"

#include <omp.h>

#include <cstring>

#include "flashattn/error.hpp"

namespace flashattn::dist::detail {
namespace {

// Calls row(dst_row, src_row) with pointers to the first element of every innermost row of
// two views of one shape (rank 3 or 4), rows in parallel.
template <class Row>
void for_each_row(const TensorView& dst, const TensorView& src, int threads, Row row) {
  const bool rank4 = dst.rank == 4;
  const std::int64_t n0 = dst.shape[0], n1 = dst.shape[1], n2 = rank4 ? dst.shape[2] : 1;
  const auto dst_size = static_cast<std::int64_t>(dtype_size(dst.dtype));
  const auto src_size = static_cast<std::int64_t>(dtype_size(src.dtype));
  const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for collapse(3) schedule(static) num_threads(team)
  for (std::int64_t i0 = 0; i0 < n0; ++i0)
    for (std::int64_t i1 = 0; i1 < n1; ++i1)
      for (std::int64_t i2 = 0; i2 < n2; ++i2) {
        const std::int64_t d = i0 * dst.strides[0] + i1 * dst.strides[1] + (rank4 ? i2 * dst.strides[2] : 0);
        const std::int64_t s = i0 * src.strides[0] + i1 * src.strides[1] + (rank4 ? i2 * src.strides[2] : 0);
        row(static_cast<unsigned char*>(const_cast<void*>(dst.data)) + d * dst_size,
            static_cast<const unsigned char*>(src.data) + s * src_size);
      }
}

// Calls body(load) with a function that reads element i of a row of `dtype` as float, so
// that the dtype is dispatched once per call, not per element.
template <class Body>
void with_loader(DType dtype, Body body) {
  switch (dtype) {
    case DType::f32:
      return body([](const unsigned char* row, std::int64_t i) { return reinterpret_cast<const float*>(row)[i]; });
    case DType::bf16:
      return body([](const unsigned char* row, std::int64_t i) {
        return bf16_to_float(reinterpret_cast<const std::uint16_t*>(row)[i]);
      });
    case DType::f16:
      return body([](const unsigned char* row, std::int64_t i) {
        return f16_to_float(reinterpret_cast<const std::uint16_t*>(row)[i]);
      });
    default: throw Error("dist: dtype " + to_string(dtype) + " is not a floating dtype");
  }
}

}  // namespace

void copy(const MutableTensorView& dst, const TensorView& src, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  if (dst.dtype == src.dtype) {
    const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(dst.dtype);
    for_each_row(dst, src, threads, [&](unsigned char* d, const unsigned char* s) { std::memcpy(d, s, bytes); });
    return;
  }
  with_loader(src.dtype, [&](auto load) {
    for_each_row(dst, src, threads, [&](unsigned char* d, const unsigned char* s) {
      for (std::int64_t c = 0; c < n; ++c) {
        const float x = load(s, c);
        switch (dst.dtype) {
          case DType::f32: reinterpret_cast<float*>(d)[c] = x; break;
          case DType::bf16: reinterpret_cast<std::uint16_t*>(d)[c] = float_to_bf16(x); break;
          default: reinterpret_cast<std::uint16_t*>(d)[c] = float_to_f16(x); break;
        }
      }
    });
  });
}

void accumulate(const MutableTensorView& dst, const TensorView& src, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  with_loader(src.dtype, [&](auto load) {
    for_each_row(dst, src, threads, [&](unsigned char* d, const unsigned char* s) {
      auto* out = reinterpret_cast<float*>(d);
      for (std::int64_t c = 0; c < n; ++c) out[c] += load(s, c);
    });
  });
}

void fill(const MutableTensorView& dst, float value, int threads) {
  const std::int64_t n = dst.shape[dst.rank - 1];
  const std::uint16_t half = dst.dtype == DType::bf16 ? float_to_bf16(value) : float_to_f16(value);
  for_each_row(dst, dst, threads, [&](unsigned char* d, const unsigned char*) {
    for (std::int64_t c = 0; c < n; ++c) {
      if (dst.dtype == DType::f32)
        reinterpret_cast<float*>(d)[c] = value;
      else
        reinterpret_cast<std::uint16_t*>(d)[c] = half;
    }
  });
}

}  // namespace flashattn::dist::detail
