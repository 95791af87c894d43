// The JSON reports of `run --json` and `bench --json`: the machine's facts and one object per
// measured case.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include "flashattn/flashattn.hpp"
#include "tools/cli/decode.hpp"
#include "tools/cli/measure.hpp"

namespace flashattn::cli {

// One benchmark case in the JSON schema shared by `run --json` and `bench --json`.
nlohmann::json case_json(const Measurement& m, const AttentionProblem& p);
// Top-level facts of the machine and build: cpu, threads, simd_target, openblas_corename.
nlohmann::json machine_json(int threads);
nlohmann::json decode_json(const DecodeCase& c, const DecodeMeasurement& m);

}  // namespace flashattn::cli
