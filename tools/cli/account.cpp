#include "tools/cli/account.hpp"

#include <omp.h>

#include <algorithm>

#include "tools/baseline/standard_attention.hpp"
#include "tools/cli/machine.hpp"
#include "tools/cli/measure.hpp"

namespace flashattn::cli {
namespace {

// Enough sgemm work for a stable rate on any core count without costing the CLI a second.
constexpr int kSgemmN = 768;
constexpr int kMeasureRepeats = 2;

}  // namespace

cost::Architecture architecture_by_name(const std::string& name, int threads) {
  if (name == "cpu") {
    // The cores that exist: more threads than cores share them (and their L2s).
    const int t = std::min(resolved_threads(threads), omp_get_num_procs());
    const cost::CpuMeasurements m{cpu_clock_ghz(), baseline::sgemm_gflops(kSgemmN, t, kMeasureRepeats),
                                  copy_gbps(kMeasureRepeats)};
    return cost::cpu_architecture(CpuHardware::detect(t), m);
  }
  return cost::gpu_architecture(name == "a100" ? "a100-80gb" : name);
}

std::vector<TileVariant> tile_variants(const cost::Architecture& arch, DType dtype) {
  TileVariant plain{"plain", {dtype}};
  if (arch.cpu) return {plain, {"poly3 exp2 (exp2=poly3)", {dtype, 1.0}}};
  TileVariant poly{"poly exp 25%", {dtype, 0.25}};
  TileVariant rescale{"poly 25% + cond. rescale 10%", {dtype, 0.25, 0.1}};
  TileVariant two_cta{"2-CTA backward", {dtype}};
  two_cta.options.two_cta = true;
  return {plain, poly, rescale, two_cta};
}

std::vector<TileRow> tile_rows(const cost::Architecture& arch, DType dtype, std::int64_t head_dim,
                               std::int64_t head_dim_v) {
  std::vector<TileRow> rows;
  for (const TileVariant& v : tile_variants(arch, dtype)) {
    if (!v.options.two_cta)
      rows.push_back({"forward", v.name,
                      cost::forward_tile_cycles(arch, kTableTile, kTableTile, head_dim, head_dim_v, v.options)});
    if (v.options.rescale_fraction == 1.0)
      rows.push_back({"backward", v.name,
                      cost::backward_tile_cycles(arch, kTableTile, kTableTile, head_dim, head_dim_v, v.options)});
  }
  return rows;
}

CountedRun counted_run(const AttentionProblem& p, const AttentionOptions& options, int repeats, bool with_backward) {
  const Inputs in = random_inputs(p, 1);
  CountedRun r;
  PlansRun plans;  // the plans the counted calls ran
  AttentionOptions counted = options;
  counted.counters = &r.forward;
  counted.plans_run = &plans;
  ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), counted);
  r.forward_plan = plans.forward.at(0);
  r.forward_seconds = measure_forward(Impl::flashattn, p, options, in, repeats).seconds;
  if (with_backward) {
    counted.counters = &r.backward;
    backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), counted);
    r.backward_plan = plans.backward.at(0);
    r.backward_seconds = measure_backward(Impl::flashattn, p, options, in, repeats).seconds;
  } else {  // not run: the plan a backward of these options would run
    r.backward_plan = plan_backward(p, CpuHardware::detect(options.num_threads), options.deterministic,
                                    options.backward_kernel);
  }
  return r;
}

}  // namespace flashattn::cli
