// The dropout mask as a pure function of (seed, offset, batch, head, row, column): a
// counter-based generator, so the mask is the same whatever the tiling, the thread count
// or the pass (forward and backward draw identical bits). Upstream uses Philox; this is
// the same idea with cheaper mixing that vectorizes on 32-bit lanes everywhere:
//   row_key = splitmix64(seed, offset, batch, head, row), folded to 32 bits,
//   bits    = lowbias32(row_key ^ lowbias32(column + 1)),
//   keep    ⇔ bits >= round(dropout_p · 2^32).
// splitmix64 (Steele, Lea, Flood 2014) and lowbias32 (Wellons' hash-prospector,
// bias 0.17) are bijective integer mixers; the kernels evaluate the same expression.
#pragma once

#include <cstdint>

namespace flashattn {

constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr std::uint32_t lowbias32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

constexpr std::uint32_t dropout_row_key(std::uint64_t seed, std::uint64_t offset, std::int64_t batch,
                                        std::int64_t head, std::int64_t row) {
  std::uint64_t k = splitmix64(seed);
  k = splitmix64(k ^ offset);
  k = splitmix64(k ^ static_cast<std::uint64_t>(batch));
  k = splitmix64(k ^ static_cast<std::uint64_t>(head));
  k = splitmix64(k ^ static_cast<std::uint64_t>(row));
  return static_cast<std::uint32_t>(k ^ (k >> 32));
}

constexpr std::uint32_t dropout_threshold(float dropout_p) {
  const double t = static_cast<double>(dropout_p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<std::uint32_t>(t + 0.5);
}

constexpr bool dropout_keep_bits(std::uint32_t row_key, std::int64_t column, std::uint32_t threshold) {
  return lowbias32(row_key ^ lowbias32(static_cast<std::uint32_t>(column) + 1u)) >= threshold;
}

// True when score (row, column) of (batch, head) survives dropout with probability p.
constexpr bool dropout_keep(std::uint64_t seed, std::uint64_t offset, std::int64_t batch,
                            std::int64_t head, std::int64_t row, std::int64_t column, float dropout_p) {
  return dropout_keep_bits(dropout_row_key(seed, offset, batch, head, row), column,
                           dropout_threshold(dropout_p));
}

}  // namespace flashattn
