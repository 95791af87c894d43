// The online-softmax state of one score row: the heart of every FlashAttention kernel.
//
// Scores are kept in log2 units: the kernel multiplies Q·Kᵀ by softmax_scale·log2(e)
// so that every exponential is a plain exp2 (docs/algorithm.md §2, §3). The state is
//   max  — a reference maximum m of the scores seen so far (log2 units),
//   sum  — ℓ = Σ 2^(s_j − m) over those scores,
// and the caller's unnormalized output õ = Σ 2^(s_j − m) v_j, which it keeps in its own
// buffer (a d-vector per row does not belong in a scalar state). Whenever m changes, õ
// must be multiplied by the factor that `rescale_to` / `merge` return. At the end
// o = õ / ℓ and the natural-log log-sum-exp is (m + log2 ℓ)·ln 2.
//
// −∞ guards: a row that has seen no visible key keeps m = −∞ and ℓ = 0. Rescaling from
// −∞ would compute 2^(−∞ − (−∞)) = NaN, so the factor is defined as 0 there (õ is 0
// anyway); finalize gives out = 0 and lse = −∞ for such rows, never NaN.
// NaN scores (NaN or ±∞ in the inputs) are not hidden: a NaN maximum or sum propagates
// to that row's output and lse, and only to that row. (A non-finite value in V reaches, in
// P·V, also the rows whose micro-tile computes its key with an exact zero probability:
// 0·∞ = NaN, as in any dense product — in the tiled kernels a strip of rows, which under
// pack_gqa spans the q heads of a kv head; in the decode kernels every row of the kv head's
// call, all its q heads and query rows.)
#pragma once

#include <cmath>
#include <limits>

namespace flashattn {

struct OnlineSoftmaxState {
  static constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x·log2e)
  static constexpr float kLn2 = 0.6931471805599453f;    // ln(2): back to natural log

  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;

  // Moves the reference maximum up to `tile_max` when that exceeds it by more than
  // `threshold` (log2 units; 0 = whenever it grows, the classic rule) and returns the factor
  // 2^(m_old − m_new) by which the caller must multiply its õ (already applied to sum).
  // Conditional rescaling (docs/algorithm.md §5): with threshold τ the tile's 2^(s − m) stay ≤ 2^τ.
  // A NaN maximum is sticky: once a visible score was NaN, sum and õ are NaN and stay so.
  float rescale_to(float tile_max, float threshold = 0.0f) {
    if (tile_max <= max + threshold || std::isnan(max)) return 1.0f;  // a NaN tile_max propagates
    const float factor = max == -std::numeric_limits<float>::infinity()
                             ? 0.0f
                             : std::exp2(max - tile_max);
    max = tile_max;
    sum *= factor;
    return factor;
  }

  // Adds Σ 2^(s_j − max) of a tile that was exponentiated against the current max.
  void add(float tile_sum) { sum += tile_sum; }

  // Combines two states over disjoint key sets. Returns the factors {self, other} by
  // which the two unnormalized outputs must be multiplied before they are added.
  struct MergeFactors {
    float self;
    float other;
  };
  MergeFactors merge(const OnlineSoftmaxState& other) {
    if (std::isnan(max) || std::isnan(other.max)) {  // a NaN score on either side poisons the row
      max = sum = std::numeric_limits<float>::quiet_NaN();
      return {max, max};
    }
    const float new_max = std::fmax(max, other.max);
    if (new_max == -std::numeric_limits<float>::infinity()) return {1.0f, 0.0f};
    const float self_factor = std::exp2(max - new_max);    // 0 when max is −∞
    const float other_factor = std::exp2(other.max - new_max);
    sum = sum * self_factor + other.sum * other_factor;
    max = new_max;
    return {self_factor, other_factor};
  }

  // 1/ℓ, the factor that normalizes õ; 0 for a row without visible keys (NaN stays NaN).
  float inverse_sum() const { return sum == 0.0f ? 0.0f : 1.0f / sum; }

  // Natural-log log-sum-exp of the (scaled) scores; −∞ for a row without visible keys.
  float lse() const {
    if (sum == 0.0f) return -std::numeric_limits<float>::infinity();
    return (max + std::log2(sum)) * kLn2;
  }
};

}  // namespace flashattn
