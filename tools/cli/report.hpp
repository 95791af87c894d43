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

}  // namespace flashattn::cli
