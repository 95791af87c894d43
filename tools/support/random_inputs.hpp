// Random attention inputs: the one generator of the tests, the CLI and the benchmarks.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::support {

// A tensor of N(0, 1) values rounded to `dtype` (a floating dtype), never exactly zero (a
// zero would hide a missing product). The values depend on `seed` and the shape's element
// count only, not on the thread count: the elements are drawn in fixed-size blocks, each
// from its own generator seeded from (seed, block index), the blocks in parallel.
Tensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::uint64_t seed);

struct Qkv {
  Tensor q;  // (batch, seqlen_q, heads_q, head_dim)
  Tensor k;  // (batch, seqlen_k, heads_kv, head_dim)
  Tensor v;  // (batch, seqlen_k, heads_kv, head_dim_v)
};
// q, k and v of `problem` in its dtype and layout, from the seeds seed, seed + 1, seed + 2.
Qkv random_inputs(const AttentionProblem& problem, std::uint64_t seed);

}  // namespace flashattn::support
