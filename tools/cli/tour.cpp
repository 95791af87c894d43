// `flashattn tour`: the four generations of docs/algorithm.md §2-§5 on this machine, each chapter
// printing what it measured beside what the cost model predicts; --out DIR also writes
// the figures as SVG. Defaults fit a 2-core machine (well under a minute).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "tools/cli/account.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/experiments.hpp"
#include "tools/cli/machine.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/svg.hpp"

namespace flashattn::cli {
namespace {

constexpr std::int64_t kFirstSeqlen = 256;
// The longest sweep N: a tour that long already takes hours per chapter and N² scores of a
// head (chapter 1's standard attention) take 1 TiB at 2^19; past 2^24 an option is a typo.
constexpr std::int64_t kMaxSeqlen = std::int64_t{1} << 24;

AttentionProblem square(const TourFlags& f, std::int64_t n, std::int64_t heads) {
  AttentionOptions o;
  o.num_threads = f.threads;
  return AttentionProblem::from_sizes(1, n, n, heads, heads, f.dim, f.dim, DType::f32, o);
}

AttentionOptions options_of(const TourFlags& f) {
  AttentionOptions o;
  o.num_threads = f.threads;
  return o;
}

std::vector<std::int64_t> seqlens(const TourFlags& f) {
  std::vector<std::int64_t> n;
  for (std::int64_t s = kFirstSeqlen; s <= f.max_seqlen; s *= 2) {
    n.push_back(s);
    if (s > f.max_seqlen / 2) break;  // the next doubling is past it (and never overflows)
  }
  if (n.empty()) n.push_back(f.max_seqlen);
  return n;
}

// The elements a counted forward moved, in the model's terms (Q, K, V, O, lse).
std::int64_t forward_elements(const KernelCounters& c) { return c.q_read + c.k_read + c.v_read + c.o_written + c.lse_written; }

void figure(const TourFlags& f, const std::string& name, const std::string& svg_text) {
  if (f.out.empty()) return;
  const std::string path = (std::filesystem::path(f.out) / name).string();
  svg::write(path, svg_text);
  std::printf("  figure: %s\n", path.c_str());
}

void chapter(int number, const char* title) { std::printf("\n== %d. %s ==\n", number, title); }

// ---- 1 + 2: standard attention against tiling ------------------------------------------

struct SizePoint {
  std::int64_t n;
  double standard_model_bytes, flash_model_bytes, flash_measured_bytes;
  double standard_peak_bytes, flash_workspace_bytes;
  double standard_seconds, flash_seconds;
};

std::vector<SizePoint> chapter_standard(const TourFlags& f) {
  chapter(1, "Standard attention: S and P go to memory");
  std::printf("Per head, S = QKᵀ and P = softmax(S) are N×N: written and read back twice (4·N² elements),\n"
              "and the memory they need grows as N². Measured: OpenBLAS textbook attention, %lld heads, d = %lld, f32.\n\n",
              static_cast<long long>(f.heads), static_cast<long long>(f.dim));
  std::printf("  %6s  %14s %14s %12s   %14s %14s %12s %9s %9s\n", "N", "std traffic", "S of a head", "std memory",
              "tiled traffic", "tiled counted", "tiled memory", "std ms", "tiled ms");
  std::vector<SizePoint> points;
  // One untimed call first: OpenBLAS starts its threads on the first product.
  const AttentionProblem warm = square(f, kFirstSeqlen, 1);
  measure_forward(Impl::standard, warm, options_of(f), random_inputs(warm, 5), 1);
  for (const std::int64_t n : seqlens(f)) {
    const AttentionProblem p = square(f, n, f.heads);
    const AttentionOptions o = options_of(f);
    const Inputs in = random_inputs(p, 7);
    const Measurement standard = measure_forward(Impl::standard, p, o, in, f.repeats);
    const CountedRun run = counted_run(p, o, f.repeats, false);
    const cost::TiledAccount model = cost::flash_forward(p, cost::tiling_of(run.forward_plan));
    SizePoint s{n,
                static_cast<double>(cost::standard_forward(p).traffic.bytes()),
                static_cast<double>(model.traffic.bytes()),
                static_cast<double>(forward_elements(run.forward)) * 4.0,  // f32 elements
                static_cast<double>(standard.peak_bytes),
                static_cast<double>(run.forward_plan.workspace_bytes()),
                standard.seconds,
                run.forward_seconds};
    points.push_back(s);
    std::printf("  %6lld  %14s %14s %12s   %14s %14s %12s %9.2f %9.2f\n", static_cast<long long>(n),
                human_bytes(s.standard_model_bytes).c_str(), human_bytes(4.0 * n * n).c_str(),
                human_bytes(s.standard_peak_bytes).c_str(), human_bytes(s.flash_model_bytes).c_str(),
                human_bytes(s.flash_measured_bytes).c_str(), human_bytes(s.flash_workspace_bytes).c_str(),
                s.standard_seconds * 1e3, s.flash_seconds * 1e3);
  }
  std::printf("\n  'std traffic' and 'tiled traffic' are the model's exact counts; 'tiled counted' is what the\n"
              "  kernel's counters saw (equal to the model by construction of the test suite); 'std memory' is the\n"
              "  baseline's measured peak extra allocation, about one head's S.\n");
  std::vector<svg::Series> traffic{{"standard (model)", {}, {}}, {"tiled (model)", {}, {}}, {"tiled (counted)", {}, {}}};
  std::vector<svg::Series> memory{{"standard (measured)", {}, {}}, {"tiled workspace", {}, {}}};
  for (const SizePoint& s : points) {
    const double x = static_cast<double>(s.n);
    for (svg::Series* sr : {&traffic[0], &traffic[1], &traffic[2], &memory[0], &memory[1]}) sr->x.push_back(x);
    traffic[0].y.push_back(s.standard_model_bytes);
    traffic[1].y.push_back(s.flash_model_bytes);
    traffic[2].y.push_back(s.flash_measured_bytes);
    memory[0].y.push_back(s.standard_peak_bytes);
    memory[1].y.push_back(s.flash_workspace_bytes);
  }
  figure(f, "traffic_vs_n.svg",
         svg::line_chart({"Forward traffic between memory and the core", "sequence length N", "bytes", true, true,
                          svg::Unit::number, svg::Unit::bytes},
                         traffic));
  figure(f, "memory_vs_n.svg",
         svg::line_chart({"Extra memory of a forward pass", "sequence length N", "bytes", true, true, svg::Unit::number,
                          svg::Unit::bytes},
                         memory));
  return points;
}

void worked_example() {
  // One row of 8 scores (log2 units) in two tiles of 4, v_j = j: the online softmax state
  // after each tile, and the result against the softmax of the whole row.
  const float s[8] = {0.5f, 2.0f, -1.0f, 1.0f, 3.0f, 0.0f, 2.5f, -0.5f};
  OnlineSoftmaxState state;
  float o_tilde = 0.0f;
  std::printf("  worked example: scores (log2 units) 0.5 2 -1 1 | 3 0 2.5 -0.5, values v_j = j\n");
  for (int tile = 0; tile < 2; ++tile) {
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int j = 4 * tile; j < 4 * tile + 4; ++j) tile_max = std::max(tile_max, s[j]);
    const float factor = state.rescale_to(tile_max);
    o_tilde *= factor;
    float sum = 0.0f;
    for (int j = 4 * tile; j < 4 * tile + 4; ++j) {
      const float pj = std::exp2(s[j] - state.max);
      sum += pj;
      o_tilde += pj * static_cast<float>(j);
    }
    state.add(sum);
    std::printf("    after tile %d: m = %.2f, rescale factor %.4f, l = %.5f, õ = %.5f\n", tile + 1, state.max, factor,
                state.sum, o_tilde);
  }
  double z = 0.0, direct = 0.0;
  for (int j = 0; j < 8; ++j) z += std::exp2(static_cast<double>(s[j]));
  for (int j = 0; j < 8; ++j) direct += std::exp2(static_cast<double>(s[j])) / z * j;
  std::printf("    o = õ/l = %.6f; softmax of the whole row gives %.6f: exact, only the order changed\n",
              o_tilde * state.inverse_sum(), direct);
}

struct TilePoint {
  std::int64_t block_q;
  std::int64_t model_kv, counted_kv;
  double seconds;
};

void chapter_tiling(const TourFlags& f, const std::vector<SizePoint>& sizes) {
  chapter(2, "Tiling and the online softmax: S and P stay in fast memory");
  worked_example();
  const std::int64_t n = sizes.back().n;
  const AttentionProblem p = square(f, n, f.heads);
  const CpuHardware hw = CpuHardware::detect(f.threads);
  std::printf("\n  K/V traffic against the Q tile Br (N = %lld, d = %lld): a Q tile of Br rows occupies M ≈ Br·d\n"
              "  elements of fast memory and streams all of K and V once, so K/V traffic = (N/Br)·N·2d ∝ 1/M.\n",
              static_cast<long long>(n), static_cast<long long>(f.dim));
  std::printf("  %6s %10s %16s %16s %12s %9s\n", "Br", "M = Br·d", "K+V model", "K+V counted", "·Br/(H·N²)", "ms");
  std::vector<TilePoint> points;
  for (std::int64_t br = hw.micro_rows; br <= std::min<std::int64_t>(256, n); br *= 2) {
    AttentionOptions o = options_of(f);
    o.block_q = br;
    o.num_splits = 1;
    const CountedRun run = counted_run(p, o, 1, false);
    const cost::TiledAccount model = cost::flash_forward(p, cost::tiling_of(run.forward_plan));
    const TilePoint t{run.forward_plan.block_q,
                      model.traffic.elements_of("K", false) + model.traffic.elements_of("V", false),
                      run.forward.k_read + run.forward.v_read, run.forward_seconds};
    points.push_back(t);
    std::printf("  %6lld %10lld %16lld %16lld %12.1f %9.2f\n", static_cast<long long>(t.block_q),
                static_cast<long long>(t.block_q * f.dim), static_cast<long long>(t.model_kv),
                static_cast<long long>(t.counted_kv),
                static_cast<double>(t.counted_kv) * static_cast<double>(t.block_q) / static_cast<double>(f.heads * n * n),
                t.seconds * 1e3);
  }
  std::printf("  ·Br/(H·N²) stays at 2d = %lld: traffic ∝ 1/Br (a little above where Br does not divide N).\n",
              static_cast<long long>(2 * f.dim));
  std::vector<svg::Series> kv{{"K+V model", {}, {}}, {"K+V counted", {}, {}}};
  for (const TilePoint& t : points) {
    kv[0].x.push_back(static_cast<double>(t.block_q * f.dim));
    kv[1].x.push_back(static_cast<double>(t.block_q * f.dim));
    kv[0].y.push_back(static_cast<double>(t.model_kv));
    kv[1].y.push_back(static_cast<double>(t.counted_kv));
  }
  figure(f, "traffic_vs_tile.svg",
         svg::line_chart({"K/V elements streamed against fast memory M", "M = Br·d (elements)", "elements", true, true,
                          svg::Unit::number, svg::Unit::binary},
                         kv));

  std::printf("\n  Memory flat in N: the tiled workspace is per thread and per tile, the standard one N²:\n");
  for (const SizePoint& s : sizes)
    std::printf("    N = %6lld: tiled %10s, standard %10s\n", static_cast<long long>(s.n),
                human_bytes(s.flash_workspace_bytes).c_str(), human_bytes(s.standard_peak_bytes).c_str());

  const std::int64_t nb = std::min<std::int64_t>(1024, n);
  const AttentionProblem pb = square(f, nb, f.heads);
  const AttentionOptions o = options_of(f);
  const cost::Work w = cost::work(pb);
  const cost::Tiling bt = cost::tiling_of(plan_backward(pb, hw, false));
  const double flash_bytes = static_cast<double>(cost::flash_backward(pb, bt).traffic.bytes());
  const double std_bytes = static_cast<double>(cost::standard_backward(pb).traffic.bytes());
  const Inputs in = random_inputs(pb, 9);
  const Measurement fb = measure_backward(Impl::flashattn, pb, o, in, f.repeats);
  const Measurement sb = measure_backward(Impl::standard, pb, o, in, f.repeats);
  std::printf("\n  Backward by recomputation (N = %lld): the tiled backward recomputes S and P from Q, K and lse.\n",
              static_cast<long long>(nb));
  std::printf("    FLOPs: tiled %.3g vs standard %.3g (+%.0f%%, the recomputation of S)\n", w.backward,
              w.standard_backward, 100.0 * (w.backward / w.standard_backward - 1.0));
  std::printf("    bytes: tiled %s vs standard %s (%.1f× fewer)\n", human_bytes(flash_bytes).c_str(),
              human_bytes(std_bytes).c_str(), std_bytes / flash_bytes);
  std::printf("    measured: tiled %.2f ms, standard %.2f ms; extra memory %s vs %s\n", fb.seconds * 1e3,
              sb.seconds * 1e3, human_bytes(static_cast<double>(fb.peak_bytes)).c_str(),
              human_bytes(static_cast<double>(sb.peak_bytes)).c_str());
}

// ---- 3: work partitioning -----------------------------------------------------------

void chapter_partitioning(const TourFlags& f) {
  chapter(3, "Work partitioning: parallel over the sequence, not only over heads");
  const std::int64_t n = f.max_seqlen;
  const AttentionProblem p = square(f, n, 1);
  const int max_threads = resolved_threads(f.threads);
  std::printf("  batch 1, 1 head, N = %lld, d = %lld, f32: 'sequence' splits the Q rows into tiles (the plan's\n"
              "  choice); 'heads only' gives each (batch, head) to one thread (one Q tile of N rows). No split-KV.\n",
              static_cast<long long>(n), static_cast<long long>(f.dim));
  std::printf("  %8s %16s %16s\n", "threads", "sequence GF/s", "heads only GF/s");
  const Inputs in = random_inputs(p, 11);
  std::vector<svg::Series> series{{"parallel over sequence", {}, {}}, {"parallel over heads only", {}, {}}};
  for (int t = 1; t <= max_threads; t = t < max_threads && 2 * t > max_threads ? max_threads : 2 * t) {
    AttentionOptions o = options_of(f);
    o.num_threads = t;
    o.num_splits = 1;
    const double sequence = measure_forward(Impl::flashattn, p, o, in, f.repeats).gflops;
    o.block_q = n;
    const double heads_only = measure_forward(Impl::flashattn, p, o, in, f.repeats).gflops;
    std::printf("  %8d %16.2f %16.2f\n", t, sequence, heads_only);
    for (svg::Series& s : series) s.x.push_back(t);
    series[0].y.push_back(sequence);
    series[1].y.push_back(heads_only);
  }
  std::printf("  model: with one head, 'heads only' has 1 work item and uses 1 thread whatever the count;\n"
              "  'sequence' has ceil(N/Br) items and scales until the cores run out.\n");
  figure(f, "gflops_vs_threads.svg",
         svg::line_chart({"Forward GFLOP/s at batch 1, one head", "threads", "GFLOP/s", false, false}, series));

  // Grouped-query heads with few rows each (a prefill chunk, speculative decoding): a Q tile
  // per head streams the whole K/V for its rows alone; pack_gqa stacks the group's heads.
  constexpr std::int64_t kHeadsQ = 16, kGroup = 8;
  std::printf("\n  GQA: %lld q heads over %lld kv heads, %lld keys, f32, %d threads: a Q tile per q head, or one\n"
              "  per kv head holding its %lld q heads' rows (pack_gqa, FlashAttention-3); K+V elements read\n"
              "  counted by the kernels.\n",
              static_cast<long long>(kHeadsQ), static_cast<long long>(kHeadsQ / kGroup), static_cast<long long>(n),
              max_threads, static_cast<long long>(kGroup));
  std::printf("  %9s %16s %16s %14s %14s %7s\n", "rows/head", "K+V per head", "K+V packed", "per head GF/s",
              "packed GF/s", "ratio");
  for (const std::int64_t rows : {8, 32}) {
    AttentionOptions per_head = options_of(f), packed = per_head;
    per_head.pack_gqa = false;
    packed.pack_gqa = true;
    const AttentionProblem p = AttentionProblem::from_sizes(1, rows, n, kHeadsQ, kHeadsQ / kGroup, f.dim, f.dim,
                                                            DType::f32, per_head);
    const CountedRun a = counted_run(p, per_head, f.repeats, false), b = counted_run(p, packed, f.repeats, false);
    const double flops = p.visible_forward_flops();
    std::printf("  %9lld %16lld %16lld %14.2f %14.2f %6.2fx\n", static_cast<long long>(rows),
                static_cast<long long>(a.forward.k_read + a.forward.v_read),
                static_cast<long long>(b.forward.k_read + b.forward.v_read), flops / a.forward_seconds / 1e9,
                flops / b.forward_seconds / 1e9, a.forward_seconds / b.forward_seconds);
  }
}

// ---- 4: asynchrony and low precision ------------------------------------------------

// The FP8 experiment runs at min(N, this) queries and keys: its float64 reference grows as
// N², and a few hundred rows already show the variants' ordering.
constexpr std::int64_t kFp8Seqlen = 512;
constexpr std::uint64_t kNumericsSeed = 2024;  // as `flashattn numerics`

void chapter_asynchrony(const TourFlags& f, const cost::Architecture& cpu) {
  chapter(4, "Asynchrony and low precision");
  const std::int64_t n = std::min<std::int64_t>(1024, f.max_seqlen);
  const AttentionProblem p = square(f, n, f.heads);
  const CountedRun run = counted_run(p, options_of(f), 1, false);
  const KernelCounters& c = run.forward;
  std::printf("  Producer / consumer: on a CPU the producer role is packing. Each thread converts a head's K and V\n"
              "  once into tile-major float32 panels, then every Q tile streams them: counted %lld elements packed,\n"
              "  %lld streamed — each packed element is used %.1f times (N = %lld).\n",
              static_cast<long long>(c.kv_packed), static_cast<long long>(c.k_read + c.v_read),
              static_cast<double>(c.k_read + c.v_read) / static_cast<double>(std::max<std::int64_t>(1, c.kv_packed)),
              static_cast<long long>(n));
  // The measurement switches (AttentionOptions::switches), each off in turn, timed beside
  // the model: without reuse every Q tile's K/V comes from the caller's memory (the raw
  // count at the copy bandwidth) instead of the packed head (once per head, the L2 rule);
  // the model has no term for software prefetch.
  // Q tiles of 64 rows, no split: several Q tiles per head, so that reuse shows at any thread count.
  constexpr std::int64_t kSwitchBlockQ = 64;
  const cost::Tiling tiling = cost::tiling_of(plan_forward(p, CpuHardware::detect(f.threads), 1, kSwitchBlockQ));
  const cost::TiledAccount account = cost::flash_forward(p, tiling);
  const cost::Prediction predicted = cost::predict_forward(p, cpu, tiling, {DType::f32});
  const cost::CachedTraffic cached = cost::cached_traffic(account, cpu, "forward");
  const double raw_seconds = std::max(predicted.compute_seconds, cached.raw_bytes / cpu.hbm_bytes_per_second);
  std::printf("\n  Each technique switched off (measurement only; the output stays exact), N = %lld, Br = %lld:\n"
              "  %-26s %14s %14s %11s %11s\n",
              static_cast<long long>(n), static_cast<long long>(tiling.block_q), "", "K/V packed", "K/V streamed", "measured ms", "model ms");
  cost::TileOptions every_tile{DType::f32};
  every_tile.deferred_normalization = false;
  const double normalized_seconds = cost::predict_forward(p, cpu, tiling, every_tile).seconds;
  AttentionOptions per_head = options_of(f);
  per_head.switches.q_tile_parallelism = false;
  const double per_head_seconds =
      cost::predict_forward(p, cpu, cost::tiling_of(plan_forward(p, CpuHardware::detect(f.threads), per_head)),
                            {DType::f32})
          .seconds;
  struct Switch {
    const char* name;
    bool reuse, prefetch, deferred, q_tiles;
    double model_seconds;
  };
  for (const Switch& sw : {Switch{"all on", true, true, true, true, predicted.seconds},
                           Switch{"K/V packing reuse off", false, true, true, true, raw_seconds},
                           Switch{"software prefetch off", true, false, true, true, predicted.seconds},
                           Switch{"deferred normalization off", true, true, false, true, normalized_seconds},
                           Switch{"Q-tile parallelism off", true, true, true, false, per_head_seconds}}) {
    AttentionOptions o = options_of(f);
    o.block_q = kSwitchBlockQ;
    o.num_splits = 1;
    o.switches.reuse_packed_kv = sw.reuse;
    o.switches.software_prefetch = sw.prefetch;
    o.switches.deferred_normalization = sw.deferred;
    o.switches.q_tile_parallelism = sw.q_tiles;
    const CountedRun r = counted_run(p, o, f.repeats, false);
    std::printf("  %-26s %14lld %14lld %11.2f %11.2f\n", sw.name, static_cast<long long>(r.forward.kv_packed),
                static_cast<long long>(r.forward.k_read + r.forward.v_read), r.forward_seconds * 1e3,
                sw.model_seconds * 1e3);
  }
  std::printf("  Without reuse the packed count equals the streamed one, as the model's raw count says; the\n"
              "  model's times are rooflines (compute %.2f ms, %.2f ms normalizing at every tile as\n"
              "  FlashAttention-1; memory %.2f ms with the packed head, %.2f ms without). Q-tile parallelism\n"
              "  off is FlashAttention-1's partitioning: one work item per head, all its rows one tile.\n",
              predicted.compute_seconds * 1e3, normalized_seconds * 1e3, cached.bytes / cpu.hbm_bytes_per_second * 1e3,
              cached.raw_bytes / cpu.hbm_bytes_per_second * 1e3);

  const AttentionProblem small = square(f, std::min(kFp8Seqlen, f.max_seqlen), f.heads);
  std::printf("\n  Low precision (FlashAttention-3): FP8 e4m3 operands with one scale per tensor or per tile, and the\n"
              "  Hadamard rotation that spreads outliers over the channels. N(0,1) inputs plus outliers, N = %lld,\n"
              "  %lld heads, d = %lld; RMSE of the attention output against float64 (seed %llu, as\n"
              "  `flashattn numerics`, which runs it at larger sizes and with --fp8-format e5m2):\n",
              static_cast<long long>(small.seqlen_q), static_cast<long long>(f.heads), static_cast<long long>(f.dim),
              static_cast<unsigned long long>(kNumericsSeed));
  const Fp8Error fp8 = fp8_error(small, kNumericsSeed, Fp8Format::e4m3, f.threads);
  print_fp8_error(fp8);
  const double per_tensor = fp8.rmse_per_tensor;
  const auto change = [per_tensor](double rmse) { return 100.0 * (rmse / per_tensor - 1.0); };
  std::printf("  Against per-tensor FP8: per-block scales %+.0f%%, the rotation %+.0f%%, both %+.0f%%; bf16 is %.0f×\n"
              "  more accurate than the best FP8 variant. FP8 is emulated here (decoded to float32, P rounded to\n"
              "  e4m3): its numerics, not its speed — a CPU has no FP8 multiplier.\n",
              change(fp8.rmse_per_block), change(fp8.rmse_hadamard),
              change(fp8.rmse_per_block_hadamard),
              std::min({per_tensor, fp8.rmse_per_block, fp8.rmse_hadamard,
                        fp8.rmse_per_block_hadamard}) /
                  fp8.rmse_bf16);
}

// ---- 5: the exponential unit ---------------------------------------------------------

void chapter_exp_unit(const TourFlags& f, const cost::Architecture& cpu) {
  chapter(5, "The exponential unit: per-unit cycles of one 128×128×128 tile");
  std::printf("  %-10s %-9s %-30s %10s %10s %10s %10s  %s\n", "arch", "pass", "variant", "mma", "exp", "fma", "smem",
              "bottleneck");
  // One row set per SM design: A100 40 GB and H200 have the SMs of A100 80 GB and H100.
  std::vector<cost::Architecture> archs;
  for (const char* name : {"a100-80gb", "h100", "b200", "b300"}) archs.push_back(cost::gpu_architecture(name));
  std::vector<std::string> names;
  std::vector<svg::Series> fwd{{"mma", {}, {}}, {"exp", {}, {}}, {"fma", {}, {}}, {"smem", {}, {}}};
  std::vector<svg::Series> bwd = fwd;
  const auto add = [](std::vector<svg::Series>& s, const cost::UnitCycles& c) {
    s[0].y.push_back(c.mma), s[1].y.push_back(c.exp), s[2].y.push_back(c.fma), s[3].y.push_back(c.smem);
  };
  archs.push_back(cpu);
  for (const cost::Architecture& a : archs) {
    const DType dtype = a.cpu ? DType::f32 : DType::bf16;
    for (const TileRow& r : tile_rows(a, dtype, 128, 128))
      std::printf("  %-10s %-9s %-30s %10.0f %10.0f %10.0f %10.0f  %s\n", a.name.c_str(), r.pass, r.variant.c_str(),
                  r.cycles.mma, r.cycles.exp, r.cycles.fma, r.cycles.smem, r.cycles.bottleneck().c_str());
    if (a.cpu) continue;  // its cycles are ~100× a GPU SM's: kept out of the figure's scale
    names.push_back(a.name);
    add(fwd, cost::forward_tile_cycles(a, 128, 128, 128, 128, {DType::bf16}));
    add(bwd, cost::backward_tile_cycles(a, 128, 128, 128, 128, {DType::bf16}));
  }
  std::printf("  Read down the forward rows: from H100 to B200 the MMA halves while exp and smem stay, so exp ties\n"
              "  the MMA; offloading a quarter of the exponentials to a cubic polynomial makes the MMA the bound\n"
              "  again, and B300's doubled exp unit does it in hardware. The backward is bound by shared memory\n"
              "  until 2-CTA MMA halves the operand reads. On this CPU every unit is the same FMA pipes.\n");
  figure(f, "unit_cycles_forward.svg",
         svg::bar_chart({"Forward 128x128x128 bf16 tile: cycles per unit", "", "cycles per SM"}, names, fwd));
  figure(f, "unit_cycles_backward.svg",
         svg::bar_chart({"Backward 128x128x128 bf16 tile: cycles per unit", "", "cycles per SM"}, names, bwd));

  const double poly3_per_clock = cpu.fp32_lanes / cpu.poly_exp_ops;
  const Exp2Throughput speed = exp2_throughput(std::max(3, f.repeats));
  const double exact = speed.exact_gexp_per_s, poly3 = speed.poly3_gexp_per_s;
  std::printf("\n  Polynomial exp2 on this CPU, one thread, L1-resident array (median, interleaved):\n"
              "    %-7s model %5.2f per clock = %5.2f G/s at %.2f GHz   measured %5.2f G/s\n"
              "    %-7s model %5.2f per clock = %5.2f G/s               measured %5.2f G/s\n"
              "    poly3 / exact: model %.2f (%.0f against %.0f vector instructions), measured %.2f. The model issues\n"
              "    every instruction on the 2 FMA pipes; integer and compare instructions can also take other\n"
              "    vector ports, so an idle core may beat it (and a shared one lag it). The exponentials are a\n"
              "    few %% of a forward's instructions: the choice barely moves a forward here (docs/numerics.md §5).\n",
              "exact", cpu.exp_per_clock, cpu.exp_per_clock * cpu.clock_ghz, cpu.clock_ghz, exact, "poly3",
              poly3_per_clock, poly3_per_clock * cpu.clock_ghz, poly3, poly3_per_clock / cpu.exp_per_clock,
              cpu.fp32_lanes / cpu.exp_per_clock, cpu.poly_exp_ops, poly3 / exact);

  // Forward passes only, so the sweep's largest N: more key tiles per row for the rules to differ.
  const AttentionProblem p = square(f, f.max_seqlen, f.heads);
  std::mt19937_64 rng(kNumericsSeed);
  const RescaleCounts r = rescale_counts(p, rng, f.threads);
  std::printf("\n  Conditional rescaling, counted by the kernel (AttentionOptions::rescale_counts): rescales of õ\n"
              "  after each row's first key tile, classic rule (τ = 0) against τ = %g log2 units (N = %lld):\n",
              r.threshold, static_cast<long long>(p.seqlen_q));
  print_rescale_counts(r);
  std::printf("  On random rows the first tile's maximum is almost always within 2^τ of the row's, so τ = %g\n"
              "  skips nearly every rescale; the adversarial rows climb %.1f log2 units (about %.2f per tile), so the\n"
              "  classic rule rescales at every tile and τ = %g only when the climb since its last rescale passes\n"
              "  %g. The outputs agree to float32 rounding (max |diff|): the final õ/ℓ cancels the reference.\n",
              r.threshold, r.score_growth_log2,
              r.score_growth_log2 /
                  static_cast<double>(r.adversarial.key_tiles),
              r.threshold, r.threshold);
}

}  // namespace

void tour(const TourFlags& f) {
  if (f.max_seqlen > kMaxSeqlen)
    throw Error("tour: --max-seqlen must be at most 2^24 (" + std::to_string(kMaxSeqlen) + "), got " +
                std::to_string(f.max_seqlen));
  if (f.max_seqlen < 16 || f.dim < 1 || f.heads < 1 || f.repeats < 1)
    throw Error("tour: --max-seqlen must be >= 16 and --dim, --heads, --repeats >= 1, got " +
                std::to_string(f.max_seqlen) + ", " + std::to_string(f.dim) + ", " + std::to_string(f.heads) + ", " +
                std::to_string(f.repeats));
  if (!f.out.empty()) std::filesystem::create_directories(f.out);
  const cost::Architecture cpu = architecture_by_name("cpu", f.threads);
  std::printf("flashattn tour on %s: %s\n", cpu_model().c_str(), cpu.description.c_str());
  std::printf("problems: batch=1 heads=%lld head_dim=%lld dtype=f32 causal=false seqlen=%lld..%lld (doubling) "
              "threads=%d repeats=%d\n",
              static_cast<long long>(f.heads), static_cast<long long>(f.dim), static_cast<long long>(seqlens(f).front()),
              static_cast<long long>(seqlens(f).back()), resolved_threads(f.threads), f.repeats);
  std::printf("measured: sgemm %.1f GFLOP/s, copy %.1f GB/s, clock %.2f GHz (timings on a shared machine are noisy;\n"
              "compare the columns of one table, taken in the same process)\n",
              cpu.mma_tf32 * cpu.units * cpu.clock_ghz, cpu.hbm_bytes_per_second * 1e-9, cpu.clock_ghz);
  const std::vector<SizePoint> sizes = chapter_standard(f);
  chapter_tiling(f, sizes);
  chapter_partitioning(f);
  chapter_asynchrony(f, cpu);
  chapter_exp_unit(f, cpu);
  std::printf("\nMore: `flashattn explain --help` prints the whole account of one problem; docs/cost_model.md\n"
              "states the model and its sources.\n");
}

}  // namespace flashattn::cli
