// The numerics experiments of docs/algorithm.md §4-§5 that more than one subcommand runs: `flashattn
// numerics` reports them in full, `flashattn tour` (chapters 4 and 5) at its own sizes.
// One implementation, so both commands print the same measurement.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "flashattn/flashattn.hpp"
#include "tools/support/random_inputs.hpp"

namespace flashattn::cli {

// Float32 q, k, v of the problem's shapes, entries N(0, 1) (tools/support/random_inputs.hpp),
// seeded from the next value of `rng`.
using Qkv = support::Qkv;
Qkv random_qkv(const AttentionProblem& problem, std::mt19937_64& rng);

// Rescales of the online-softmax state counted by the kernel (AttentionOptions::
// rescale_counts), classic rule (τ = 0) against τ = AttentionProblem::kDefaultRescaleThreshold,
// on random rows and on adversarial rows whose scores grow steadily with the key index.
struct RescaleCase {
  std::int64_t classic = 0, conditional = 0;  // rescales in all rows
  double classic_per_row = 0.0, conditional_per_row = 0.0;
  std::int64_t rows = 0, key_tiles = 0;
  double max_abs_diff = 0.0;  // between the two rules' outputs
};
struct RescaleCounts {
  float threshold = 0.0f;
  RescaleCase random, adversarial;
  double score_growth_log2 = 0.0;  // of the adversarial rows, first key to last
};
RescaleCounts rescale_counts(const AttentionProblem& problem, std::mt19937_64& rng, int threads);
void print_rescale_counts(const RescaleCounts& rescale);

// Attention output RMSE against the float64 reference, inputs N(0, 1) with outliers:
// bf16 attention, FP8 per tensor, per block (the plan's tiles), per tensor + Hadamard
// rotation, per block + Hadamard. The problem must be float32 and non-causal.
struct Fp8Error {
  std::string format;
  std::uint64_t seed = 0, rotation_seed = 0;
  double outlier_fraction = 0.0, outlier_std = 0.0;
  std::string output_dtype;
  std::int64_t block_q = 0, block_k = 0;  // the plan's tiles, the blocks of "per block"
  double rmse_bf16 = 0.0, rmse_per_tensor = 0.0, rmse_per_block = 0.0, rmse_hadamard = 0.0,
         rmse_per_block_hadamard = 0.0;
};
Fp8Error fp8_error(const AttentionProblem& problem, std::uint64_t seed, Fp8Format format, int threads);
void print_fp8_error(const Fp8Error& fp8);

// Exponentials per second of each exp2 alone (exact, poly3), one thread, on an array that
// stays in L1 as the kernel's S tile row does: median of `repeats` timings, interleaved.
struct Exp2Throughput {
  double exact_gexp_per_s = 0.0, poly3_gexp_per_s = 0.0;
};
Exp2Throughput exp2_throughput(int repeats);

}  // namespace flashattn::cli
