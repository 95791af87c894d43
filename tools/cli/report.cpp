#include "tools/cli/report.hpp"

#include <nlohmann/json.hpp>

#include "tools/baseline/standard_attention.hpp"
#include "tools/cli/machine.hpp"

namespace flashattn::cli {

nlohmann::json case_json(const Measurement& m, const AttentionProblem& p) {
  nlohmann::json j = {{"impl", impl_name(m.impl)},  {"op", m.op == Op::fwd ? "fwd" : "bwd"},
          {"dtype", to_string(p.dtype)}, {"batch", p.batch},
          {"heads", p.heads_q},          {"heads_kv", p.heads_kv},
          {"seqlen_q", p.seqlen_q},      {"seqlen_k", p.seqlen_k},
          {"dim", p.head_dim},           {"dim_v", p.head_dim_v},
          {"causal", p.causal},          {"seconds", m.seconds},
          {"gflops", m.gflops},          {"peak_bytes", m.peak_bytes}};
  if (m.op == Op::bwd) j["deterministic"] = m.deterministic;
  if (!m.kernel.empty()) j["kernel"] = m.kernel;
  if (states_window(p)) {
    j["window_left"] = p.window_left;
    j["window_right"] = p.window_right;
  }
  return j;
}

bool states_window(const AttentionProblem& p) {
  return p.window_left >= 0 || (p.window_right >= 0 && !p.causal);
}

nlohmann::json machine_json(int threads) {
  return {{"cpu", cpu_model()},
          {"threads", resolved_threads(threads)},
          {"simd_target", cpu_simd_target()},
          {"openblas_corename", baseline::openblas_corename()}};
}

nlohmann::json decode_json(const DecodeCase& c, const DecodeMeasurement& m) {
  return {{"impl", "flashattn"}, {"op", "decode"},        {"dtype", to_string(c.dtype)},
          {"batch", c.batch},    {"heads", c.heads},      {"heads_kv", c.heads_kv},
          {"dim", c.dim},        {"cached", c.cached},    {"page_size", c.page_size},
          {"cache_dtype", c.fp8_cache ? "e4m3" : to_string(c.dtype)},
          {"seconds", m.seconds}, {"gbps", m.gbps},       {"cache_bytes", m.cache_bytes},
          {"max_error", m.max_error}, {"kernel", m.kernel}};
}

std::string run_json(int threads, const AttentionProblem& p, const std::vector<Measurement>& results,
                     const std::vector<double>& errors, std::optional<double> speedup,
                     std::optional<double> backward_speedup) {
  nlohmann::json j = machine_json(threads);
  for (std::size_t i = 0; i < results.size(); ++i) {
    j["cases"].push_back(case_json(results[i], p));
    if (i < errors.size()) j["cases"].back()["max_error"] = errors[i];
  }
  if (speedup) j["speedup"] = *speedup;
  if (backward_speedup) j["backward_speedup"] = *backward_speedup;
  return j.dump(2);
}

std::string varlen_run_json(int threads, const VarlenRun& r) {
  nlohmann::json j = machine_json(threads);
  j["varlen"] = {{"batch", r.batch}, {"total_q", r.total_q}, {"total_k", r.total_k},
                 {"fwd_seconds", r.fwd_seconds}, {"fwd_gflops", r.fwd_gflops}, {"max_error", r.max_error}};
  if (r.bwd_seconds) j["varlen"]["bwd_seconds"] = *r.bwd_seconds;
  if (r.bwd_gflops) j["varlen"]["bwd_gflops"] = *r.bwd_gflops;
  return j.dump(2);
}

std::string decode_run_json(int threads, const DecodeCase& c, const DecodeMeasurement& m) {
  nlohmann::json j = machine_json(threads);
  j["cases"].push_back(decode_json(c, m));
  return j.dump(2);
}

std::string bench_json(const BenchReport& r) {
  nlohmann::json j = machine_json(r.threads);
  j["sgemm_gflops"] = r.sgemm_gflops;
  j["cases"] = nlohmann::json::array();
  for (const TimedCase& c : r.cases) {
    j["cases"].push_back(case_json(c.m, c.p));
    if (c.block_kept_fraction) j["cases"].back()["block_kept_fraction"] = *c.block_kept_fraction;
  }
  for (const DecodeRun& d : r.decode) j["cases"].push_back(decode_json(d.c, d.m));
  if (r.copy_gbps) j["copy_gbps"] = *r.copy_gbps;
  for (const MemoryRow& m : r.memory_scaling)
    j["memory_scaling"].push_back({{"seqlen", m.seqlen},
                                   {"flashattn_fwd_bytes", m.flashattn_fwd_bytes},
                                   {"flashattn_bwd_bytes", m.flashattn_bwd_bytes},
                                   {"standard_fwd_score_bytes", m.standard_fwd_score_bytes},
                                   {"standard_bwd_score_bytes", m.standard_bwd_score_bytes}});
  return j.dump(2);
}

namespace {

nlohmann::json rescale_case_json(const RescaleCase& c) {
  return {{"classic", c.classic},
          {"conditional", c.conditional},
          {"classic_per_row", c.classic_per_row},
          {"conditional_per_row", c.conditional_per_row},
          {"rows", c.rows},
          {"key_tiles", c.key_tiles},
          {"max_abs_diff", c.max_abs_diff}};
}

}  // namespace

std::string numerics_json(const NumericsReport& r) {
  nlohmann::json j = machine_json(r.threads);
  j["seed"] = r.seed;
  const OnlineSoftmaxSteps& os = r.online_softmax;
  nlohmann::json steps = nlohmann::json::array();
  for (const OnlineSoftmaxSteps::Step& s : os.steps) steps.push_back({{"m", s.m}, {"l", s.l}});
  j["online_softmax"] = {{"scores", os.scores},   {"blocks", os.blocks},               {"steps", steps},
                         {"l_final", os.l_final}, {"probabilities", os.probabilities}, {"one_pass", os.one_pass},
                         {"max_abs_diff", os.max_abs_diff}};
  const Exp2Accuracy& e = r.exp2;
  j["exp2"] = {{"points", e.points},
               {"range", {e.range_lo, e.range_hi}},
               {"exact_max_rel_err_f32", e.exact_max_rel_err_f32},
               {"poly3_max_rel_err_f32", e.poly3_max_rel_err_f32},
               {"exact_max_rel_err_bf16", e.exact_max_rel_err_bf16},
               {"poly3_max_rel_err_bf16", e.poly3_max_rel_err_bf16},
               {"bf16_half_ulp", e.bf16_half_ulp},
               {"bf16_results_differing_fraction", e.bf16_results_differing_fraction}};
  j["rescale"] = {{"threshold", r.rescale.threshold},
                  {"random", rescale_case_json(r.rescale.random)},
                  {"adversarial", rescale_case_json(r.rescale.adversarial)}};
  j["rescale"]["adversarial"]["score_growth_log2"] = r.rescale.score_growth_log2;
  const Fp8Error& f = r.fp8;
  j["fp8"] = {{"format", f.format},
              {"seed", f.seed},
              {"outlier_fraction", f.outlier_fraction},
              {"outlier_std", f.outlier_std},
              {"output_dtype", f.output_dtype},
              {"rmse_bf16", f.rmse_bf16},
              {"block_q", f.block_q},
              {"block_k", f.block_k},
              {"rotation_seed", f.rotation_seed},
              {"rmse_per_tensor", f.rmse_per_tensor},
              {"rmse_per_block", f.rmse_per_block},
              {"rmse_hadamard", f.rmse_hadamard},
              {"rmse_per_block_hadamard", f.rmse_per_block_hadamard}};
  const Speed& s = r.speed;
  j["speed"] = {{"dtype", s.dtype},
                {"causal", s.causal},
                {"repeats", s.repeats},
                {"cases", nlohmann::json::array()},
                {"exp2_throughput",
                 {{"exact_gexp_per_s", s.exp2_throughput.exact_gexp_per_s},
                  {"poly3_gexp_per_s", s.exp2_throughput.poly3_gexp_per_s}}}};
  for (const SpeedCase& c : s.cases) {
    nlohmann::json cj = {{"exp2", c.exp2},
                         {"rescale_threshold", c.rescale_threshold},
                         {"seconds", c.seconds},
                         {"gflops", c.gflops},
                         {"ratio_to_exact_classic", c.ratio_to_exact_classic}};
    if (c.exp2_poly3_fraction) cj["exp2_poly3_fraction"] = *c.exp2_poly3_fraction;
    j["speed"]["cases"].push_back(cj);
  }
  return j.dump(2);
}

std::string sweep_json(const SweepReport& r) {
  nlohmann::json j = machine_json(r.threads);
  j["mode"] = r.mode;
  j["repeats"] = r.repeats;
  j["sgemm_gflops"] = r.sgemm_gflops;
  j["sgemm_size"] = r.sgemm_size;
  j["standard_attention"] = r.standard_attention;
  j["batch"] = r.batch;
  j["heads"] = r.heads;
  if (r.grid)
    j["grid"] = {{"seqlens", r.grid->seqlens}, {"dims", r.grid->dims}, {"dtypes", r.grid->dtypes},
                 {"causal", r.grid->causal},   {"ops", r.grid->ops}};
  j["cases"] = nlohmann::json::array();
  for (const SweepCase& c : r.cases) {
    nlohmann::json cj = case_json(c.m, c.p);
    cj["threads"] = c.threads;
    cj["sgemm_gflops"] = c.sgemm_gflops;
    cj["vs_sgemm"] = c.vs_sgemm;
    j["cases"].push_back(cj);
  }
  if (!r.targets.empty()) {
    j["targets"] = nlohmann::json::array();
    for (const SweepTarget& t : r.targets)
      j["targets"].push_back(
          {{"name", t.name}, {"measure", t.measure}, {"ratio", t.ratio}, {"target", t.target}, {"pass", t.pass}});
  }
  return j.dump(2);
}

}  // namespace flashattn::cli
