// `flashattn bench --sweep` and `--quick` (issue 7): flashattn's forward and backward over a
// grid of shapes as ratios to OpenBLAS sgemm measured in the same process, the issue's
// targets checked on its subset, and GFLOP/s against S plotted per configuration.
#pragma once

#include <string>

#include "tools/cli/commands.hpp"

namespace flashattn::cli {

// --sweep (one flashattn case per (dtype, D, S, causal, op) of the grid, at shape.threads) or
// --quick (the subset at shape, default B=1, Hq=16, S=4096, D=128, and 2 threads or
// --threads: f32/bf16 × causal/full × fwd/bwd, f32 forward at D=64 and D=256, on one thread,
// and at 4·S, with each of the targets and its measured ratio): the cases as JSON
// (`json`) or a table on stdout, then GFLOP/s against S as SVG to `plot` unless it is empty.
void sweep(const SweepFlags& f, bool quick, bool json, const std::string& plot);

}  // namespace flashattn::cli
