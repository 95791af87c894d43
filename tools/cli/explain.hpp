// The account `flashattn explain` prints and writes as JSON (report.cpp): a problem's cost in
// the model (docs/cost_model.md), a paper's figures beside it (--preset), and the CPU kernels'
// counters beside the model's (--measure).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "tools/cli/account.hpp"

namespace flashattn::cli {

// A problem from a paper, with the paper's figures of standard attention and FlashAttention
// beside which `explain --preset` prints the model's.
struct PaperFigures {
  double standard_gflops, flash_gflops;  // forward + backward
  double standard_gb, flash_gb;          // HBM reads + writes
  double standard_ms, flash_ms;          // runtime, forward + backward
};
struct Preset {
  const char* name;
  const char* source;
  std::int64_t batch, seqlen, heads, dim;
  const char* dtype;
  const char* arch;
  float dropout_p;
  PaperFigures paper;
};

// The tolerance of the preset's comparison: each ratio within ±25% of the paper's.
inline constexpr double kPresetTolerance = 0.25;

struct Account {
  AttentionProblem problem;
  cost::Architecture arch;
  cost::Tiling forward_tiling, backward_tiling;
  double sram_elements = 0.0;
  cost::Work work;
  cost::StandardModel standard_model = cost::StandardModel::minimal;
  std::vector<cost::Pass> standard_fwd_passes, standard_bwd_passes;
  cost::TiledAccount standard_fwd, standard_bwd, flash_fwd, flash_bwd;
  cost::CachedTraffic cached_fwd, cached_bwd;  // the tiled traffic with the L2
  cost::Prediction predicted_std_fwd, predicted_std_bwd;
  cost::ThetaForms theta;
  cost::UnitCycles table_fwd, table_bwd;
  cost::Prediction predicted_fwd, predicted_bwd;
  const Preset* preset = nullptr;
};

// Forward + backward totals of the account: predicted milliseconds and memory traffic.
double flash_ms(const Account& a);
double standard_ms(const Account& a);
double flash_bytes(const Account& a);
double standard_bytes(const Account& a);

// The preset's three rows: the paper's figures and ratios beside the model's.
struct PresetRow {
  const char* name;
  double paper_standard, paper_flash, model_standard, model_flash;
  bool flash_over_standard;  // the ratio is flash / standard (FLOPs), else standard / flash
  double paper_ratio() const { return flash_over_standard ? paper_flash / paper_standard : paper_standard / paper_flash; }
  double model_ratio() const { return flash_over_standard ? model_flash / model_standard : model_standard / model_flash; }
  bool within() const { return std::fabs(model_ratio() / paper_ratio() - 1.0) <= kPresetTolerance; }
};
std::vector<PresetRow> preset_rows(const Account& a);

// The model's counts of the CPU kernels' terms, field for field as KernelCounters.
struct ModelCounters {
  KernelCounters forward, backward;
};
ModelCounters model_counters(const cost::TiledAccount& fwd, const cost::TiledAccount& bwd, bool split);

struct Measured {
  CountedRun run;
  cost::TiledAccount model_fwd, model_bwd;
  cost::Prediction cpu_fwd, cpu_bwd;  // predicted on this CPU for the executed plans
  bool has_cpu_prediction = false;
};

}  // namespace flashattn::cli
