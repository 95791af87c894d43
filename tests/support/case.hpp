// One test case: an AttentionProblem (shapes, dtype and the options it resolves), the
// options of the call, and the seed of its random inputs. Every kernel test builds its
// cases from this type, so a failure names the same fields everywhere (describe()).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/options.hpp"
#include "flashattn/problem.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::test {

// Sizes of q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv,
// head_dim) and v (batch, seqlen_k, heads_kv, head_dim_v).
struct Shape {
  std::int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
};

// A case's inputs, contiguous in the public layouts; dout as out, for the backward.
struct Inputs {
  Tensor q, k, v, dout;
};

class Case {
 public:
  // Validates the sizes and options and resolves them as the library does
  // (AttentionProblem::from_sizes): an impossible case is an Error, not a skipped test.
  Case(const Shape& shape, DType dtype, AttentionOptions options = {}, std::uint64_t seed = 0);

  const AttentionProblem& problem() const { return problem_; }
  const AttentionOptions& options() const { return options_; }
  std::uint64_t seed() const { return seed_; }

  // The same case with its options changed by `edit`, resolved again.
  Case with(const std::function<void(AttentionOptions&)>& edit) const;
  // The same case with ALiBi slopes 2^(−1 − h/2) for q head h, owned by the case (its
  // copies share them, so options().alibi_slopes stays valid as long as any copy lives).
  Case with_alibi() const;

  // N(0, 1) inputs rounded to the dtype (tools/support/random_inputs.hpp): q, k, v from the
  // seeds seed, seed + 1, seed + 2; dout from seed + 3.
  Inputs inputs() const;

  // The problem (AttentionProblem::describe()), the options of the call it does not hold
  // where they are not the defaults (threads, splits, Q tile, kernels, determinism), and
  // the seed.
  std::string describe() const;

 private:
  Shape shape_;
  AttentionProblem problem_;
  AttentionOptions options_;
  std::uint64_t seed_;
  std::shared_ptr<const Tensor> alibi_slopes_;
};

// An FP8 (e4m3) KV cache of shape (batch, seqlen, heads_kv, dim): finite codes i % 113 (K)
// and i % 101 (V) at flat index i, descales 0.5 (K) and 0.25 (V) per (cache row, kv head).
struct Fp8CacheTensors {
  Tensor k_codes, v_codes, k_scale, v_scale;
  // Views of the four tensors; every other field unset.
  KvCache cache();
};
Fp8CacheTensors fp8_cache(const std::vector<std::int64_t>& shape);

}  // namespace flashattn::test
