// The cost model as the CLI shows it (`flashattn explain`, `flashattn tour`): the
// architecture chosen by name (this CPU measured on the spot), the docs/algorithm.md §5 variants of
// the per-tile table and counted CPU runs (explain.cpp writes them as JSON).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

// "cpu" (measured: sgemm, copy bandwidth, clock), "a100" (= a100-80gb) or a name of
// cost::gpu_architectures(); throws Error naming the choices otherwise.
cost::Architecture architecture_by_name(const std::string& name, int threads);

// The per-tile table's rows: the plain schedule and what docs/algorithm.md §5 changes in it.
struct TileVariant {
  std::string name;
  cost::TileOptions options;
};
// GPUs: plain; poly exp on 25% of the exponentials (FlashAttention-4 uses 10-25%); plus
// conditional rescaling at 10% of tiles ("avoids about 90% of rescales"); 2-CTA backward.
// A CPU: plain (the exact Exp2) and every exponential by Exp2Poly3 (AttentionOptions::exp2
// = poly3); it has no exp unit beside its FMA pipes and no CTAs.
std::vector<TileVariant> tile_variants(const cost::Architecture& arch, DType dtype);

// The per-tile table: each variant's forward and backward cycles for a kTableTile ×
// kTableTile tile, a technique's rows only for the pass it changes (2-CTA MMA: backward;
// conditional rescaling: forward). 128 × 128 is the forward tile of FlashAttention-2/3 and
// (per CTA) FlashAttention-4 at head dims up to 128.
constexpr std::int64_t kTableTile = 128;
struct TileRow {
  const char* pass;  // "forward", "backward"
  std::string variant;
  cost::UnitCycles cycles;
};
std::vector<TileRow> tile_rows(const cost::Architecture& arch, DType dtype, std::int64_t head_dim,
                               std::int64_t head_dim_v);

// One CPU forward and backward on random inputs with counters on, timed (median of
// `repeats`), with the plans those calls ran (AttentionOptions::plans_run; without the
// backward, the plan a backward would run).
struct CountedRun {
  CpuForwardPlan forward_plan;
  CpuBackwardPlan backward_plan;
  KernelCounters forward, backward;  // of a single call each
  double forward_seconds = 0.0, backward_seconds = 0.0;
};
CountedRun counted_run(const AttentionProblem& problem, const AttentionOptions& options, int repeats,
                       bool with_backward);

}  // namespace flashattn::cli
