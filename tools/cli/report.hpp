// The JSON reports of `run --json` and `bench --json`: the machine's facts and one object per
// measured case. Written here, so that the other files need the JSON library's declarations
// (json_fwd.hpp) at most.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "tools/cli/decode.hpp"
#include "tools/cli/measure.hpp"

namespace flashattn::cli {

// One benchmark case in the JSON schema shared by `run --json` and `bench --json`.
nlohmann::json case_json(const Measurement& m, const AttentionProblem& p);
// Whether a case states its window (window_left, window_right): a left bound, or a right one
// that causal does not already imply.
bool states_window(const AttentionProblem& p);
// Top-level facts of the machine and build: cpu, threads, simd_target, openblas_corename.
nlohmann::json machine_json(int threads);
nlohmann::json decode_json(const DecodeCase& c, const DecodeMeasurement& m);

// The whole reports of `run --json`, indented: the machine's facts, then the forward and
// backward cases (forward ones with their sampled max_error, `errors[i]` for `results[i]`)
// and the speedups over standard attention where it was timed...
std::string run_json(int threads, const AttentionProblem& p, const std::vector<Measurement>& results,
                     const std::vector<double>& errors, std::optional<double> speedup,
                     std::optional<double> backward_speedup);
// ... of a packed variable-length batch (--cu-seqlens-q/k) ...
struct VarlenRun {
  std::int64_t batch = 0, total_q = 0, total_k = 0;
  double fwd_seconds = 0.0, fwd_gflops = 0.0, max_error = 0.0;
  std::optional<double> bwd_seconds, bwd_gflops;  // with --backward
};
std::string varlen_run_json(int threads, const VarlenRun& r);
// ... and of one decoding step (--decode).
std::string decode_run_json(int threads, const DecodeCase& c, const DecodeMeasurement& m);

// `bench --json` (without --sweep or --quick): the machine's facts, OpenBLAS sgemm, the
// timed cases in order, then the decode cases, and the extra memory against seqlen.
struct TimedCase {
  Measurement m;  // its `out` left empty
  AttentionProblem p;
  std::optional<double> block_kept_fraction;  // the block-sparse cases
};
struct DecodeRun {
  DecodeCase c;
  DecodeMeasurement m;
};
struct MemoryRow {
  std::int64_t seqlen = 0;
  std::size_t flashattn_fwd_bytes = 0, flashattn_bwd_bytes = 0;
  double standard_fwd_score_bytes = 0.0, standard_bwd_score_bytes = 0.0;
};
struct BenchReport {
  int threads = 0;  // as requested (0 = all cores)
  double sgemm_gflops = 0.0;
  std::optional<double> copy_gbps;  // with decode cases
  std::vector<TimedCase> cases;
  std::vector<DecodeRun> decode;
  std::vector<MemoryRow> memory_scaling;
};
std::string bench_json(const BenchReport& r);

}  // namespace flashattn::cli
