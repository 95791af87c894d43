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
  if (p.window_left >= 0 || (p.window_right >= 0 && !p.causal)) {
    j["window_left"] = p.window_left;
    j["window_right"] = p.window_right;
  }
  return j;
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

}  // namespace flashattn::cli
