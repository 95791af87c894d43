// "Standard attention" as the textbook does it, the baseline flashattn is measured
// against: per (batch, head), S = Q·Kᵀ materialized in float32 with OpenBLAS sgemm,
// P = softmax(S) materialized in place, then O = P·V with sgemm. Not part of the
// installed library (flashattn itself never depends on a BLAS).
#pragma once

#include <cstddef>
#include <string>

#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::baseline {

// Same contract as flashattn::forward. Returns the peak extra bytes it allocated
// (the Sq×Sk score matrix plus float32 copies of q, k, v and out of one head).
std::size_t standard_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                               const MutableTensorView& out, const MutableTensorView& lse,
                               const AttentionOptions& options = {});

// Standard attention's backward: per (batch, head) S and P are materialized again (as a
// framework's saved P would be), then dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P∘(dP − rowsum(P∘dP)),
// dQ = scale·dS·K, dK = scale·dSᵀ·Q with sgemm. Returns the peak extra bytes (P and dP of
// one head plus float32 copies of its operands and gradient accumulators).
std::size_t standard_attention_backward(const TensorView& dout, const TensorView& q,
                                        const TensorView& k, const TensorView& v,
                                        const MutableTensorView& dq, const MutableTensorView& dk,
                                        const MutableTensorView& dv,
                                        const AttentionOptions& options = {});

// The OpenBLAS kernel family in use (e.g. "Cooperlake", "Haswell"), and its threads.
std::string openblas_corename();
void set_blas_threads(int threads);

// Single-precision GEMM throughput of OpenBLAS on an n×n×n product, best of `repeats`.
double sgemm_gflops(int n, int threads, int repeats);

}  // namespace flashattn::baseline
