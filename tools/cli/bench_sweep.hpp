// `flashattn bench --sweep` and `--quick` (issue 7): flashattn's forward and backward over a
// grid of shapes as ratios to OpenBLAS sgemm measured in the same process, the issue's
// targets checked on its subset, and GFLOP/s against S plotted per configuration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/cli/common.hpp"

namespace flashattn::cli {

struct SweepFlags {
  ShapeFlags shape;  // batch and heads (and the base S, D and threads of --quick)
  int repeats = 5;
  int sgemm_n = 2048;
  std::vector<std::string> ops{"fwd", "bwd"};
  // The full grid of the issue; the flags of `--sweep` restrict it.
  std::vector<std::int64_t> seqlens{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> dims{64, 128, 256};
  std::vector<std::string> dtypes{"f32", "bf16"};
  std::vector<std::string> causal{"no", "yes"};
};

// One flashattn case per (dtype, D, S, causal, op) of the grid, at shape.threads.
nlohmann::json run_sweep(const SweepFlags& f);

// The subset at shape (default B=1, Hq=16, S=4096, D=128) and 2 threads (or
// --threads): f32/bf16 × causal/full × fwd/bwd, f32 forward at D=64 and D=256, on one
// thread, and at 4·S; `targets` states each of the targets with its measured ratio.
nlohmann::json run_quick(SweepFlags f);

// GFLOP/s against S, one line per (op, dtype, causal, D, threads), sgemm as a horizontal line.
std::string sweep_plot(const nlohmann::json& result);

// The cases (and targets, when present) as a table on stdout.
void print_sweep(const nlohmann::json& result);

}  // namespace flashattn::cli
