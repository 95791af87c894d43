#include "tools/cli/account.hpp"

#include <nlohmann/json.hpp>

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
    const int t = resolved_threads(threads);
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
  const CpuHardware hw = CpuHardware::detect(options.num_threads);
  r.forward_plan = plan_forward(p, hw, options);
  r.backward_plan = plan_backward(p, hw, options.deterministic, options.backward_kernel);
  AttentionOptions counted = options;
  counted.counters = &r.forward;
  ForwardResult f = forward(in.q.view(), in.k.view(), in.v.view(), counted);
  r.forward_seconds = measure_forward(Impl::flashattn, p, options, in, repeats).seconds;
  if (with_backward) {
    counted.counters = &r.backward;
    backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), counted);
    r.backward_seconds = measure_backward(Impl::flashattn, p, options, in, repeats).seconds;
  }
  return r;
}

nlohmann::json cycles_json(const cost::UnitCycles& c) {
  return {{"mma", c.mma}, {"exp", c.exp}, {"fma", c.fma}, {"smem", c.smem},
          {"cycles", c.time()}, {"bottleneck", c.bottleneck()}, {"shared_pipes", c.shared_pipes}};
}

nlohmann::json architecture_json(const cost::Architecture& a) {
  return {{"name", a.name},
          {"description", a.description},
          {"units", a.units},
          {"clock_ghz", a.clock_ghz},
          {"mma_per_clock", {{"16bit", a.mma_16bit}, {"tf32", a.mma_tf32}, {"fp8", a.mma_fp8}}},
          {"fp32_lanes", a.fp32_lanes},
          {"exp_per_clock", a.exp_per_clock},
          {"poly_exp_ops", a.poly_exp_ops},
          {"smem_bytes_per_clock", a.smem_bytes_per_clock},
          {"smem_bytes", a.smem_bytes},
          {"hbm_gbps", a.hbm_bytes_per_second * 1e-9},
          {"memory_bytes", a.memory_bytes},
          {"source", a.source}};
}

nlohmann::json traffic_json(const cost::Traffic& t) {
  nlohmann::json terms = nlohmann::json::array();
  for (const cost::Traffic::Term& term : t.terms)
    terms.push_back({{"tensor", term.tensor}, {"write", term.write}, {"elements", term.elements},
                     {"bytes", term.bytes()}});
  return {{"elements", t.elements()}, {"bytes", t.bytes()}, {"terms", terms}};
}

nlohmann::json counters_json(const KernelCounters& c) {
  return {{"q_read", c.q_read},           {"k_read", c.k_read},
          {"v_read", c.v_read},           {"kv_packed", c.kv_packed},
          {"tiles_computed", c.tiles_computed}, {"tiles_skipped", c.tiles_skipped},
          {"scores", c.scores},           {"o_written", c.o_written},
          {"lse_written", c.lse_written}, {"o_read", c.o_read},
          {"dout_read", c.dout_read},     {"stats_read", c.stats_read},
          {"dq_accum_read", c.dq_accum_read}, {"dq_accum_written", c.dq_accum_written},
          {"dq_written", c.dq_written},   {"dk_written", c.dk_written},
          {"dv_written", c.dv_written}};
}

nlohmann::json prediction_json(const cost::Prediction& p) {
  return {{"seconds", p.seconds},         {"compute_seconds", p.compute_seconds},
          {"memory_seconds", p.memory_seconds}, {"memory_bytes", p.memory_bytes},
          {"tflops", p.tflops},           {"utilisation", p.utilisation},
          {"bound", p.bound}};
}

}  // namespace flashattn::cli
