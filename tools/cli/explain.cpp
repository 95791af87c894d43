// `flashattn explain`: what a problem costs and why (docs/algorithm.md §7.1) — work, traffic of
// standard and tiled attention (exact and Θ-forms), per-tile unit cycles on an
// architecture, predicted time; with --measure, the CPU kernel's counters beside the
// model's exact counts for the tiles it ran.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <sstream>

#include "tools/cli/account.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/explain.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/report.hpp"

namespace flashattn::cli {
namespace {

// Dao et al. 2022 (FlashAttention), Figure 2 left: GPT-2 medium attention, "seq. length 1024,
// head dim. 64, 16 heads, batch size 64) on A100 GPU", forward + backward. The paper's
// benchmarks (§4.3) run on "one A100 GPU with 40 GB HBM, with dropout and a padding mask";
// GPT-2's attention dropout is 0.1, its training precision fp16. Not causal: the tiled side
// computes more FLOPs than the standard one (75.2 against 66.6), so no tile was skipped.
constexpr Preset kPresets[] = {
    {"gpt2-medium", "Dao et al. 2022, FlashAttention, Figure 2 (left)", 64, 1024, 16, 64, "f16", "a100-40gb", 0.1f,
     {66.6, 75.2, 40.3, 4.4, 41.7, 7.3}},
};

const Preset& preset_by_name(const std::string& name) {
  for (const Preset& p : kPresets)
    if (name == p.name) return p;
  throw Error("--preset: unknown preset '" + name + "' (known: gpt2-medium)");
}

// The cost model counts FLOPs and bytes in int64, walks every query row once and the (Q
// tile, K/V tile) pairs of one (batch, head): a problem past any of them is refused by name
// instead of miscounted (negative FLOPs or bytes) or walked for hours. `tilings` are the
// model's (the CPU plan's where it runs); at most 2^30 pairs (4M tokens of 128-row tiles)
// and 2^28 query rows (a few seconds).
void check_countable(const AttentionProblem& p, std::initializer_list<cost::Tiling> tilings) {
  auto g3 = [](double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", x);
    return std::string(text);
  };
  const std::string shape = "batch " + std::to_string(p.batch) + " x heads " + std::to_string(p.heads_q) +
                            " x seqlen_q " + std::to_string(p.seqlen_q) + " x seqlen_k " + std::to_string(p.seqlen_k);
  const double heads = static_cast<double>(p.batch) * static_cast<double>(p.heads_q);
  const double entries = heads * static_cast<double>(p.seqlen_q) * static_cast<double>(p.seqlen_k);
  const double work = 4.0 * entries * static_cast<double>(std::max(p.head_dim, p.head_dim_v));
  if (work * 4.0 > 0x1p62)
    throw Error("explain: " + shape + ": its FLOPs (about " + g3(work) + ") overflow the cost model's 64-bit counts");
  // Standard attention moves each S/P entry a few times in every pass (eager float32: under
  // 100 bytes an entry, forward and backward), whatever the head dim.
  if (entries * 256.0 > 0x1p62)
    throw Error("explain: " + shape + ": standard attention's traffic (about " + g3(entries * 100.0) +
                " bytes) overflows the cost model's 64-bit counts");
  if (p.seqlen_q > (std::int64_t{1} << 28))
    throw Error("explain: seqlen_q " + std::to_string(p.seqlen_q) +
                ": the cost model walks every query row, at most 2^28 (268435456)");
  for (const cost::Tiling& t : tilings) {
    const double pairs = std::ceil(static_cast<double>(p.seqlen_q) / static_cast<double>(t.block_q)) *
                         std::ceil(static_cast<double>(p.seqlen_k) / static_cast<double>(t.block_k));
    if (pairs > 0x1p30)
      throw Error("explain: " + g3(pairs) + " (Q tile, K/V tile) pairs to walk (tiles of " + std::to_string(t.block_q) +
                  " x " + std::to_string(t.block_k) + ") of one head, more than the cost model's 2^30");
  }
}

Account make_account(const ExplainFlags& f, const AttentionProblem& p, const AttentionOptions& options) {
  Account a{p, architecture_by_name(f.arch, f.shape.threads)};
  if (a.arch.cpu) {
    const CpuHardware hw = CpuHardware::detect(f.shape.threads);
    a.forward_tiling = cost::tiling_of(plan_forward(p, hw, options));
    a.backward_tiling = cost::tiling_of(plan_backward(p, hw, false));
  } else {
    // A tile past its sequence is one tile of it (--tile near INT64_MAX overflowed the walks).
    const std::int64_t br = std::min(f.tile.empty() ? kTableTile : f.tile[0], std::max<std::int64_t>(p.seqlen_q, 1));
    const std::int64_t bc = std::min(f.tile.empty() ? kTableTile : f.tile[1], std::max<std::int64_t>(p.seqlen_k, 1));
    a.forward_tiling = a.backward_tiling = cost::Tiling{br, bc};
  }
  check_countable(p, {a.forward_tiling, a.backward_tiling});
  a.sram_elements = f.sram_elements.value_or(a.arch.smem_bytes /
                                              (a.arch.cpu ? 4.0 : static_cast<double>(dtype_size(p.dtype))));
  a.work = cost::work(p);
  a.standard_model = cost::parse_standard_model(f.standard);
  a.standard_fwd_passes = cost::standard_forward_passes(p, a.standard_model);
  a.standard_bwd_passes = cost::standard_backward_passes(p, a.standard_model);
  a.standard_fwd = cost::standard_forward(p, a.standard_model);
  a.standard_bwd = cost::standard_backward(p, a.standard_model);
  a.flash_fwd = cost::flash_forward(p, a.forward_tiling);
  a.flash_bwd = cost::flash_backward(p, a.backward_tiling);
  a.cached_fwd = cost::cached_traffic(a.flash_fwd, a.arch, "forward");
  a.cached_bwd = cost::cached_traffic(a.flash_bwd, a.arch, "backward");
  a.predicted_std_fwd = cost::predict_standard(p, a.arch, a.standard_fwd_passes);
  a.predicted_std_bwd = cost::predict_standard(p, a.arch, a.standard_bwd_passes);
  a.theta = cost::theta_forms(p, a.sram_elements);
  const cost::TileOptions plain{p.dtype};
  a.table_fwd = cost::forward_tile_cycles(a.arch, kTableTile, kTableTile, p.head_dim, p.head_dim_v, plain);
  a.table_bwd = cost::backward_tile_cycles(a.arch, kTableTile, kTableTile, p.head_dim, p.head_dim_v, plain);
  a.predicted_fwd = cost::predict_forward(p, a.arch, a.forward_tiling, plain);
  a.predicted_bwd = cost::predict_backward(p, a.arch, a.backward_tiling, plain);
  return a;
}

// `text` padded with spaces to `width` characters (UTF-8 code points, as a terminal shows them).
std::string padded(const std::string& text, std::size_t width) {
  std::size_t chars = 0;
  for (const char c : text) chars += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return text + std::string(width > chars ? width - chars : 0, ' ');
}

Measured measure(const ExplainFlags& f, const AttentionProblem& p, const AttentionOptions& options, const Account& a) {
  Measured m;
  m.run = counted_run(p, options, f.repeats, true);
  m.model_fwd = cost::flash_forward(p, cost::tiling_of(m.run.forward_plan));
  m.model_bwd = cost::flash_backward(p, cost::tiling_of(m.run.backward_plan));
  if (a.arch.cpu) {
    m.cpu_fwd = cost::predict_forward(p, a.arch, cost::tiling_of(m.run.forward_plan), {p.dtype});
    m.cpu_bwd = cost::predict_backward(p, a.arch, cost::tiling_of(m.run.backward_plan), {p.dtype});
    m.has_cpu_prediction = true;
  }
  return m;
}

void print_cycles_row(const char* pass, const std::string& variant, const cost::UnitCycles& c) {
  std::printf("  %-9s %-30s %10.0f %10.0f %10.0f %10.0f   %s\n", pass, variant.c_str(), c.mma, c.exp, c.fma, c.smem,
              c.bottleneck().c_str());
}

void print_preset(const Account& a) {
  std::printf("\nThe paper beside the model (--preset %s: %s)\n", a.preset->name, a.preset->source);
  std::printf("  %-42s %10s %10s %8s   %10s %10s %8s   %s\n", "forward + backward", "standard", "flash", "ratio",
              "standard", "flash", "ratio", "within ±25%");
  std::printf("  %-42s %30s   %30s\n", "", "--- paper (measured) ---",
              ("--- model (standard " + cost::to_string(a.standard_model) + ") ---").c_str());
  for (const PresetRow& r : preset_rows(a))
    std::printf("  %-42s %10.1f %10.1f %8.2f   %10.1f %10.1f %8.2f   %s\n", r.name, r.paper_standard, r.paper_flash,
                r.paper_ratio(), r.model_standard, r.model_flash, r.model_ratio(), r.within() ? "yes" : "no");
  std::printf("  The ratios compare; the absolute figures differ. The paper does not state how it counts\n"
              "  FLOPs (the model counts 2 per multiply-add of every product); its bytes and times were\n"
              "  measured on FlashAttention-1, while the model is a roofline at the table's peak rates of\n"
              "  FlashAttention-2's loop order.\n");
  if (a.standard_model == cost::StandardModel::eager)
    std::printf("  With --standard eager the standard side counts the paper's kernels one by one; beside the\n"
                "  tiled roofline (which moves and takes less than FlashAttention-1 measured) its ratios overshoot.\n");
}

void print_text(const Account& a, const std::optional<Measured>& m) {
  const AttentionProblem& p = a.problem;
  const cost::Work& w = a.work;
  std::printf("flashattn explain: %s\n", p.describe().c_str());
  if (a.preset)
    std::printf("preset %s: the problem of %s, on %s\n", a.preset->name, a.preset->source, a.preset->arch);
  std::printf("architecture: %s — %d %s at %.3f GHz\n  source: %s\n", a.arch.description.c_str(), a.arch.units,
              a.arch.cpu ? "cores" : "SMs", a.arch.clock_ghz, a.arch.source.c_str());
  std::printf("tiles: forward Br=%lld Bc=%lld%s, backward Br=%lld Bc=%lld; fast memory M = %.0f elements\n\n",
              static_cast<long long>(a.forward_tiling.block_q), static_cast<long long>(a.forward_tiling.block_k),
              a.forward_tiling.splits > 1 ? (" splits=" + std::to_string(a.forward_tiling.splits)).c_str() : "",
              static_cast<long long>(a.backward_tiling.block_q), static_cast<long long>(a.backward_tiling.block_k),
              a.sram_elements);

  std::printf("Work                         matrix FLOPs        exponentials\n");
  std::printf("  forward, tiled             %14.4g      %14.4g\n", w.forward, w.exp_forward);
  std::printf("  backward, tiled            %14.4g      %14.4g   (recomputing S: %.4g FLOPs)\n", w.backward,
              w.exp_backward, w.backward_recompute);
  std::printf("  forward, standard          %14.4g      %14.4g\n", w.standard_forward, w.exp_standard_forward);
  std::printf("  backward, standard         %14.4g      %14s   (from the stored P)\n\n", w.standard_backward, "0");

  std::printf("Traffic, slow <-> fast memory   standard (%s)    tiled (L2)   tiled (raw)   standard/tiled\n",
              cost::to_string(a.standard_model).c_str());
  const auto row = [](const char* name, double standard, double tiled, double raw) {
    std::printf("  %-26s %15s %13s %13s   %8.2f\n", name, human_bytes(standard).c_str(), human_bytes(tiled).c_str(),
                human_bytes(raw).c_str(), standard / std::max(1.0, tiled));
  };
  row("forward", static_cast<double>(a.standard_fwd.traffic.bytes()), a.cached_fwd.bytes, a.cached_fwd.raw_bytes);
  row("backward", static_cast<double>(a.standard_bwd.traffic.bytes()), a.cached_bwd.bytes, a.cached_bwd.raw_bytes);
  row("forward + backward", standard_bytes(a), flash_bytes(a), a.cached_fwd.raw_bytes + a.cached_bwd.raw_bytes);
  std::printf("  L2 (tiled): %s\n              %s\n", a.cached_fwd.assumption.c_str(), a.cached_bwd.assumption.c_str());
  std::printf("  standard passes (%s), one kernel each:\n", cost::to_string(a.standard_model).c_str());
  for (const auto& [pass, passes] : {std::pair{"forward", &a.standard_fwd_passes}, std::pair{"backward", &a.standard_bwd_passes}})
    for (const cost::Pass& k : *passes) {
      std::printf("    %-9s %s %12s", pass, padded(k.name, 34).c_str(), human_bytes(static_cast<double>(k.traffic.bytes())).c_str());
      if (k.flops > 0.0) std::printf("  %10.4g FLOPs", k.flops);
      std::printf("\n");
    }
  std::printf("  exact elements: standard %lld + %lld, tiled %lld + %lld\n",
              static_cast<long long>(a.standard_fwd.traffic.elements()), static_cast<long long>(a.standard_bwd.traffic.elements()),
              static_cast<long long>(a.flash_fwd.traffic.elements()), static_cast<long long>(a.flash_bwd.traffic.elements()));
  std::printf("  tiled forward by tensor:");
  for (const cost::Traffic::Term& t : a.flash_fwd.traffic.terms)
    std::printf(" %s %s %lld;", t.tensor.c_str(), t.write ? "written" : "read", static_cast<long long>(t.elements));
  std::printf("\n  Θ-forms for M = %.0f: standard Θ(N·d + N²) = %.4g, tiled Θ(N²·d²/M) = %.4g, ratio %.4f "
              "(d²/M = %.4f)\n",
              a.sram_elements, a.theta.standard, a.theta.flash, a.theta.ratio,
              static_cast<double>(p.head_dim * p.head_dim) / a.sram_elements);
  std::printf("  %s\n\n", cost::kLowerBound);

  std::printf("Cycles per %lldx%lldx%lld tile on one %s (%s)         mma        exp        fma       smem   bottleneck\n",
              static_cast<long long>(kTableTile), static_cast<long long>(kTableTile), static_cast<long long>(p.head_dim),
              a.arch.cpu ? "core" : "SM", to_string(p.dtype).c_str());
  for (const TileRow& r : tile_rows(a.arch, p.dtype, p.head_dim, p.head_dim_v))
    print_cycles_row(r.pass, r.variant, r.cycles);
  if (a.arch.cpu) std::printf("  (a CPU core runs mma, exp and fma on the same FMA pipes: their cycles add up)\n");

  std::printf("\nPredicted on %s\n", a.arch.name.c_str());
  for (const auto& [name, r] : {std::pair{"forward", &a.predicted_fwd}, std::pair{"backward", &a.predicted_bwd}})
    std::printf("  %-9s %10.4g ms  %10.4g GFLOP/s  %5.1f%% of peak  bound by %s (compute %.4g ms, memory %.4g ms)\n",
                name, r->seconds * 1e3, r->tflops * 1e3, 100.0 * r->utilisation, r->bound.c_str(),
                r->compute_seconds * 1e3, r->memory_seconds * 1e3);
  for (const auto& [name, r] : {std::pair{"standard forward", &a.predicted_std_fwd},
                                std::pair{"standard backward", &a.predicted_std_bwd}})
    std::printf("  %-18s %10.4g ms  bound by %s (matrix products %.4g ms, memory %.4g ms, passes added)\n", name,
                r->seconds * 1e3, r->bound.c_str(), r->compute_seconds * 1e3, r->memory_seconds * 1e3);
  std::printf("  forward + backward: standard (%s) %.4g ms, tiled %.4g ms: %s\n",
              cost::to_string(a.standard_model).c_str(), standard_ms(a), flash_ms(a),
              number_or_na("%.2fx", standard_ms(a) / flash_ms(a)).c_str());
  std::printf("  assumptions (tiled):\n");
  for (const std::string& s : a.predicted_fwd.assumptions) std::printf("   - %s\n", s.c_str());
  std::printf("   - %s\n", a.cached_bwd.assumption.c_str());
  std::printf("  assumptions (standard):\n");
  for (const std::string& s : a.predicted_std_fwd.assumptions) std::printf("   - %s\n", s.c_str());
  if (a.preset) print_preset(a);
  if (!m) return;

  std::printf("\nMeasured on this CPU (counters on) — %s\n", m->run.forward_plan.describe().c_str());
  const ModelCounters model = model_counters(m->model_fwd, m->model_bwd, m->run.forward_plan.splits > 1);
  const auto line = [](const char* name, std::int64_t want, std::int64_t got) {
    std::printf("  %-34s %16lld %16lld%s\n", name, static_cast<long long>(want), static_cast<long long>(got),
                want == got ? "" : "   (differs)");
  };
  // What the row strips' spans left of the computed tiles (causal diagonals, windows, masks).
  const auto spans = [](const KernelCounters& c) {
    std::printf("  scores the row strips computed (their spans, padding included): %lld (%.2f of the tiles' %lld)\n",
                static_cast<long long>(c.scores_computed),
                static_cast<double>(c.scores_computed) / static_cast<double>(std::max<std::int64_t>(1, c.scores)),
                static_cast<long long>(c.scores));
  };
  const KernelCounters& f = m->run.forward;
  const KernelCounters& mf = model.forward;
  std::printf("  %-34s %16s %16s\n", "forward counter", "model", "measured");
  line("Q elements read", mf.q_read, f.q_read);
  line("K elements streamed", mf.k_read, f.k_read);
  line("V elements streamed", mf.v_read, f.v_read);
  line("O elements written", mf.o_written, f.o_written);
  line("tiles computed", mf.tiles_computed, f.tiles_computed);
  line("tiles skipped", mf.tiles_skipped, f.tiles_skipped);
  line("scores", mf.scores, f.scores);
  std::printf("  K/V elements packed from the caller's memory: %lld (each streamed %.1f times on average)\n",
              static_cast<long long>(f.kv_packed),
              static_cast<double>(f.k_read + f.v_read) / static_cast<double>(std::max<std::int64_t>(1, f.kv_packed)));
  spans(f);
  const KernelCounters& b = m->run.backward;
  const KernelCounters& mb = model.backward;
  std::printf("  %-34s %16s %16s   (%s)\n", "backward counter", "model", "measured", m->run.backward_plan.describe().c_str());
  line("Q elements streamed", mb.q_read, b.q_read);
  line("dO elements read", mb.dout_read, b.dout_read);
  line("K, V elements read", mb.k_read + mb.v_read, b.k_read + b.v_read);
  line("dQ accumulator elements read", mb.dq_accum_read, b.dq_accum_read);
  line("dQ accumulator elements written", mb.dq_accum_written, b.dq_accum_written);
  line("tiles computed", mb.tiles_computed, b.tiles_computed);
  line("tiles skipped", mb.tiles_skipped, b.tiles_skipped);
  spans(b);
  std::printf("  time: forward %.3f ms, backward %.3f ms", m->run.forward_seconds * 1e3, m->run.backward_seconds * 1e3);
  if (m->has_cpu_prediction)
    std::printf(" (model on this CPU: %.3f ms, %.3f ms)", m->cpu_fwd.seconds * 1e3, m->cpu_bwd.seconds * 1e3);
  std::printf("\n");
}

}  // namespace

double flash_ms(const Account& a) { return (a.predicted_fwd.seconds + a.predicted_bwd.seconds) * 1e3; }
double standard_ms(const Account& a) { return (a.predicted_std_fwd.seconds + a.predicted_std_bwd.seconds) * 1e3; }
double flash_bytes(const Account& a) { return a.cached_fwd.bytes + a.cached_bwd.bytes; }
double standard_bytes(const Account& a) {
  return static_cast<double>(a.standard_fwd.traffic.bytes() + a.standard_bwd.traffic.bytes());
}

std::vector<PresetRow> preset_rows(const Account& a) {
  const PaperFigures& b = a.preset->paper;
  const cost::Work& w = a.work;
  return {{"GFLOPs (flash / standard)", b.standard_gflops, b.flash_gflops, (w.standard_forward + w.standard_backward) * 1e-9,
           (w.forward + w.backward) * 1e-9, true},
          {"HBM reads + writes, GB (standard / flash)", b.standard_gb, b.flash_gb, standard_bytes(a) * 1e-9,
           flash_bytes(a) * 1e-9, false},
          {"runtime, ms (speedup)", b.standard_ms, b.flash_ms, standard_ms(a), flash_ms(a), false}};
}

ModelCounters model_counters(const cost::TiledAccount& fwd, const cost::TiledAccount& bwd, bool split) {
  ModelCounters m;
  const cost::Traffic& f = fwd.traffic;
  m.forward.q_read = f.elements_of("Q", false);
  m.forward.k_read = f.elements_of("K", false);
  m.forward.v_read = f.elements_of("V", false);
  m.forward.o_written = f.elements_of(split ? "O partial" : "O", true);
  m.forward.lse_written = f.elements_of(split ? "lse partial" : "lse", true);
  m.forward.tiles_computed = fwd.tiles_computed;
  m.forward.tiles_skipped = fwd.tiles_skipped;
  m.forward.scores = fwd.scores;
  const cost::Traffic& t = bwd.traffic;
  KernelCounters& b = m.backward;
  b.q_read = t.elements_of("Q", false);
  b.k_read = t.elements_of("K", false);
  b.v_read = t.elements_of("V", false);
  b.o_read = t.elements_of("O", false);
  b.dout_read = t.elements_of("dO", false);
  b.stats_read = t.elements_of("lse", false) + t.elements_of("D", false);
  b.dq_accum_read = t.elements_of("dQ accum", false);
  b.dq_accum_written = t.elements_of("dQ accum", true);
  b.dq_written = t.elements_of("dQ", true);
  b.dk_written = t.elements_of("dK", true);
  b.dv_written = t.elements_of("dV", true);
  b.tiles_computed = bwd.tiles_computed;
  b.tiles_skipped = bwd.tiles_skipped;
  b.scores = bwd.scores;
  return m;
}

void explain(ExplainFlags flags) {
  if (!flags.preset.empty()) {
    // The preset is the paper's problem: flags that would change it are refused, not mixed in.
    for (const char* name : {"--batch", "--seqlen", "--seqlen-q", "--seqlen-k", "--heads", "--heads-kv", "--dim",
                             "--dim-v", "--dtype", "--causal", "--arch", "--dropout-p", "--window-size", "--tile",
                             "--sram-elements", "--measure"})
      if (flags.given.count(name) > 0)
        throw Error(std::string("--preset ") + flags.preset + " sets the paper's problem; drop " + name);
    const Preset& pr = preset_by_name(flags.preset);
    ShapeFlags& s = flags.shape;
    s.batch = pr.batch;
    s.seqlen = pr.seqlen;
    s.heads = pr.heads;
    s.dim = pr.dim;
    s.dtype = pr.dtype;
    s.causal = false;
    flags.arch = pr.arch;
    flags.dropout_p = pr.dropout_p;
  }
  const ExplainFlags& f = flags;
  if (!f.tile.empty() && (f.tile[0] < 1 || f.tile[1] < 1))
    throw Error("--tile: BR and BC must be >= 1, got " + std::to_string(f.tile[0]) + " " + std::to_string(f.tile[1]));
  AttentionOptions options = f.shape.options();
  if (!f.window_size.empty()) options.window_size = {f.window_size[0], f.window_size[1]};
  options.dropout_p = f.dropout_p;
  if (!f.tile.empty()) options.block_q = f.tile[0];
  if (f.sram_elements && !(std::isfinite(*f.sram_elements) && *f.sram_elements >= 1.0)) {
    std::ostringstream got;
    got << *f.sram_elements;
    throw Error("--sram-elements: a fast-memory size of at least 1 element, got " + got.str());
  }
  const AttentionProblem p = f.shape.problem(options);
  Account a = make_account(f, p, options);
  if (!f.preset.empty()) a.preset = &preset_by_name(f.preset);
  // No query row: the kernels run no plan whose counters --measure could show.
  if (f.measure && (p.batch == 0 || p.seqlen_q == 0))
    throw Error("--measure: no query row to run (batch " + std::to_string(p.batch) + ", seqlen_q " +
                std::to_string(p.seqlen_q) + ")");
  std::optional<Measured> m;
  if (f.measure) m = measure(f, p, options, a);
  if (f.json) {
    std::cout << explain_json(a, m) << "\n";
  } else {
    print_text(a, m);
  }
}

}  // namespace flashattn::cli
