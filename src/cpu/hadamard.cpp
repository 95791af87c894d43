// The random Hadamard rotation of incoherent processing: a fast Walsh–Hadamard transform
// per row (log2 n butterfly passes), then the random signs and the 1/√n normalization.
#include "flashattn/hadamard.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "flashattn/dropout.hpp"
#include "flashattn/error.hpp"
#include "src/core/element.hpp"
#include "src/core/validate.hpp"

namespace flashattn {

std::int64_t hadamard_dim(std::int64_t dim) {
  constexpr std::int64_t kLargest = std::int64_t{1} << 62;  // the largest power of two in int64
  if (dim > kLargest)
    throw Error("hadamard_dim: head_dim " + std::to_string(dim) + " has no power of two at or above it in int64");
  std::int64_t n = 1;
  while (n < dim) n *= 2;
  return n;
}

float hadamard_sign(std::uint64_t seed, std::int64_t column) {
  return (splitmix64(splitmix64(seed) ^ static_cast<std::uint64_t>(column)) & 1u) != 0 ? -1.0f : 1.0f;
}

void hadamard_rotate(const TensorView& x, const MutableTensorView& y, std::uint64_t seed) {
  constexpr const char* kXLayout = "(batch, seqlen, heads, dim)";
  detail::check_view("x", x, 4, kXLayout);
  if (!is_floating(x.dtype)) throw Error("x: dtype " + to_string(x.dtype) + " is not a floating dtype");
  const std::int64_t dim = x.shape[3], n = hadamard_dim(dim);
  detail::check_view("y", y, 4, "(batch, seqlen, heads, n)");
  detail::check_dtype("y", y, DType::f32, "the rotation is computed and returned in float32");
  if (y.shape[3] != n)
    throw Error("y: last dim " + std::to_string(y.shape[3]) + " must be " + std::to_string(n) +
                ", the power of two >= x's dim " + std::to_string(dim) + " (the transform's size)");
  detail::check_shape("y", y, {x.shape[0], x.shape[1], x.shape[2], n}, "(batch, seqlen, heads, n)");
  detail::check_output_layout("y", y);
  detail::check_no_overlap("y", y, "x", x);
  std::vector<float> scaled_signs(static_cast<std::size_t>(n));
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));  // H/√n is orthogonal
  for (std::int64_t c = 0; c < n; ++c) scaled_signs[c] = hadamard_sign(seed, c) * norm;
  for (std::int64_t b = 0; b < x.shape[0]; ++b)
    for (std::int64_t s = 0; s < x.shape[1]; ++s)
      for (std::int64_t h = 0; h < x.shape[2]; ++h) {
        float* row = static_cast<float*>(y.data) + detail::offset4(y, b, s, h, 0);
        for (std::int64_t c = 0; c < n; ++c)
          row[c] = c < dim ? detail::load_element(x, detail::offset4(x, b, s, h, c)) : 0.0f;
        // row ← row·H: pass `half` combines pairs (j, j + half) inside blocks of 2·half.
        for (std::int64_t half = 1; half < n; half *= 2)
          for (std::int64_t i = 0; i < n; i += 2 * half)
            for (std::int64_t j = i; j < i + half; ++j) {
              const float a = row[j], c = row[j + half];
              row[j] = a + c;
              row[j + half] = a - c;
            }
        for (std::int64_t c = 0; c < n; ++c) row[c] *= scaled_signs[c];
      }
}

Tensor hadamard_rotate(const TensorView& x, std::uint64_t seed) {
  detail::check_view("x", x, 4, "(batch, seqlen, heads, dim)");
  Tensor y(DType::f32, {x.shape[0], x.shape[1], x.shape[2], hadamard_dim(x.shape[3])});
  hadamard_rotate(x, y.view(), seed);
  return y;
}

}  // namespace flashattn
