#include "tools/cli/report.hpp"

#include <nlohmann/json.hpp>

#include <utility>

#include "tools/baseline/standard_attention.hpp"
#include "tools/cli/machine.hpp"

namespace flashattn::cli {

bool states_window(const AttentionProblem& p) {
  return p.window_left >= 0 || (p.window_right >= 0 && !p.causal);
}

namespace {

// One benchmark case in the JSON schema shared by `run --json` and `bench --json`.
nlohmann::json case_json(const Measurement& m, const AttentionProblem& p) {
  nlohmann::json j = {{"impl", impl_name(m.impl)},  {"op", m.op == Op::fwd ? "fwd" : "bwd"},
          {"dtype", to_string(p.dtype)}, {"batch", p.batch},
          {"heads", p.heads_q},          {"heads_kv", p.heads_kv},
          {"seqlen_q", p.seqlen_q},      {"seqlen_k", p.seqlen_k},
          {"dim", p.head_dim},           {"dim_v", p.head_dim_v},
          {"causal", p.causal},          {"seconds", m.seconds},
          {"gflops", m.gflops},          {"dense_equivalent_gflops", m.dense_equivalent_gflops},
          {"peak_bytes", m.peak_bytes}};
  if (m.op == Op::bwd) j["deterministic"] = m.deterministic;
  if (!m.kernel.empty()) j["kernel"] = m.kernel;
  if (states_window(p)) {
    j["window_left"] = p.window_left;
    j["window_right"] = p.window_right;
  }
  return j;
}

// Top-level facts of the machine and build: cpu, threads, simd_target, openblas_corename.
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
          {"cache_dtype", c.cache_name()},
          {"seconds", m.seconds}, {"gbps", m.gbps},       {"cache_bytes", m.cache_bytes},
          {"max_error", m.max_error}, {"kernel", m.kernel}};
}

// fma_peak_gflops, bf16_peak_gflops (VDPBF16PS) and amx_bf16_peak_gflops, each with its
// `_isa` when measured, else null with its `_reason`.
void add_peaks_json(nlohmann::json& j, const Peaks& peaks) {
  for (const auto& [name, peak] : {std::pair{"fma", &peaks.fma}, std::pair{"bf16", &peaks.bf16_dot},
                                   std::pair{"amx_bf16", &peaks.amx_bf16}}) {
    const std::string key = std::string(name) + "_peak";
    j[key + "_gflops"] = peak->gflops ? nlohmann::json(*peak->gflops) : nlohmann::json(nullptr);
    if (peak->gflops) j[key + "_isa"] = peak->isa;
    else j[key + "_reason"] = peak->reason;
  }
}

// A case's `bounded_by` (the peak its kernel computes on: fma, bf16_dot or amx_bf16), that
// peak's `peak_gflops` and `fraction_of_peak`, GFLOP/s over it (null where not measured).
void add_bound_json(nlohmann::json& c, const Measurement& m, const Peaks& peaks) {
  const Peaks::Bound bound = peaks.bound_of(m.kernel);
  c["bounded_by"] = bound.name;
  c["peak_gflops"] = bound.peak->gflops ? nlohmann::json(*bound.peak->gflops) : nlohmann::json(nullptr);
  c["fraction_of_peak"] =
      bound.peak->gflops ? nlohmann::json(m.gflops / *bound.peak->gflops) : nlohmann::json(nullptr);
}

}  // namespace

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
  add_peaks_json(j, r.peaks);
  j["cases"] = nlohmann::json::array();
  for (const TimedCase& c : r.cases) {
    j["cases"].push_back(case_json(c.m, c.p));
    add_bound_json(j["cases"].back(), c.m, r.peaks);
    if (c.block_kept_fraction) j["cases"].back()["block_kept_fraction"] = *c.block_kept_fraction;
  }
  for (const DecodeRun& d : r.decode) j["cases"].push_back(decode_json(d.c, d.m));
  for (const ServeRun& s : r.serve)
    j["cases"].push_back({{"impl", "flashattn"},
                          {"op", "serve"},
                          {"case", s.c.name},
                          {"dtype", to_string(s.c.dtype)},
                          {"heads", s.c.heads},
                          {"heads_kv", s.c.heads_kv},
                          {"dim", s.c.dim},
                          {"page_size", s.c.page_size},
                          {"prefill_rows", s.c.prefill_rows},
                          {"prefill_cached", s.c.prefill_cached},
                          {"decode_keys", s.c.decode_keys},
                          {"seconds", s.m.seconds},
                          {"per_sequence_seconds", s.m.per_sequence_seconds},
                          {"speedup_vs_per_sequence", s.m.per_sequence_seconds / s.m.seconds},
                          {"decode_seconds", s.m.decode_seconds},
                          {"decode_gbps", s.m.decode_gbps},
                          {"pool_bytes", s.m.pool_bytes},
                          {"shared_sequences", s.c.shared_sequences},
                          {"shared_prefix", s.c.shared_prefix},
                          {"shared_own", s.c.shared_own},
                          {"shared_prefix_seconds", s.m.shared_prefix_seconds},
                          {"unshared_prefix_seconds", s.m.unshared_prefix_seconds},
                          {"shared_prefix_speedup", s.m.unshared_prefix_seconds / s.m.shared_prefix_seconds},
                          {"chunk_sequences", s.c.chunk_sequences},
                          {"chunk_rows", s.c.chunk_rows},
                          {"chunk_cached", s.c.chunk_cached},
                          {"chunk_seconds", s.m.chunk_seconds},
                          {"chunk_unpacked_seconds", s.m.chunk_unpacked_seconds},
                          {"chunk_gbps", s.m.chunk_gbps},
                          {"pack_gqa_speedup", s.m.chunk_unpacked_seconds / s.m.chunk_seconds}});
  for (const MasksRun& k : r.masks) {
    for (const MaskRun& run : k.m.runs) {
      Measurement m{Impl::flashattn};
      m.gflops = run.gflops;
      m.kernel = run.kernel;
      nlohmann::json c = {{"impl", "flashattn"},
                          {"op", "masks"},
                          {"case", k.c.name},
                          {"form", run.form},
                          {"dtype", to_string(k.c.dtype)},
                          {"heads", k.c.heads},
                          {"dim", k.c.dim},
                          {"documents", k.c.documents},
                          {"document_tokens", k.c.document_tokens},
                          {"seconds", run.seconds},
                          {"visible_pairs", run.visible_pairs},
                          {"gflops", run.gflops},
                          {"kernel", run.kernel}};
      if (run.form == "mask_mod" || run.form == "dense_bool") c["max_diff_vs_varlen"] = run.max_diff;
      add_bound_json(c, m, r.peaks);
      j["cases"].push_back(std::move(c));
    }
    const auto ratio = [&](const char* a, const char* b) { return k.m.run(a).gflops / k.m.run(b).gflops; };
    j["mask_ratios"].push_back({{"case", k.c.name},
                                {"create_block_mask_seconds", k.m.create_block_mask_seconds},
                                {"block_size", k.c.block},
                                {"mask_mod_vs_varlen", ratio("mask_mod", "varlen")},
                                {"dense_bool_vs_unmasked", ratio("dense_bool", "unmasked")},
                                {"dense_bool_vs_varlen", ratio("dense_bool", "varlen")},
                                {"score_mod_vs_causal", ratio("score_mod", "causal")}});
  }
  if (r.copy_gbps) j["copy_gbps"] = *r.copy_gbps;
  if (r.read_gbps) j["read_gbps"] = *r.read_gbps;
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
  add_peaks_json(j, r.peaks);
  if (r.grid)
    j["grid"] = {{"seqlens", r.grid->seqlens}, {"dims", r.grid->dims}, {"dtypes", r.grid->dtypes},
                 {"causal", r.grid->causal},   {"ops", r.grid->ops}};
  j["cases"] = nlohmann::json::array();
  for (const SweepCase& c : r.cases) {
    nlohmann::json cj = case_json(c.m, c.p);
    cj["threads"] = c.threads;
    cj["sgemm_gflops"] = c.sgemm_gflops;
    cj["vs_sgemm"] = c.vs_sgemm;
    add_bound_json(cj, c.m, c.peaks);
    j["cases"].push_back(cj);
  }
  for (const auto& [key, targets] : {std::pair{"targets", &r.targets}, std::pair{"peak_targets", &r.peak_targets}}) {
    if (targets->empty()) continue;
    j[key] = nlohmann::json::array();
    for (const SweepTarget& t : *targets)
      j[key].push_back(
          {{"name", t.name}, {"measure", t.measure}, {"ratio", t.ratio}, {"target", t.target}, {"pass", t.pass}});
  }
  return j.dump(2);
}

namespace {

// The pieces of the cost model's account (explain.hpp).
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
          {"scores", c.scores},           {"scores_computed", c.scores_computed},
          {"o_written", c.o_written},
          {"lse_written", c.lse_written}, {"rows_computed", c.rows_computed},
          {"o_read", c.o_read},
          {"dout_read", c.dout_read},     {"stats_read", c.stats_read},
          {"dq_accum_read", c.dq_accum_read}, {"dq_accum_written", c.dq_accum_written},
          {"dq_written", c.dq_written},   {"dk_written", c.dk_written},
          {"dv_written", c.dv_written},   {"large_lse_rows", c.large_lse_rows}};
}

nlohmann::json prediction_json(const cost::Prediction& p) {
  return {{"seconds", p.seconds},         {"compute_seconds", p.compute_seconds},
          {"memory_seconds", p.memory_seconds}, {"memory_bytes", p.memory_bytes},
          {"tflops", p.tflops},           {"utilisation", p.utilisation},
          {"bound", p.bound}};
}

nlohmann::json tiling_json(const cost::Tiling& t) {
  return {{"block_q", t.block_q}, {"block_k", t.block_k}, {"splits", t.splits}, {"decode", t.decode}};
}

nlohmann::json passes_json(const std::vector<cost::Pass>& passes) {
  nlohmann::json j = nlohmann::json::array();
  for (const cost::Pass& k : passes)
    j.push_back({{"name", k.name}, {"bytes", k.traffic.bytes()}, {"flops", k.flops}, {"traffic", traffic_json(k.traffic)}});
  return j;
}

nlohmann::json cache_json(const cost::CachedTraffic& c) {
  return {{"bytes", c.bytes},       {"raw_bytes", c.raw_bytes},   {"head_bytes", c.head_bytes},
          {"heads_in_flight", c.heads_in_flight}, {"l2_bytes", c.l2_bytes}, {"fits", c.fits},
          {"assumption", c.assumption}};
}

nlohmann::json tiles_json(const cost::TiledAccount& a) {
  return {{"computed", a.tiles_computed}, {"skipped", a.tiles_skipped}, {"scores", a.scores}};
}

}  // namespace

std::string explain_json(const Account& a, const std::optional<Measured>& m) {
  const cost::Work& w = a.work;
  nlohmann::json j;
  j["problem"] = {{"describe", a.problem.describe()}, {"batch", a.problem.batch}, {"seqlen_q", a.problem.seqlen_q},
                  {"seqlen_k", a.problem.seqlen_k}, {"heads_q", a.problem.heads_q}, {"heads_kv", a.problem.heads_kv},
                  {"head_dim", a.problem.head_dim}, {"head_dim_v", a.problem.head_dim_v},
                  {"dtype", to_string(a.problem.dtype)}, {"causal", a.problem.causal}};
  j["arch"] = architecture_json(a.arch);
  j["tiling"] = {{"forward", tiling_json(a.forward_tiling)}, {"backward", tiling_json(a.backward_tiling)}};
  j["sram_elements"] = a.sram_elements;
  j["flops"] = {{"forward", w.forward}, {"backward", w.backward}, {"backward_recompute", w.backward_recompute},
                {"standard_forward", w.standard_forward}, {"standard_backward", w.standard_backward},
                {"exp_forward", w.exp_forward}, {"exp_backward", w.exp_backward},
                {"exp_standard_forward", w.exp_standard_forward}, {"visible_pairs", w.visible_pairs}};
  j["traffic"] = {
      {"standard_model", cost::to_string(a.standard_model)},
      {"standard_bytes", a.standard_fwd.traffic.bytes() + a.standard_bwd.traffic.bytes()},
      {"flash_bytes", flash_bytes(a)},
      {"flash_raw_bytes", a.flash_fwd.traffic.bytes() + a.flash_bwd.traffic.bytes()},
      {"standard_elements", a.standard_fwd.traffic.elements() + a.standard_bwd.traffic.elements()},
      {"flash_elements", a.flash_fwd.traffic.elements() + a.flash_bwd.traffic.elements()},
      {"forward", {{"standard", traffic_json(a.standard_fwd.traffic)}, {"flash", traffic_json(a.flash_fwd.traffic)},
                   {"standard_passes", passes_json(a.standard_fwd_passes)},
                   {"standard_bytes", a.standard_fwd.traffic.bytes()}, {"flash_bytes", a.cached_fwd.bytes},
                   {"flash_raw_bytes", a.flash_fwd.traffic.bytes()}, {"cache", cache_json(a.cached_fwd)}}},
      {"backward", {{"standard", traffic_json(a.standard_bwd.traffic)}, {"flash", traffic_json(a.flash_bwd.traffic)},
                    {"standard_passes", passes_json(a.standard_bwd_passes)},
                    {"standard_bytes", a.standard_bwd.traffic.bytes()}, {"flash_bytes", a.cached_bwd.bytes},
                    {"flash_raw_bytes", a.flash_bwd.traffic.bytes()}, {"cache", cache_json(a.cached_bwd)}}},
      {"theta_standard", a.theta.standard},
      {"theta_flash", a.theta.flash},
      {"theta_ratio", a.theta.ratio},
      {"lower_bound", cost::kLowerBound}};
  j["tiles"] = {{"forward", tiles_json(a.flash_fwd)}, {"backward", tiles_json(a.flash_bwd)}};
  nlohmann::json variants = nlohmann::json::array();
  for (const TileVariant& v : tile_variants(a.arch, a.problem.dtype))
    variants.push_back(
        {{"name", v.name},
         {"forward", cycles_json(cost::forward_tile_cycles(a.arch, kTableTile, kTableTile, a.problem.head_dim,
                                                           a.problem.head_dim_v, v.options))},
         {"backward", cycles_json(cost::backward_tile_cycles(a.arch, kTableTile, kTableTile, a.problem.head_dim,
                                                             a.problem.head_dim_v, v.options))}});
  j["tile_cycles"] = {{"tile", {kTableTile, kTableTile, a.problem.head_dim}},
                      {"forward", cycles_json(a.table_fwd)},
                      {"backward", cycles_json(a.table_bwd)},
                      {"variants", variants}};
  j["prediction"] = {{"forward", prediction_json(a.predicted_fwd)},
                     {"backward", prediction_json(a.predicted_bwd)},
                     {"assumptions", a.predicted_fwd.assumptions}};
  j["predicted"] = {{"standard_ms", standard_ms(a)},
                    {"flash_ms", flash_ms(a)},
                    {"speedup", standard_ms(a) / flash_ms(a)},
                    {"standard_model", cost::to_string(a.standard_model)},
                    {"standard", {{"forward", prediction_json(a.predicted_std_fwd)},
                                  {"backward", prediction_json(a.predicted_std_bwd)},
                                  {"assumptions", a.predicted_std_fwd.assumptions}}},
                    {"flash", {{"forward", prediction_json(a.predicted_fwd)},
                               {"backward", prediction_json(a.predicted_bwd)},
                               {"assumptions", a.predicted_fwd.assumptions}}}};
  if (a.preset) {
    nlohmann::json rows = nlohmann::json::array();
    for (const PresetRow& r : preset_rows(a))
      rows.push_back({{"name", r.name}, {"paper", {r.paper_standard, r.paper_flash}},
                      {"model", {r.model_standard, r.model_flash}}, {"paper_ratio", r.paper_ratio()},
                      {"model_ratio", r.model_ratio()}, {"within_tolerance", r.within()}});
    j["preset"] = {{"name", a.preset->name}, {"source", a.preset->source}, {"tolerance", kPresetTolerance}, {"rows", rows}};
  }
  if (m) {
    const ModelCounters model = model_counters(m->model_fwd, m->model_bwd, m->run.forward_plan.splits > 1);
    j["measured"] = {{"forward_plan", m->run.forward_plan.describe()},
                     {"backward_plan", m->run.backward_plan.describe()},
                     {"forward", counters_json(m->run.forward)},
                     {"backward", counters_json(m->run.backward)},
                     {"model", {{"forward", counters_json(model.forward)}, {"backward", counters_json(model.backward)}}},
                     {"forward_seconds", m->run.forward_seconds},
                     {"backward_seconds", m->run.backward_seconds}};
    if (m->has_cpu_prediction)
      j["measured"]["predicted"] = {{"forward", prediction_json(m->cpu_fwd)}, {"backward", prediction_json(m->cpu_bwd)}};
  }
  return j.dump(2);
}

}  // namespace flashattn::cli
