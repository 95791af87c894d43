#include "tools/support/random_inputs.hpp"

#include <algorithm>
#include <random>
#include <string>
#include <utility>

#include "flashattn/error.hpp"

namespace flashattn::support {

namespace {

// Elements per block: large enough that seeding a generator (312 words) costs nothing beside
// drawing the block, small enough that a CLI input of millions of elements spreads over
// every thread.
constexpr std::int64_t kBlockElements = std::int64_t{1} << 16;
// Block b's generator is seeded with seed + b·kBlockSeedStride (2^64 over the golden ratio,
// odd): block 0 keeps the seed itself, so a tensor of one block holds the values of a single
// generator seeded with `seed`, and the seeds of neighbouring tensors (seed, seed + 1, ...)
// never meet those of another's blocks within 2^60 blocks.
constexpr std::uint64_t kBlockSeedStride = 0x9E3779B97F4A7C15ull;

}  // namespace

Tensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::uint64_t seed) {
  if (!is_floating(dtype))
    throw Error("random_tensor: dtype " + to_string(dtype) + " is not a floating dtype (f32, bf16, f16)");
  Tensor t(dtype, std::move(shape));
  const std::int64_t n = t.numel();
  const std::int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (std::int64_t b = 0; b < blocks; ++b) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(b) * kBlockSeedStride);
    std::normal_distribution<float> normal;
    const std::int64_t end = std::min(n, (b + 1) * kBlockElements);
    for (std::int64_t i = b * kBlockElements; i < end; ++i) {
      const float x = normal(rng);
      t.set(i, x == 0.0f ? 0.5f : x);
    }
  }
  return t;
}

Qkv random_inputs(const AttentionProblem& p, std::uint64_t seed) {
  return {random_tensor(p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, seed),
          random_tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, seed + 1),
          random_tensor(p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v}, seed + 2)};
}

}  // namespace flashattn::support
