// The JSON reports (--json) of every subcommand that has one, from plain structs: the one file
// that includes the JSON library (report.cpp), a header-only library compiled once there.
// Each report holds the machine's facts and its subcommand's results; a case of `run` and of
// `bench` has one schema.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/decode.hpp"
#include "tools/cli/masks.hpp"
#include "tools/cli/serve.hpp"
#include "tools/cli/experiments.hpp"
#include "tools/cli/explain.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/peaks.hpp"

namespace flashattn::cli {

// Whether a case states its window (window_left, window_right): a left bound, or a right one
// that causal does not already imply.
bool states_window(const AttentionProblem& p);

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
// timed cases in order, then the decode, serve and mask cases (each mask form a case of op
// "masks" with its fraction_of_peak, and `mask_ratios` per mask case), and the extra memory
// against seqlen.
struct TimedCase {
  Measurement m;  // its `out` left empty
  AttentionProblem p;
  std::optional<double> block_kept_fraction;  // the block-sparse cases
};
struct DecodeRun {
  DecodeCase c;
  DecodeMeasurement m;
};
struct ServeRun {
  ServeCase c;
  ServeMeasurement m;
};
struct MasksRun {
  MaskCase c;
  MaskMeasurement m;
};
struct MemoryRow {
  std::int64_t seqlen = 0;
  std::size_t flashattn_fwd_bytes = 0, flashattn_bwd_bytes = 0;
  double standard_fwd_score_bytes = 0.0, standard_bwd_score_bytes = 0.0;
};
struct BenchReport {
  int threads = 0;  // as requested (0 = all cores)
  double sgemm_gflops = 0.0;
  Peaks peaks;  // measured before and after the cases, at the run's threads (confirm_peaks)
  std::optional<double> copy_gbps;  // with decode or serve cases
  std::optional<double> read_gbps;  // with decode or serve cases: read_gbps at the bench's threads
  std::vector<TimedCase> cases;
  std::vector<DecodeRun> decode;
  std::vector<ServeRun> serve;
  std::vector<MasksRun> masks;
  std::vector<MemoryRow> memory_scaling;
};
std::string bench_json(const BenchReport& r);

// `numerics --json`: the machine's facts and the experiments of `flashattn numerics`.
struct OnlineSoftmaxSteps {  // 1. the online softmax on [1, 3, 2, 5], blocks [1, 3] and [2, 5]
  std::vector<int> scores;
  std::vector<std::vector<float>> blocks;
  struct Step {
    double m;  // natural units
    float l;
  };
  std::vector<Step> steps;  // after each block
  float l_final = 0.0f;
  std::vector<double> probabilities, one_pass;
  double max_abs_diff = 0.0;
};
struct Exp2Accuracy {  // 2. each exp2 on [range_lo, range_hi], against float64
  std::size_t points = 0;
  double range_lo = 0.0, range_hi = 0.0;
  double exact_max_rel_err_f32 = 0.0, poly3_max_rel_err_f32 = 0.0;
  double exact_max_rel_err_bf16 = 0.0, poly3_max_rel_err_bf16 = 0.0;
  double bf16_half_ulp = 0.0, bf16_results_differing_fraction = 0.0;
};
struct SpeedCase {  // 5. the forward with one exp2 and rescaling rule
  std::string exp2;
  float rescale_threshold = 0.0f;
  double seconds = 0.0, gflops = 0.0, ratio_to_exact_classic = 0.0;
  std::optional<float> exp2_poly3_fraction;  // exp2 mixed
};
struct Speed {
  std::string dtype;
  bool causal = false;
  int repeats = 0;
  std::vector<SpeedCase> cases;
  Exp2Throughput exp2_throughput;
};
struct NumericsReport {
  int threads = 0;  // as requested (0 = all cores)
  std::uint64_t seed = 0;
  OnlineSoftmaxSteps online_softmax;
  Exp2Accuracy exp2;
  RescaleCounts rescale;  // 3.
  Fp8Error fp8;           // 4.
  Speed speed;
};
std::string numerics_json(const NumericsReport& r);

// `bench --sweep --json` and `bench --quick --json` (tools/cli/bench_sweep.hpp): the machine's
// facts, the first sgemm and peaks, each flashattn case with the sgemm and peaks measured just
// before it (its bounded_by, fraction_of_peak), and (--quick) issue 7's and issue 25's targets.
struct SweepCase {
  Measurement m;  // its `out` left empty
  AttentionProblem p;
  int threads = 0;
  double sgemm_gflops = 0.0, vs_sgemm = 0.0;
  Peaks peaks;  // measured just before the case, like its sgemm, and after it (confirm_peaks)
};
struct SweepTarget {
  std::string name, measure;
  double ratio = 0.0, target = 0.0;
  bool pass = false;
};
struct SweepReport {
  std::string mode;  // "sweep" or "quick"
  int threads = 0;   // the run's
  int repeats = 0;
  double sgemm_gflops = 0.0;
  int sgemm_size = 0;
  std::string standard_attention;  // why standard attention is not timed
  std::int64_t batch = 0, heads = 0;
  std::optional<SweepFlags> grid;  // --sweep: the grid timed
  Peaks peaks;                      // measured with the first sgemm
  std::vector<SweepCase> cases;
  std::vector<SweepTarget> targets;       // --quick: issue 7's, against sgemm
  std::vector<SweepTarget> peak_targets;  // --quick: issue 25's, fractions of each case's peak
};
std::string sweep_json(const SweepReport& r);

// `explain --json`: the whole account, with the measured counters when `measured` is set.
std::string explain_json(const Account& a, const std::optional<Measured>& measured);

}  // namespace flashattn::cli
