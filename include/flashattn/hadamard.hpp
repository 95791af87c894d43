// Incoherent processing (docs/algorithm.md §4): the random orthogonal rotation FlashAttention-3 applies
// to Q and K before quantizing them to FP8. R = H·diag(signs)/√n, with H the n×n
// Sylvester–Hadamard matrix (entries ±1, H·Hᵀ = n·I) and signs ±1 drawn from a seed, is
// orthogonal; with the same seed for both, (Q·R)(K·R)ᵀ = Q·Kᵀ, so scores are unchanged in
// exact arithmetic while each outlier channel is spread evenly over all n channels.
// Applied in O(n log n) per row by the fast Walsh–Hadamard transform.
#pragma once

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn {

// The transform's size for rows of `dim` features: the power of two >= dim (an Error above 2^62).
std::int64_t hadamard_dim(std::int64_t dim);
// Sign (+1 or −1) of column `column` of diag(signs) for `seed`.
float hadamard_sign(std::uint64_t seed, std::int64_t column);

// y = x·R along the last dimension.
//   x (batch, seqlen, heads, dim), any floating dtype
//   y (batch, seqlen, heads, hadamard_dim(dim)), float32; x is zero-padded up to that size.
// With padding, pass softmax_scale = 1/sqrt(dim) to attention explicitly: its default would
// use the padded size.
void hadamard_rotate(const TensorView& x, const MutableTensorView& y, std::uint64_t seed);
// Allocating overload.
Tensor hadamard_rotate(const TensorView& x, std::uint64_t seed);

}  // namespace flashattn
