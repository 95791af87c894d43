// The numerics experiments of docs/algorithm.md §4-§5 that more than one subcommand runs: `flashattn
// numerics` reports them in full, `flashattn tour` (chapters 4 and 5) at its own sizes.
// One implementation, so both commands print the same measurement.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <random>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

// Float32 q, k, v of the problem's shapes, entries N(0, 1).
struct Qkv {
  Tensor q, k, v;
};
Qkv random_qkv(const AttentionProblem& problem, std::mt19937_64& rng);

// Rescales of the online-softmax state counted by the kernel (AttentionOptions::
// rescale_counts), classic rule (τ = 0) against τ = AttentionProblem::kDefaultRescaleThreshold,
// on random rows and on adversarial rows whose scores grow steadily with the key index.
// Keys: threshold, {random, adversarial}.{classic, conditional, *_per_row, rows, key_tiles,
// max_abs_diff}, adversarial.score_growth_log2.
nlohmann::json rescale_counts(const AttentionProblem& problem, std::mt19937_64& rng, int threads);
void print_rescale_counts(const nlohmann::json& rescale);

// Attention output RMSE against the float64 reference, inputs N(0, 1) with outliers:
// bf16 attention, FP8 per tensor, per block (the plan's tiles), per tensor + Hadamard
// rotation, per block + Hadamard. The problem must be float32 and non-causal.
nlohmann::json fp8_error(const AttentionProblem& problem, std::uint64_t seed, Fp8Format format, int threads);
void print_fp8_error(const nlohmann::json& fp8);

// Exponentials per second of each exp2 alone (exact, poly3), one thread, on an array that
// stays in L1 as the kernel's S tile row does: median of `repeats` timings, interleaved.
// Keys: exact_gexp_per_s, poly3_gexp_per_s.
nlohmann::json exp2_throughput(int repeats);

}  // namespace flashattn::cli
