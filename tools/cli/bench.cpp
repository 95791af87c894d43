// `flashattn bench`: the performance floor, measured in one process as ratios to
// baselines measured beside it (OpenBLAS sgemm, standard attention).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <iostream>
#include <optional>
#include <random>

#include "tools/baseline/standard_attention.hpp"
#include "tools/cli/bench_sweep.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/decode.hpp"
#include "tools/cli/serve.hpp"
#include "tools/cli/machine.hpp"
#include "tools/cli/masks.hpp"
#include "tools/cli/measure.hpp"
#include "tools/cli/peaks.hpp"
#include "tools/cli/report.hpp"

namespace flashattn::cli {
namespace {

bool has_op(const BenchFlags& f, const char* op) { return std::find(f.ops.begin(), f.ops.end(), op) != f.ops.end(); }

// --sweep or --quick: the grid or the issue's subset, as JSON or a table, and the plot.
// --quick times its fixed subset (its targets need every case of it): --ops is refused there;
// --sweep times fwd and bwd only, and refuses the other ops by name; neither takes a decode kernel.
void sweep_or_quick(const BenchFlags& f) {
  if (f.quick && f.given.count("--ops") > 0)
    throw Error("--ops: --quick times its fixed subset (fwd and bwd of issue 7's cases); drop --ops or use --sweep");
  for (const std::string& op : f.ops)  // the default --ops (with decode) means "all it times"
    if (f.sweep && f.given.count("--ops") > 0 && op != "fwd" && op != "bwd")
      throw Error("--ops: --sweep times fwd and bwd only, got " + op);
  if (is_decode_kernel(f.shape.kernel))
    throw Error("--kernel " + f.shape.kernel + ": --sweep and --quick time no decode case");
  SweepFlags s = f.grid;
  s.shape = f.shape;
  s.repeats = f.repeats;
  s.sgemm_n = f.sgemm_n;
  s.ops.clear();
  for (const char* op : {"fwd", "bwd"})
    if (f.quick || has_op(f, op)) s.ops.push_back(op);
  sweep(s, f.quick, f.json, f.plot);
}

// The kernel requests checked before the baselines (minutes on a slow machine) run: each one
// against the cases it applies to, planned on this CPU (ShapeFlags::set_case_dtype: tiled_bf16
// to the bf16 cases, decode kernels to the decode cases only), and a request no timed case
// would run refused by name.
void check_kernels(const BenchFlags& f) {
  const ForwardKernel forward_kernel = parse_forward_kernel(f.shape.kernel);
  if (is_decode_kernel(f.shape.kernel) && !has_op(f, "decode"))
    throw Error("--kernel " + f.shape.kernel + ": applies to the decode cases, and --ops has no decode");
  if (parse_backward_kernel(f.shape.backward_kernel) != BackwardKernel::automatic && !has_op(f, "bwd"))
    throw Error("--backward-kernel " + f.shape.backward_kernel +
                ": applies to the backward cases, and --ops has no bwd");
  const CpuHardware hw = CpuHardware::detect(f.shape.threads);
  for (const char* dtype : {"f32", "bf16"}) {
    ShapeFlags shape = f.shape;
    shape.set_case_dtype(dtype);
    const AttentionOptions options = shape.options();
    const AttentionProblem p = shape.problem(options);
    if (has_op(f, "fwd")) plan_forward(p, hw, options);
    if (has_op(f, "bwd")) plan_backward(p, hw, false, options.backward_kernel);
  }
  // The decode cases: bf16 caches and FP8 / int8 (u8, s8) ones, which decode_fp16 and
  // decode_bf16 take (the library's choose_kernel states the same needs).
  if (!has_op(f, "decode")) return;
  if (forward_kernel == ForwardKernel::decode_fp16 && !hw.decode_fp16)
    throw Error("--kernel decode_fp16: needs a CPU with AVX512-FP16 (this one: no); use --kernel decode or auto");
  if (forward_kernel == ForwardKernel::decode_bf16 && !(hw.decode_bf16 && hw.int8_dot))
    throw Error(std::string("--kernel decode_bf16: needs a CPU with AVX512-BF16 (this one: ") +
                (hw.decode_bf16 ? "yes" : "no") + ") and, for the int8 cases, AVX512-VNNI (this one: " +
                (hw.int8_dot ? "yes" : "no") + "); use --kernel decode or auto");
}

void bench_cases(const BenchFlags& f) {
  check_kernels(f);
  const int threads = resolved_threads(f.shape.threads);
  std::cerr << "sgemm " << f.sgemm_n << "^3 on " << threads << " threads (OpenBLAS "
            << baseline::openblas_corename() << ")\n";
  BenchReport r;
  r.threads = f.shape.threads;
  r.sgemm_gflops = baseline::sgemm_gflops(f.sgemm_n, threads, f.repeats);
  r.peaks = measure_peaks(threads, f.repeats);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let BLAS workers park
  // A timed case without its output tensor, which the report does not need.
  auto add = [&r](Measurement m, const AttentionProblem& p, std::optional<double> kept = std::nullopt) {
    m.out = Tensor();
    r.cases.push_back({std::move(m), p, kept});
  };
  for (const char* dtype : {"f32", "bf16"}) {
    for (bool causal : {false, true}) {
      ShapeFlags shape = f.shape;
      shape.set_case_dtype(dtype);
      shape.causal = causal;
      const AttentionProblem p = shape.problem();
      std::cerr << "case " << p.describe() << "\n";
      const Inputs in = random_inputs(p, 7);
      const bool fwd = has_op(f, "fwd");
      const bool bwd = has_op(f, "bwd");
      for (Impl impl : {Impl::flashattn, Impl::standard})
        if (fwd) add(measure_forward(impl, p, shape.options(), in, f.repeats), p);
      if (!bwd) continue;
      AttentionOptions det = shape.options();
      det.deterministic = true;
      add(measure_backward(Impl::flashattn, p, shape.options(), in, f.repeats), p);
      add(measure_backward(Impl::flashattn, p, det, in, f.repeats), p);
      add(measure_backward(Impl::standard, p, shape.options(), in, f.repeats), p);
    }
  }
  {  // Sliding window (512 left, 0 right) beside the full causal cases above: skipped tiles.
    ShapeFlags shape = f.shape;
    shape.set_case_dtype("f32");
    shape.causal = true;
    AttentionOptions options = shape.options();
    options.window_size = {512, 0};
    const AttentionProblem p = shape.problem(options);
    std::cerr << "case " << p.describe() << "\n";
    const Inputs in = random_inputs(p, 7);
    if (std::find(f.ops.begin(), f.ops.end(), "fwd") != f.ops.end())
      add(measure_forward(Impl::flashattn, p, options, in, f.repeats), p);
    if (std::find(f.ops.begin(), f.ops.end(), "bwd") != f.ops.end())
      add(measure_backward(Impl::flashattn, p, options, in, f.repeats), p);
  }
  // Block-sparse (128-token blocks, a random quarter or half kept): time should follow
  // the kept fraction, against the full non-causal f32 case above.
  for (double kept : {0.25, 0.5}) {
    if (std::find(f.ops.begin(), f.ops.end(), "fwd") == f.ops.end()) break;
    ShapeFlags shape = f.shape;
    shape.set_case_dtype("f32");
    shape.causal = false;
    constexpr std::int64_t kBlock = 128;
    const std::int64_t sq = shape.seqlen_q.value_or(shape.seqlen), sk = shape.seqlen_k.value_or(shape.seqlen);
    Tensor mask(DType::u8, {(sq + kBlock - 1) / kBlock, (sk + kBlock - 1) / kBlock});
    std::mt19937_64 rng(3);
    std::int64_t kept_blocks = 0;
    for (std::int64_t e = 0; e < mask.numel(); ++e) {
      const bool keep = std::uniform_real_distribution<double>(0.0, 1.0)(rng) < kept;
      mask.set(e, keep ? 1.0f : 0.0f);
      kept_blocks += keep;
    }
    AttentionOptions options = shape.options();
    options.block_mask = mask.view();
    options.block_mask_block_size = kBlock;
    const AttentionProblem p = shape.problem(options);
    std::cerr << "case " << p.describe() << "\n";
    const Inputs in = random_inputs(p, 7);
    add(measure_forward(Impl::flashattn, p, options, in, f.repeats), p,
        static_cast<double>(kept_blocks) / static_cast<double>(mask.numel()));
  }
  // Decoding (32 q / 8 kv heads, D 128): one token over a 32k-token cache, bf16, FP8 e4m3 or
  // int8 (u8, s8; per-token scales), contiguous and paged, beside the machine's copy bandwidth
  // and its read bandwidth on the bench's threads (read_gbps: what a decode step, which only
  // reads, approaches); then a batch of 32 sequences of 1024 tokens (the same bytes) decoding
  // in one call, as an inference engine's step does, paged by 16. Then two bf16 shapes of
  // their own: multi-head attention (32 / 32 heads, D 128, one row per kv head) over 4096
  // tokens, and a small model's step (8 / 2 heads, D 64: the model of bench/transformers_e2e.py)
  // over 1024 tokens, where the call's fixed cost shows.
  if (std::find(f.ops.begin(), f.ops.end(), "decode") != f.ops.end()) {
    r.copy_gbps = copy_gbps(f.repeats);
    r.read_gbps = read_gbps(f.repeats, f.shape.threads);
    auto time_decode = [&](std::int64_t batch, std::int64_t cached, const std::string& format, std::int64_t page_size,
                           std::int64_t heads = 32, std::int64_t heads_kv = 8, std::int64_t dim = 128) {
      DecodeCase c;
      c.heads = heads;
      c.heads_kv = heads_kv;
      c.dim = dim;
      c.threads = f.shape.threads;
      c.batch = batch;
      c.cached = cached;
      c.page_size = page_size;
      c.cache_format = format;
      // --kernel decode applies to every decode case, decode_fp16 and decode_bf16 to the
      // quantized ones (format "" is the bf16 cache); others (the forward's kernels) leave the
      // planner's choice here.
      const ForwardKernel k = parse_forward_kernel(f.shape.kernel);
      const bool narrow = k == ForwardKernel::decode_fp16 || k == ForwardKernel::decode_bf16;
      if (k == ForwardKernel::decode || (narrow && !format.empty())) c.kernel = k;
      std::cerr << "decode case: " << batch << " x " << cached << " tokens, " << heads << " / " << heads_kv
                << " heads, D " << dim << ", " << c.cache_name() << " cache, page size " << page_size << "\n";
      r.decode.push_back({c, measure_decode(c, f.repeats)});
    };
    for (const char* format : {"", "e4m3", "u8", "s8"}) {
      for (std::int64_t page_size : {0, 16, 256}) time_decode(1, 32768, format, page_size);
      time_decode(32, 1024, format, 16);
    }
    time_decode(1, 4096, "", 0, 32, 32, 128);
    time_decode(1, 1024, "", 0, 8, 2, 64);
  }
  // Serving: issue 23's batch of prefill chunks and decode rows (serve), or a small one of
  // the same kinds (serve_smoke), in one call against one call per sequence; with the shared
  // prefix and small-chunk steps (serve.hpp).
  for (const char* op : {"serve", "serve_smoke"}) {
    if (std::find(f.ops.begin(), f.ops.end(), op) == f.ops.end()) continue;
    if (!r.copy_gbps) r.copy_gbps = copy_gbps(f.repeats);
    if (!r.read_gbps) r.read_gbps = read_gbps(f.repeats, f.shape.threads);
    ServeCase c = std::string(op) == "serve" ? ServeCase::issue() : ServeCase::smoke();
    c.threads = f.shape.threads;
    std::cerr << "serve case: " << c.name << "\n";
    r.serve.push_back({c, measure_serve(c, f.repeats)});
  }
  // Masks: issue 24's document mask as mask_mod, varlen and a dense boolean mask beside the
  // unmasked kernel, and a relative-bias score_mod beside causal (masks), or a small one of the
  // same kinds (masks_smoke).
  for (const char* op : {"masks", "masks_smoke"}) {
    if (std::find(f.ops.begin(), f.ops.end(), op) == f.ops.end()) continue;
    MaskCase c = std::string(op) == "masks" ? MaskCase::issue() : MaskCase::smoke();
    c.threads = f.shape.threads;
    std::cerr << "masks case: " << c.name << ", " << c.documents << " documents of " << c.document_tokens
              << " tokens\n";
    r.masks.push_back({c, measure_masks(c, f.repeats)});
  }
  // Extra memory against sequence length, from the plans the kernels execute (their only
  // allocations): flashattn grows linearly, standard attention with the square.
  for (std::int64_t seqlen : {1024, 2048, 4096, 8192, 16384, 32768, 65536}) {
    ShapeFlags shape = f.shape;
    shape.seqlen = seqlen;
    shape.seqlen_q.reset();
    shape.seqlen_k.reset();
    shape.dtype = "f32";
    shape.causal = false;
    const AttentionProblem p = shape.problem();
    const CpuHardware hw = CpuHardware::detect(f.shape.threads);
    const double square = static_cast<double>(p.seqlen_q) * static_cast<double>(p.seqlen_k) * sizeof(float);
    r.memory_scaling.push_back(
        {seqlen, plan_forward(p, hw).workspace_bytes(), plan_backward(p, hw, false).workspace_bytes(), square,
         2.0 * square});
  }
  {  // every case bounded by a peak: measured again beside them (confirm_peaks)
    std::vector<std::pair<std::string, double>> bounded;
    for (const TimedCase& c : r.cases) bounded.emplace_back(c.m.kernel, c.m.gflops);
    for (const MasksRun& k : r.masks)
      for (const MaskRun& run : k.m.runs) bounded.emplace_back(run.kernel, run.gflops);
    confirm_peaks(r.peaks, bounded, threads, f.repeats);
  }
  // The other baselines likewise, once after the cases, each keeping its best: a measurement
  // the host disturbed (a vCPU held back, as the peaks' was once at half the machine's) would
  // otherwise inflate every ratio over it.
  r.sgemm_gflops = std::max(r.sgemm_gflops, baseline::sgemm_gflops(f.sgemm_n, threads, f.repeats));
  if (r.copy_gbps) r.copy_gbps = std::max(*r.copy_gbps, copy_gbps(f.repeats));
  if (r.read_gbps) r.read_gbps = std::max(*r.read_gbps, read_gbps(f.repeats, f.shape.threads));
  if (f.json) {
    std::cout << bench_json(r) << "\n";
    return;
  }
  const double sgemm = r.sgemm_gflops;
  {
    const AttentionProblem p = f.shape.problem();
    std::printf("flashattn bench: batch=%lld seqlen_q=%lld seqlen_k=%lld heads_q=%lld heads_kv=%lld head_dim=%lld "
                "head_dim_v=%lld dtypes=f32,bf16 causal=false,true (each case's mask below) repeats=%d\n",
                static_cast<long long>(p.batch), static_cast<long long>(p.seqlen_q), static_cast<long long>(p.seqlen_k),
                static_cast<long long>(p.heads_q), static_cast<long long>(p.heads_kv), static_cast<long long>(p.head_dim),
                static_cast<long long>(p.head_dim_v), f.repeats);
  }
  std::printf("cpu: %s, %d threads, simd %s, OpenBLAS %s: sgemm %.1f GFLOP/s\n", cpu_model().c_str(), threads,
              cpu_simd_target().c_str(), baseline::openblas_corename().c_str(), sgemm);
  print_peaks(r.peaks);
  std::printf("GFLOP/s count visible pairs only; /peak: over the peak that bounds the case (its kernel's)\n");
  std::printf("%-10s %-4s %-6s %-6s %10s %9s %8s %8s %12s  %s\n", "impl", "op", "determ", "dtype", "mask",
              "GFLOP/s", "/sgemm", "/peak", "seconds", "kernel");
  for (const TimedCase& c : r.cases) {
    const Measurement& m = c.m;
    const Peak& peak = *r.peaks.bound_of(m.kernel).peak;
    std::printf("%-10s %-4s %-6s %-6s %10s %9.1f %7.0f%% %8s %12.4f  %s\n", impl_name(m.impl), m.op == Op::fwd ? "fwd" : "bwd",
                m.op == Op::bwd ? (m.deterministic ? "yes" : "no") : "-", to_string(c.p.dtype).c_str(),
                c.block_kept_fraction ? "blocks"
                : states_window(c.p)  ? "window"
                : c.p.causal          ? "causal"
                                      : "full",
                m.gflops, 100.0 * m.gflops / sgemm, percent_of_peak(m.gflops, peak).c_str(), m.seconds,
                m.kernel.empty() ? "-" : m.kernel.c_str());
  }
  for (const ServeRun& s : r.serve) {
    std::printf("%-10s serve %-5s one call %.4f s, per sequence %.4f s (%.2fx); decode rows %.2f GB/s (%3.0f%% of copy, "
                "%3.0f%% of read)\n",
                "flashattn", s.c.name.c_str(), s.m.seconds, s.m.per_sequence_seconds,
                s.m.per_sequence_seconds / s.m.seconds, s.m.decode_gbps, 100.0 * s.m.decode_gbps / r.copy_gbps.value_or(0.0),
                100.0 * s.m.decode_gbps / r.read_gbps.value_or(0.0));
    std::printf("%-10s serve %-5s %lld sequences sharing a %lld-token prefix, %lld own: shared %.4f s, unshared %.4f s "
                "(%.2fx)\n",
                "flashattn", s.c.name.c_str(), static_cast<long long>(s.c.shared_sequences),
                static_cast<long long>(s.c.shared_prefix), static_cast<long long>(s.c.shared_own),
                s.m.shared_prefix_seconds, s.m.unshared_prefix_seconds,
                s.m.unshared_prefix_seconds / s.m.shared_prefix_seconds);
    std::printf("%-10s serve %-5s %lld sequences of %lld new tokens over %lld cached: %.4f s, pack_gqa off %.4f s "
                "(%.2fx); %.2f GB/s of K/V (%3.0f%% of copy)\n",
                "flashattn", s.c.name.c_str(), static_cast<long long>(s.c.chunk_sequences),
                static_cast<long long>(s.c.chunk_rows), static_cast<long long>(s.c.chunk_cached), s.m.chunk_seconds,
                s.m.chunk_unpacked_seconds, s.m.chunk_unpacked_seconds / s.m.chunk_seconds, s.m.chunk_gbps,
                100.0 * s.m.chunk_gbps / r.copy_gbps.value_or(0.0));
  }
  for (const MasksRun& k : r.masks) {
    std::printf("masks %s: %lld documents of %lld tokens, %lld heads, D %lld, %s; create_block_mask %.4f s\n",
                k.c.name.c_str(), static_cast<long long>(k.c.documents), static_cast<long long>(k.c.document_tokens),
                static_cast<long long>(k.c.heads), static_cast<long long>(k.c.dim), to_string(k.c.dtype).c_str(),
                k.m.create_block_mask_seconds);
    for (const MaskRun& run : k.m.runs)
      std::printf("%-10s masks %-10s %9.1f GFLOP/s %8s %12.4f  %s\n", "flashattn", run.form.c_str(), run.gflops,
                  percent_of_peak(run.gflops, *r.peaks.bound_of(run.kernel).peak).c_str(), run.seconds,
                  run.kernel.c_str());
    std::printf("masks %s: mask_mod / varlen %.2f (block %lld), dense_bool / unmasked %.2f (dense_bool / varlen %.2f), "
                "score_mod / causal %.2f (GFLOP/s)\n",
                k.c.name.c_str(), k.m.run("mask_mod").gflops / k.m.run("varlen").gflops, static_cast<long long>(k.c.block),
                k.m.run("dense_bool").gflops / k.m.run("unmasked").gflops,
                k.m.run("dense_bool").gflops / k.m.run("varlen").gflops,
                k.m.run("score_mod").gflops / k.m.run("causal").gflops);
  }
  for (const DecodeRun& d : r.decode)
    std::printf("%-10s %-4s %-6s %2lld/%-2lld heads D %-3lld %2lld x %-5lld tokens, page size %-5lld %6.2f GB/s (%3.0f%% of copy, %3.0f%% of read) %12.6f  %s\n",
                "flashattn", "dec", d.c.cache_name().c_str(), static_cast<long long>(d.c.heads),
                static_cast<long long>(d.c.heads_kv), static_cast<long long>(d.c.dim),
                static_cast<long long>(d.c.batch), static_cast<long long>(d.c.cached),
                static_cast<long long>(d.c.page_size), d.m.gbps, 100.0 * d.m.gbps / r.copy_gbps.value_or(0.0),
                100.0 * d.m.gbps / r.read_gbps.value_or(0.0),
                d.m.seconds, d.m.kernel.c_str());
}

}  // namespace

void bench(const BenchFlags& f) {
  if (f.sweep || f.quick) return sweep_or_quick(f);
  if (!f.plot.empty()) throw Error("--plot: needs --sweep or --quick");
  bench_cases(f);
}

}  // namespace flashattn::cli
